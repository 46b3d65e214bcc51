"""safetensors headers: read (validated as strictly as safetensors' loader) and write.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{"__metadata__": {...}, name: {"dtype", "shape", "data_offsets": [begin, end]}, ...}``,
padded with spaces to a multiple of 8), then the tensor bytes, offsets counted from byte
``8 + N``. Reading needs no safetensors install; where it is installed its loader is asked
too, so a file it would refuse is refused here.
"""

import json
import math
import os
import struct
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from ..errors import CheckpointError
from ..guards import StrPath, open_regular
from .dtypes import FLOATS, SIZES

__all__ = ["TensorEntry", "Header", "read_header", "read_hf_dir", "encode_header", "floating_dtypes", "MAX_HEADER",
           "METADATA"]

MAX_HEADER = 100 * 2**20  # safetensors' own limit (MAX_HEADER_SIZE)
METADATA = {"format": "pt"}  # what save_pretrained (and safetensors.torch) write


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file: its dtype, shape, and absolute byte range in the file."""

    dtype: str
    shape: Tuple[int, ...]
    offset: int
    nbytes: int


class Header(NamedTuple):
    """A validated header: ``tensors`` by name (in file order), ``metadata``, where the data starts."""

    tensors: Dict[str, TensorEntry]
    metadata: Dict[str, str]
    data_start: int
    file_size: int


def read_header(path: StrPath, *, check_loader: bool = True) -> Header:
    """Parse ``path``'s header as strictly as safetensors' loader does (``Metadata::validate``): a
    JSON object with no name twice, known dtypes, shapes of non-negative integers, data offsets laid
    end to end from 0 in order with no hole, overlap or trailing byte, each ``numel * itemsize`` long.
    With ``check_loader`` the installed ``safetensors`` opens it too.

    Raises :class:`~..errors.CheckpointError` naming the file and what is wrong.
    """
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a valid safetensors file ({what}); safetensors would refuse "
                               "to load it: export it again")

    try:
        with open_regular(path, what="the safetensors file") as fh:  # a FIFO refuses, never hangs
            raw = fh.read(8)
            if len(raw) != 8:
                raise bad("shorter than its 8-byte header length")
            n = struct.unpack("<Q", raw)[0]
            size = os.fstat(fh.fileno()).st_size
            if n > min(size - 8, MAX_HEADER):
                raise bad(f"header length {n} exceeds the file or {MAX_HEADER} bytes")
            text = fh.read(n).decode("utf-8")

        def no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
            keys = [k for k, _ in pairs]
            if len(set(keys)) != len(keys):
                raise bad("a name appears twice in the header")
            return dict(pairs)

        header = json.loads(text, object_pairs_hook=no_duplicates)
    except OSError as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e}); export it again") from e
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise bad(f"header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ is not a map of strings")
    entries: List[Tuple[int, int, str, str, Tuple[int, ...]]] = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in SIZES:
            raise bad(f"{name}: dtype {dtype!r} unknown")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"{name}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise bad(f"{name}: data_offsets {offsets!r} are not [begin, end]")
        if offsets[1] - offsets[0] != math.prod(shape) * SIZES[dtype]:
            raise bad(f"{name}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")
        entries.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    entries.sort()
    end = 0
    out: Dict[str, TensorEntry] = {}
    base = 8 + n
    for start, stop, name, dtype, shape in entries:
        if start != end:
            raise bad(f"{name}: data starts at {start}, the previous tensor ends at {end} (a hole or an overlap)")
        end = stop
        out[name] = TensorEntry(dtype, shape, base + start, stop - start)
    if base + end != size:
        raise bad(f"the tensors end at byte {base + end} of {size} (truncated, or trailing bytes)")
    if check_loader:
        opener: Optional[Callable[..., Any]]
        try:  # and the loader itself, where installed (it is what from_pretrained uses)
            from safetensors import safe_open as opener
        except ImportError:
            opener = None
        if opener is not None:
            try:
                with opener(path, framework="numpy") as f:
                    f.keys()
            except Exception as e:
                raise bad(f"safetensors: {type(e).__name__}: {str(e)[:200]}") from None
    return Header(out, meta, base, size)


def encode_header(tensors: Iterable[Tuple[str, str, Tuple[int, ...]]], metadata: Optional[Dict[str, str]] = None) -> bytes:
    """The header for ``(name, dtype, shape)`` tensors laid end to end in the given order: the
    u64 length, then the JSON padded with spaces to 8 bytes (``metadata`` defaults to
    :data:`METADATA`)."""
    meta: Dict[str, Dict[str, Any]] = {"__metadata__": dict(METADATA if metadata is None else metadata)}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = SIZES[dtype] * math.prod(shape)
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def floating_dtypes(paths: Iterable[StrPath]) -> Set[str]:
    """The floating dtypes of the tensors in the safetensors files ``paths`` (headers validated)."""
    out: Set[str] = set()
    for p in paths:
        out |= {e.dtype for e in read_header(p, check_loader=False).tensors.values() if e.dtype in FLOATS}
    return out


def read_hf_dir(path: StrPath, *, weights: Optional[str] = None) -> Dict[str, Tuple[str, str, Tuple[int, ...], int, int]]:
    """name -> (file, dtype, shape, byte offset, nbytes) for every tensor of the safetensors HF
    directory ``path`` (its index and the shards it names, or ``model.safetensors``), every header
    validated (:func:`read_header`). ``weights``: read this file of ``path`` (a ``*.safetensors`` or
    ``*.safetensors.index.json`` name) instead of choosing. Raises :class:`~..errors.CheckpointError`
    for a directory ``from_pretrained`` would misread: no weights, a tensor in two shards, an index
    that disagrees with its shards."""
    from .names import ADAPTER_SAFETENSORS_NAME, SAFETENSORS_INDEX, SAFETENSORS_NAME, read_index

    path = os.fspath(path)
    index = os.path.join(path, weights if weights is not None and weights.endswith(".index.json")
                         else SAFETENSORS_INDEX)
    weight_map = None
    if weights is not None and not weights.endswith(".index.json"):
        files = [weights]
    elif os.path.isfile(index):
        weight_map = read_index(index)
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(path, SAFETENSORS_NAME)):
        files = [SAFETENSORS_NAME]
    elif os.path.isfile(os.path.join(path, ADAPTER_SAFETENSORS_NAME)):  # a PEFT adapter directory
        files = [ADAPTER_SAFETENSORS_NAME]
    else:
        raise CheckpointError(f"{path}: no {SAFETENSORS_NAME} or {SAFETENSORS_INDEX}; pass the directory "
                              "`hf-ckpt export` wrote")
    out: Dict[str, Tuple[str, str, Tuple[int, ...], int, int]] = {}
    for f in files:
        full = os.path.join(path, f)
        for name, (dtype, shape, off, nbytes) in read_header(full).tensors.items():
            if name in out:
                raise CheckpointError(f"{full}: tensor {name} is also in {out[name][0]}; from_pretrained would "
                                      "load one of them: export it again")
            out[name] = (full, dtype, shape, off, nbytes)
    if weight_map is not None:
        stray = sorted(n for n in set(weight_map) | set(out)
                       if n not in out or n not in weight_map or out[n][0] != os.path.join(path, weight_map[n]))
        if stray:
            raise CheckpointError(f"{index}: its weight_map and the shards disagree on {stray[:3]}; "
                                  "from_pretrained would miss tensors: export it again")
    return out
