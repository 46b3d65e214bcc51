"""Read torch zip checkpoints without running code from the pickle and without torch.

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (the object tree) and one stored,
uncompressed entry ``<name>/data/<key>`` per storage. :func:`load` unpickles ``data.pkl`` with
:mod:`.unpickler` and an allowlist: by default plain containers and torch's tensor-rebuild
functions (:data:`TORCH_ALLOWED`); a source whose files pickle more (DeepSpeed's value types)
passes its own list.

Tensors come back as :class:`TensorRef`: dtype, shape, stride and the absolute byte offset of
their storage in the file, each view proven to lie inside its own storage. Reading a tensor is
then a byte-range read (``mmap``), so a 10 GB optimizer file whose ``exp_avg`` we never touch
costs only its pickle. Every zip entry's local header is checked against the central directory
(a damaged one would shift the byte ranges), and :func:`check_crc` checks the CRC-32 of the
storages a set of byte ranges reads.

torch.save's legacy (non-zip) format is read by the same unpickler with the same allowlist
(:mod:`.torch_legacy`): its storages follow the pickles, each after an 8-byte element count.
"""

import functools
import math
import mmap
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol, Tuple

from .. import guards
from ..guards import StrPath
from ..errors import CheckpointError, UnsafeCheckpointError, short_repr
from .dtypes import MAX_NDIM, SIZES as DTYPE_SIZES, STORAGE_CLASSES, TORCH_NAMES
from . import torch_legacy
from .torch_legacy import is_legacy
from .unpickler import CLIENT_STATE, CONTAINERS, MAX_PICKLE_BYTES, Allowlist, Leaf, loads

__all__ = ["TensorRef", "StorageRef", "TORCH_GLOBALS", "TORCH_ALLOWED", "TORCH_TENSOR_ALLOWED", "load",
           "is_legacy", "check_crc", "FileWindow", "CRC_BLOCK"]


class SeekableInput(Protocol):
    """A readable, seekable binary file: an open checkpoint file, or a :class:`FileWindow` into one."""

    def seek(self, offset: int, whence: int = 0, /) -> int: ...

    def read(self, n: int = -1, /) -> bytes: ...

    def tell(self) -> int: ...


@dataclass(frozen=True)
class StorageRef:
    """One storage entry of a torch zip file: ``numel`` elements of ``dtype`` at byte ``offset``."""

    path: str
    key: str
    dtype: str
    numel: int
    offset: int


@dataclass(frozen=True)
class TensorRef(Leaf):
    """A tensor inside a checkpoint file, not yet read."""

    storage: StorageRef
    storage_offset: int  # in elements
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def path(self) -> str:
        return self.storage.path

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def byte_range(self, start: int = 0, count: Optional[int] = None) -> Tuple[int, int]:
        """Absolute ``(offset, nbytes)`` of flat elements ``[start, start+count)`` in the file."""
        if not self.is_contiguous():
            raise CheckpointError(f"{self.path}: tensor in storage {self.storage.key} is not contiguous; "
                                  "this layout is not supported, please report it")
        count = self.numel - start if count is None else count
        return (self.storage.offset + (self.storage_offset + start) * self.itemsize, count * self.itemsize)


def _tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> "TensorRef":
    """A :class:`TensorRef`, refused unless every element it views lies inside its storage (a view
    reaching outside would export the zip's own headers, or another storage, as weights)."""
    if not isinstance(storage, StorageRef):
        raise CheckpointError(f"tensor built on {type(storage).__name__}, not a storage")
    where = f"{storage.path}: a tensor in storage {storage.key}"
    shape = guards.dims(size, "shape", where, limit=MAX_NDIM)  # non-negative: checked there
    stride = guards.dims(stride, "stride", where, limit=MAX_NDIM)
    if type(storage_offset) not in (int, bool) or len(stride) != len(shape) or storage_offset < 0:
        raise CheckpointError(f"{where} has an invalid view (offset {short_repr(storage_offset)}, shape "
                              f"{list(shape)}, stride {list(stride)}); the file is corrupt, copy it again")
    last = int(storage_offset) + sum((d - 1) * st for d, st in zip(shape, stride))
    if (0 not in shape and last >= storage.numel) or storage_offset > storage.numel:
        raise CheckpointError(f"{where} reaches element {last} of a storage of {storage.numel}; the file "
                              "is corrupt or crafted: copy it again from the training run")
    return TensorRef(storage, int(storage_offset), shape, stride)


# The rebuild functions' arguments come from the pickle: anything, until _tensor checks them.
def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> TensorRef:
    return _tensor(storage, storage_offset, size, stride)


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any) -> TensorRef:
    return _tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None, state: Any = None) -> Any:
    return data


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # ZeRO-3 saves partitions (``ds_tensor``) that carry attributes: torch pickles them as
    # (rebuild function, tensor type, args, __dict__). Keep the tensor, drop the attributes.
    if func not in (_rebuild_tensor_v2, _rebuild_tensor, _rebuild_parameter):
        raise UnsafeCheckpointError("tensor rebuilt through an unexpected function")
    return func(*args)


class _DtypeMarker(str):
    pass


def _device(*args: Any) -> str:
    # torch.device("cpu") / ("cuda", 0): only atoms (``str`` of a DAG would print 2^N nodes)
    if len(args) > 2 or not all(type(a) in (str, int) for a in args):
        raise CheckpointError(f"torch.device{short_repr(args)} is not a device")
    return str(args[0]) if args else ""


def _guarded_size(dims: Any = ()) -> Tuple[int, ...]:
    return guards.dims(dims, "tensor shape", limit=MAX_NDIM)


# torch.Size and the torch dtypes (``torch.float32``...): every torch pickle spells them this way.
TORCH_GLOBALS = {"Size": _guarded_size, **{v: _DtypeMarker(k) for k, v in TORCH_NAMES.items()}}

# module -> name -> stand-in: plain containers, the client state saved beside the weights (inert
# records: :data:`~.unpickler.CLIENT_STATE`), torch's tensor rebuilds, dtypes and storage types.
TORCH_ALLOWED = {
    **CONTAINERS,
    **CLIENT_STATE,
    "torch._utils": {"_rebuild_tensor_v2": _rebuild_tensor_v2, "_rebuild_tensor": _rebuild_tensor,
                     "_rebuild_parameter": _rebuild_parameter,
                     "_rebuild_parameter_with_state": _rebuild_parameter},
    "torch._tensor": {"_rebuild_from_type_v2": _rebuild_from_type_v2},
    "torch": {"Size": _guarded_size, "Tensor": "Tensor", "device": _device,
              **{k: _DtypeMarker(v) for k, v in STORAGE_CLASSES.items()},
              **{v: _DtypeMarker(k) for k, v in TORCH_NAMES.items()}},
    "torch.nn.parameter": {"Parameter": "Parameter"},
    "torch.storage": {"UntypedStorage": _DtypeMarker("U8")},
}


# The allowlist of a pickle holding only tensors (one chunk of a torch DCP .distcp file).
# (torch's tensor rebuild takes an empty OrderedDict of backward hooks)
TORCH_TENSOR_ALLOWED = {m: v for m, v in TORCH_ALLOWED.items() if m in ("torch", "collections") or m.startswith("torch.")}


def _storages_loader(path: str, storages: Mapping[str, Tuple[int, int]]) -> Callable[[Any], StorageRef]:
    """``persistent_load`` for a torch zip's pickle: a storage id becomes a :class:`StorageRef` of
    the entry ``storages`` maps its key to (``(absolute offset, nbytes)``)."""
    def persistent_load(pid: Any) -> StorageRef:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"{path}: refused for safety: unexpected persistent id "
                                        f"{short_repr(pid)}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, _DtypeMarker):
            raise UnsafeCheckpointError(f"{path}: refused for safety: storage of unknown type "
                                        f"{short_repr(dtype)}")
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise CheckpointError(f"{path}: a storage reference ({short_repr(key)}, "
                                  f"{short_repr(numel)} elements) is malformed; the file is corrupt")
        # torch.load reads <archive>/data/<key> of data.pkl's own archive, and nothing else
        entry = storages.get(key)
        if entry is None:
            raise CheckpointError(f"{path}: storage {short_repr(key)} is missing from the archive; "
                                  "the file is truncated or corrupt, copy it again from the training run")
        offset, nbytes = entry
        if numel * DTYPE_SIZES[dtype] > nbytes:
            raise CheckpointError(f"{path}: storage {key} is shorter than recorded; "
                                  "the file is corrupt, copy it again from the training run")
        return StorageRef(path, key, str(dtype), numel, offset)
    return persistent_load


def _check_local_entry(fh: SeekableInput, info: zipfile.ZipInfo, path: str) -> int:
    """Cross-check an entry's local header (and data descriptor) with the central directory and
    return the absolute offset of its data.

    Only the central directory is read by ``zipfile``; the data offset comes from the local
    header's name and extra lengths. A damaged local header would otherwise shift every byte
    range read from that entry (a silently wrong tensor), so the two copies must agree.
    """
    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: bad zip entry {info.filename} ({what}); the file is corrupt, "
                               "copy it again from the training run")

    fh.seek(info.header_offset)
    header = fh.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise corrupt("no local header where the central directory points")
    flags, method, crc, csize, usize, name_len, extra_len = struct.unpack("<6xHH4xIIIHH", header)
    if method != info.compress_type or (flags & 0x8) != (info.flag_bits & 0x8):
        raise corrupt("local header disagrees with the central directory")
    name = fh.read(name_len)
    encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
    if name != info.orig_filename.encode(encoding, errors="replace"):
        raise corrupt("local file name disagrees with the central directory")
    extra = fh.read(extra_len)
    pos = 0
    while pos + 4 <= len(extra):  # extra field = (id u16, size u16, data) records, exactly filling it
        pos += 4 + struct.unpack("<H", extra[pos + 2:pos + 4])[0]
    if pos != extra_len:
        raise corrupt("malformed extra field")
    offset = info.header_offset + 30 + name_len + extra_len
    if flags & 0x8:  # sizes and CRC follow the data in a descriptor (what torch writes)
        fh.seek(offset + info.compress_size)
        desc = fh.read(12)
        if desc[:4] == b"PK\x07\x08":
            desc = desc[4:] + fh.read(4)
        if len(desc) != 12 or struct.unpack("<II", desc[:8]) != (info.CRC, info.compress_size & 0xFFFFFFFF):
            raise corrupt("data descriptor disagrees with the central directory")
    elif crc != info.CRC or (csize != 0xFFFFFFFF and csize != info.compress_size) or \
            (usize != 0xFFFFFFFF and usize != info.file_size):
        raise corrupt("local sizes disagree with the central directory")
    return offset


def _stored_entries(zf: zipfile.ZipFile, fh: SeekableInput, file_size: int, path: str,
                    archive: str) -> dict[str, Tuple[int, int]]:
    """Map storage key -> (absolute data offset, nbytes) for every ``<archive>/data/<key>`` entry,
    the names ``torch.load`` resolves (``archive``: data.pkl's directory, ``""`` at the root)."""
    out: dict[str, Tuple[int, int]] = {}
    prefix = f"{archive}/data/" if archive else "data/"
    for info in zf.infolist():
        if not info.filename.startswith(prefix) or "/" in info.filename[len(prefix):]:
            continue
        key = info.filename[len(prefix):]
        if key in out:
            raise CheckpointError(f"{path}: two zip entries named {info.filename}; the file was re-packed or "
                                  "crafted: copy it again from the training run")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path}: storage {info.filename} is compressed; torch never writes that, "
                                  "so the file was re-packed: save it again with torch.save")
        offset = _check_local_entry(fh, info, path)
        if offset + info.file_size > file_size or info.compress_size != info.file_size:
            raise CheckpointError(f"{path}: truncated (storage {key} runs past the end of the file); "
                                  "copy it again from the training run")
        out[key] = (offset, info.file_size)
    return out


def _open_zip(fh: SeekableInput, path: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(fh)
    except zipfile.BadZipFile as e:
        raise CheckpointError(
            f"{path}: not a torch zip checkpoint ({e}); it is truncated, corrupt, or an old-format "
            "torch.save file: copy it again, or re-save it with a current torch") from e


def _pickle_entry(zf: zipfile.ZipFile, path: str) -> zipfile.ZipInfo:
    pkls = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pkls) != 1:
        raise CheckpointError(f"{path}: not a torch checkpoint (no single data.pkl inside)")
    return pkls[0]


def check_crc(path: StrPath, ranges: Iterable[Tuple[int, int]]) -> list[str]:
    """CRC-32 of every storage entry of ``path`` that holds a byte of ``ranges`` (``(offset, nbytes)``
    pairs, absolute), compared with the zip's central directory; return the names that differ.

    ``load`` only checks data.pkl's CRC (the storages are read as byte ranges, never through
    zipfile); ``verify`` calls this to catch a flipped bit in the partitions it used.
    """
    path = os.fspath(path)
    if is_legacy(path):
        return []  # the legacy format records no checksums
    ranges = sorted((o, o + n) for o, n in ranges if n)
    bad: list[str] = []
    with open(path, "rb") as fh, _open_zip(fh, path) as zf:
        archive = os.path.dirname(_pickle_entry(zf, path).filename)
        entries = _stored_entries(zf, fh, os.fstat(fh.fileno()).st_size, path, archive)
        by_offset: dict[int, Tuple[str, int, int]] = {}
        prefix = f"{archive}/data/" if archive else "data/"
        for key, (off, n) in entries.items():
            by_offset[off] = (prefix + key, n, zf.getinfo(prefix + key).CRC)
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for off, (name, n, crc) in sorted(by_offset.items()):
                if not any(lo < off + n and off < hi for lo, hi in ranges):
                    continue
                got = 0
                for pos in range(off, off + n, CRC_BLOCK):
                    got = zlib.crc32(m[pos:min(pos + CRC_BLOCK, off + n)], got)
                if got != crc:
                    bad.append(name)
    return bad


CRC_BLOCK = 16 * 2**20


class FileWindow:
    """Bytes ``[start, start + size)`` of an open file, as a seekable read-only file of ``size``
    bytes: a torch zip archive stored inside a larger file (one chunk of a torch DCP ``.distcp``)."""

    def __init__(self, fh: SeekableInput, start: int, size: int) -> None:
        self._fh, self._start, self._size, self._pos = fh, start, size, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n: Optional[int] = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else min(n, max(0, self._size - self._pos))
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        self._pos += len(data)
        return data


def _legacy_storage(path: str, dtype: Any, key: str, numel: int, offset: int) -> StorageRef:
    """A legacy file's storage reference (see :func:`.torch_legacy.read`), refused unless its
    type is one of torch's storage types."""
    if not isinstance(dtype, _DtypeMarker):
        raise UnsafeCheckpointError(f"{path}: refused for safety: storage of unknown type {short_repr(dtype)}")
    return StorageRef(path, key, str(dtype), numel, offset)


def _load_legacy(path: str, file_size: int, allowed: Allowlist) -> Any:
    """:func:`load` of a legacy-format file: the same restricted unpickler and allowlist, its pickles
    read as a stream (:mod:`.torch_legacy`)."""
    with guards.open_regular(path, what="the checkpoint file") as fh:
        return torch_legacy.read(fh, path, file_size, allowed, functools.partial(_legacy_storage, path))


def load(path: StrPath, *, offset: int = 0, length: Optional[int] = None, allowed: Optional[Allowlist] = None) -> Any:
    """Unpickle the object tree of a torch zip checkpoint safely; tensors become :class:`TensorRef`.

    ``offset``/``length``: the archive is bytes ``[offset, offset + length)`` of ``path`` (a chunk
    of a torch DCP ``.distcp`` file); tensors' offsets stay absolute in ``path``. ``allowed``: the
    allowlist (module -> name -> stand-in), :data:`TORCH_ALLOWED` by default.

    Raises :class:`UnsafeCheckpointError` for a disallowed global, :class:`CheckpointError` for a
    file that is empty, truncated, or not a torch zip checkpoint.
    """
    path = os.fspath(path)
    try:
        file_size = os.path.getsize(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror}); check the path and permissions") from e
    if file_size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes); the save was interrupted, "
                              "use an earlier checkpoint or copy it again")
    size = file_size - offset if length is None else length
    where = path if (offset, size) == (0, file_size) else f"{path} (bytes {offset}+{size})"
    if offset < 0 or size <= 0 or offset + size > file_size:
        raise CheckpointError(f"{where}: truncated (the file has {file_size} bytes); the save was interrupted "
                              "or the copy is incomplete: copy it again from the training run")
    if where == path and is_legacy(path):
        return _load_legacy(path, file_size, TORCH_ALLOWED if allowed is None else allowed)
    try:
        with guards.open_regular(path, what="the checkpoint file") as raw:  # a FIFO or device refuses, never hangs
            fh = raw if where == path else FileWindow(raw, offset, size)
            with _open_zip(fh, where) as zf:
                pkl = _pickle_entry(zf, where)
                if pkl.file_size > MAX_PICKLE_BYTES:
                    raise CheckpointError(f"{where}: its pickle is {pkl.file_size} bytes (over {MAX_PICKLE_BYTES}); "
                                          "no checkpoint's metadata is that large: the file is corrupt or crafted")
                storages = _stored_entries(zf, fh, size, where, os.path.dirname(pkl.filename))
                storages = {k: (o + offset, n) for k, (o, n) in storages.items()}
                try:
                    data = zf.read(pkl)  # checks the entry's CRC-32
                except (zipfile.BadZipFile, EOFError, OSError) as e:
                    raise CheckpointError(f"{where}: corrupt pickle entry ({e}); copy it again") from e
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}); check the path and permissions") from e
    except Exception as e:  # a damaged central directory raises a zoo of types inside zipfile
        raise CheckpointError(f"{where}: corrupt zip structure ({type(e).__name__}: {e}); "
                              "copy it again from the training run") from e
    return loads(data, path=path, where=where, allowed=TORCH_ALLOWED if allowed is None else allowed,
                 persistent_load=_storages_loader(path, storages))
