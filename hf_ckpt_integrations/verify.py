"""Compare an exported HF directory against its source, tensor by tensor, bitwise.

Both sides are re-read: the HF side through its safetensors headers (plain JSON) and byte
ranges, the source side through a fresh plan, cast to each file tensor's dtype.
"""

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .assemble import check_module_copy, iter_bytes
from .errors import CheckpointError
from .safe_load import DTYPE_SIZES, MappedFiles

__all__ = ["VerifyReport", "read_hf_dir", "verify_plan"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
ADAPTER_NAME = "adapter_model.safetensors"


@dataclass
class VerifyReport:
    """``ok`` is true when every tensor matches; ``differences`` names each one that does not."""

    checked: int = 0
    differences: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


_MAX_HEADER = 100 * 2**20  # safetensors' own limit (MAX_HEADER_SIZE)


def _read_header(path) -> Dict[str, Tuple[str, Tuple[int, ...], int, int]]:
    """Parse a safetensors header as strictly as safetensors' loader does (``Metadata::validate``):
    a JSON object, known dtypes, shapes of non-negative integers, data offsets laid end to end from
    0 in order with no hole, overlap or trailing byte, each ``numel * itemsize`` long."""
    def bad(what):
        return CheckpointError(f"{path}: not a valid safetensors file ({what}); safetensors would refuse "
                               "to load it: export it again")

    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise bad("shorter than its 8-byte header length")
            n = struct.unpack("<Q", raw)[0]
            size = os.fstat(fh.fileno()).st_size
            if n > min(size - 8, _MAX_HEADER):
                raise bad(f"header length {n} exceeds the file or {_MAX_HEADER} bytes")
            text = fh.read(n).decode("utf-8")

        def no_duplicates(pairs):
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
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise bad(f"{name}: dtype {dtype!r} unknown")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"{name}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1]):
            raise bad(f"{name}: data_offsets {offsets!r} are not [begin, end]")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise bad(f"{name}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")
        entries.append((offsets[0], offsets[1], name, dtype, tuple(shape)))
    entries.sort()
    end = 0
    out = {}
    base = 8 + n
    for start, stop, name, dtype, shape in entries:
        if start != end:
            raise bad(f"{name}: data starts at {start}, the previous tensor ends at {end} (a hole or an overlap)")
        end = stop
        out[name] = (dtype, shape, base + start, stop - start)
    if base + end != size:
        raise bad(f"the tensors end at byte {base + end} of {size} (truncated, or trailing bytes)")
    try:  # and the loader itself, where installed (it is what from_pretrained uses)
        from safetensors import safe_open
    except ImportError:
        return out
    try:
        with safe_open(path, framework="numpy") as f:
            f.keys()
    except Exception as e:
        raise bad(f"safetensors: {type(e).__name__}: {str(e)[:200]}") from None
    return out
def read_hf_dir(path) -> Dict[str, Tuple[str, str, Tuple[int, ...], int, int]]:
    """name -> (file, dtype, shape, byte offset, nbytes) for every tensor of an HF directory."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e}); export it again") from e
    elif os.path.isfile(os.path.join(path, SINGLE_NAME)):
        files = [SINGLE_NAME]
    elif os.path.isfile(os.path.join(path, ADAPTER_NAME)):  # a PEFT adapter directory
        files = [ADAPTER_NAME]
    else:
        raise CheckpointError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME}; pass the directory `hf-ckpt export` "
                              "wrote")
    out = {}
    for f in files:
        full = os.path.join(path, f)
        for name, (dtype, shape, off, nbytes) in _read_header(full).items():
            if name in out:
                raise CheckpointError(f"{full}: tensor {name} is also in {out[name][0]}; from_pretrained would "
                                      "load one of them: export it again")
            out[name] = (full, dtype, shape, off, nbytes)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
        stray = sorted(n for n in set(weight_map) | set(out)
                       if n not in out or n not in weight_map or out[n][0] != os.path.join(path, weight_map[n]))
        if stray:
            raise CheckpointError(f"{index}: its weight_map and the shards disagree on {stray[:3]}; "
                                  "from_pretrained would miss tensors: export it again")
    return out


def verify_plan(plan, dst) -> VerifyReport:
    """Check that ``dst`` holds exactly the tensors of ``plan``, bitwise."""
    have = read_hf_dir(dst)
    report = VerifyReport()
    expected = {t.name: t for t in plan.tensors}
    for alias, target in plan.aliases.items():
        if alias in have and target in expected:
            expected[alias] = expected[target]
    for name in sorted(set(expected) - set(have)):
        report.differences.append(f"{name}: missing from {dst}")
    for name in sorted(set(have) - set(expected)):
        report.differences.append(f"{name}: in {dst} but not in the source")
    _check_source_crc(plan, report)
    with MappedFiles() as files:
        for name in [t for t in expected if t in have]:
            t = expected[name]
            path, dtype, shape, off, nbytes = have[name]
            report.checked += 1
            if tuple(shape) != tuple(t.shape):
                report.differences.append(f"{name}: shape {list(shape)} != source {list(t.shape)}")
                continue
            if not check_module_copy(t, files):
                report.differences.append(f"{name}: the source's fp32 masters, cast to the module weights' "
                                          "dtype, differ from the module weights it also holds (a rank file "
                                          "out of place, or damaged)")
            if dtype not in DTYPE_SIZES:
                report.differences.append(f"{name}: unknown dtype {dtype}")
                continue
            got = files.read(path, off, nbytes)
            pos = 0
            for chunk in iter_bytes(t, dtype, files):
                if got[pos:pos + len(chunk)] != chunk:
                    report.differences.append(f"{name}: values differ from the source")
                    break
                pos += len(chunk)
            else:
                if pos != nbytes:
                    report.differences.append(f"{name}: {nbytes} bytes in {dst}, {pos} in the source")
    return report


def _check_source_crc(plan, report) -> None:
    """CRC-32 of every zip entry of the source the plan reads (partitions, module weights), against
    the checksum the zip recorded when torch saved it: a flipped bit in a partition is a difference."""
    import zipfile

    from .safe_load import check_crc

    ranges: Dict[str, List[Tuple[int, int]]] = {}
    for t in plan.tensors:
        parts = list(t.parts) + list(t.replicas) + (list(t.module_check[0]) + list(t.module_check[1])
                                                    if t.module_check else [])
        for p in (p for part in parts for p in part):
            ranges.setdefault(p.path, []).append((p.offset, p.numel * DTYPE_SIZES[p.dtype]))
    for path in sorted(ranges):
        if zipfile.is_zipfile(path):
            for entry in check_crc(path, ranges[path]):
                report.differences.append(f"{path}: entry {entry} fails its CRC-32 check (the checksum torch "
                                          "wrote with it): the source file is damaged, copy it again")
