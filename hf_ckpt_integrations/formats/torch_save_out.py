"""Write what ``torch.save`` writes, without importing torch: plain data and tensors whose bytes stream.

``torch.save(obj, "x.pt")`` (torch 2.13, ``torch/serialization.py::_save``, written by
``caffe2/serialize/inline_container.cc``'s ``PyTorchStreamWriter``) is a zip archive of stored
(uncompressed) records under the directory ``x/``, in this order: ``data.pkl`` (the object, pickle
protocol 2, each tensor reduced to ``torch._utils._rebuild_tensor_v2((persistent id ('storage',
torch.<Dtype>Storage, key, 'cpu', numel)), offset, size, stride, False, OrderedDict())``),
``.format_version`` (``1``), ``.storage_alignment`` (``64``), ``byteorder`` (``little``),
``data/<key>`` (each storage's bytes), ``version`` (``3\\n``) and ``.data/serialization_id``
(40 decimal digits). Every record's data starts on a multiple of 64 bytes (an extra field ``FB``
padded with ``Z``, so ``torch.load(mmap=True)`` can map it); CRC-32 and sizes follow the data in a
descriptor (flag bit 3; not for an empty record); a record at or past 4 GiB, or holding 4 GiB or more,
carries zip64 extra fields; the end of the archive always has zip64 end records. This module writes
the same records, fields and padding, so ``torch.load`` (``weights_only=True``, ``mmap=True``) reads
its files as torch's own.

What :func:`save` takes: dicts, ``OrderedDict``s, lists, tuples, str, int, float, bool, None,
:class:`TorchSize` and :class:`~.out_tensor.OutTensor` (a name, a dtype, a shape and a callable giving
its bytes in order). Anything else is a ``TypeError``: this writer never pickles an arbitrary object. A tensor's
bytes are copied a bounded chunk at a time (a ``(path, offset, nbytes)`` range of a file is read
with ``pread``), so memory stays flat whatever the tensor size; the CRC is computed on the way.
"""

import os
import pickle
import struct
import sys
import zlib
from collections import OrderedDict
from typing import Any, BinaryIO, Iterable, Iterator, List, Optional, Tuple

from ..errors import CheckpointError
from .dtypes import STORAGE_CLASSES
from .file_ranges import FileRange, SourceFiles, iter_range
from .out_tensor import OutTensor

__all__ = ["OutTensor", "TorchSize", "SourceFiles", "save", "archive_name", "ALIGNMENT", "CHUNK"]

ALIGNMENT = 64  # torch's kFieldAlignment: every record's data starts on a multiple of it
CHUNK = 1 << 20  # bytes read from a source file at a time
_FORMAT_VERSION = b"1"  # torch/serialization.py writes ".format_version" "1" and ".storage_alignment" "64"
_FILE_VERSION = b"3\n"  # PyTorchStreamWriter's kProducedFileFormatVersion (the "version" record)
_U32 = 0xFFFFFFFF  # miniz's MZ_UINT32_MAX, also the sentinel a field moved to a zip64 extra field holds
_ZIP64_AT = _U32  # a size or offset at or past this moves to a zip64 extra field (as miniz decides)

# pickle's pure-Python pickler: typeshed declares only its public face (not its dispatch table, write or
# memoize), so it is reached through this untyped name.
_pickle: Any = pickle


class _Global:
    """A ``module.name`` global written into the pickle by name (torch is never imported)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args: object) -> None:  # pickle's save_reduce insists on a callable; never called here
        raise TypeError(f"{self.module}.{self.name} is a name to pickle, not a function")


_REBUILD = _Global("torch._utils", "_rebuild_tensor_v2")
_SIZE = _Global("torch", "Size")
# safetensors dtype name -> the typed storage class torch pickles (``TypedStorage._pickle_storage_type``)
_STORAGES = {dtype: _Global("torch", cls) for cls, dtype in STORAGE_CLASSES.items() if cls != "UntypedStorage"}


class TorchSize(tuple):
    """A ``torch.Size`` (pickled as torch pickles one: ``torch.Size((dims,))``)."""

    __slots__ = ()


class _Storage:
    __slots__ = ("tensor", "key")

    def __init__(self, tensor: OutTensor, key: str) -> None:
        self.tensor, self.key = tensor, key


class _Pickler(_pickle._Pickler):
    """The pure-Python pickler (the C one imports a global's module to check it, which would import
    torch): the same opcodes and memo as torch's ``pickle.Pickler`` at protocol 2. Only plain types,
    :class:`OutTensor` and :class:`TorchSize` are accepted."""

    dispatch = dict(_pickle._Pickler.dispatch)
    _PLAIN = (type(None), bool, int, float, str, list, tuple, dict, OrderedDict)

    def __init__(self, fh: BinaryIO) -> None:
        super().__init__(fh, protocol=2)
        self.storages: List[_Storage] = []

    def persistent_id(self, obj: object) -> Optional[Tuple[str, _Global, str, str, int]]:
        if type(obj) is _Storage:  # what torch's persistent_id returns for a tensor's typed storage
            return ("storage", _STORAGES[obj.tensor.dtype], obj.key, "cpu", obj.tensor.numel)
        return None

    def reducer_override(self, obj: object) -> Any:
        if type(obj) is OutTensor:
            if obj.dtype not in _STORAGES:
                raise TypeError(f"{obj.name}: dtype {obj.dtype!r} has no torch storage class here")
            storage = _Storage(obj, str(len(self.storages)))
            self.storages.append(storage)
            return _REBUILD, (storage, 0, obj.shape, obj.stride(), False, OrderedDict())
        if type(obj) is TorchSize:
            return _SIZE, (tuple(obj),)
        if type(obj) is OrderedDict or obj is OrderedDict:
            return NotImplemented  # pickled by its own __reduce__ (collections.OrderedDict), as torch does
        if type(obj) not in self._PLAIN and type(obj) not in (_Global, _Storage):
            raise TypeError(f"a {type(obj).__name__} is not plain data; only containers, numbers, strings, None, "
                            "TorchSize and OutTensor are written")
        return NotImplemented

    def _save_global(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))
        self.memoize(obj)

    dispatch[_Global] = _save_global


class _ZipOut:
    """Stored records appended to ``fh`` (a new regular file, binary, at offset 0) the way
    ``PyTorchStreamWriter`` lays them out; :meth:`finish` writes the central directory."""

    def __init__(self, fh: BinaryIO, archive: str) -> None:
        self.fh, self.archive, self.pos = fh, archive, 0
        self.entries: List[Tuple[bytes, int, int, int, int]] = []  # (name, flags, crc, size, offset)

    def _write(self, data: "bytes | bytearray | memoryview") -> int:
        n = memoryview(data).nbytes  # bytes, whatever the item size of a buffer handed in
        self.fh.write(data)
        self.pos += n
        return n

    def record(self, name: str, chunks: Iterable[Any], size: int) -> None:
        full = f"{self.archive}/{name}".encode("utf-8")
        cursor = self.pos
        zip64: List[int] = []
        if size >= _ZIP64_AT:
            zip64 += [size, 0]  # uncompressed size; the compressed one comes in the descriptor
        if cursor >= _ZIP64_AT:
            zip64.append(cursor)
        z64 = struct.pack(f"<HH{len(zip64)}Q", 1, 8 * len(zip64), *zip64) if zip64 else b""
        start = cursor + 30 + len(full) + len(z64) + 4
        pad = -start % ALIGNMENT
        extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = 0x0808 if size else 0x0800  # UTF-8 names; sizes in a data descriptor when there is data
        self._write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)))
        self._write(full)
        self._write(extra)
        crc, got = 0, 0
        for chunk in chunks:
            crc = zlib.crc32(chunk, crc)
            got += self._write(chunk)
        if got != size:
            raise CheckpointError(f"{self.fh.name}: record {name} got {got} bytes, expected {size}; a source file "
                                  "changed while being read: write again from a checkpoint nobody is writing")
        if size:
            self._write(struct.pack("<4sIQQ" if zip64 else "<4sIII", b"PK\x07\x08", crc, size, size))
        self.entries.append((full, flags, crc, size, cursor))

    def finish(self) -> None:
        cd_start = self.pos
        for full, flags, crc, size, offset in self.entries:
            zip64 = ([size, size] if size >= _ZIP64_AT else []) + ([offset] if offset >= _ZIP64_AT else [])
            extra = struct.pack(f"<HH{len(zip64)}Q", 1, 8 * len(zip64), *zip64) if zip64 else b""
            big = _U32 if size >= _ZIP64_AT else size
            self._write(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 0, 0, flags, 0, 0, 0, crc, big, big,
                                    len(full), len(extra), 0, 0, 0, 0, _U32 if offset >= _ZIP64_AT else offset))
            self._write(full)
            self._write(extra)
        n, cd_size, eocd64 = len(self.entries), self.pos - cd_start, self.pos
        self._write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, cd_start))
        self._write(struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64, 1))
        self._write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), cd_size,
                                _U32 if cd_start >= _ZIP64_AT else cd_start, 0))


def _stream(tensor: OutTensor, buf: bytearray, files: SourceFiles) -> Iterator:
    """``tensor``'s bytes as bytes-like chunks; file ranges read ``CHUNK`` bytes at a time into ``buf``
    (:func:`~.file_ranges.iter_range`: a source file that ends early is an error naming it)."""
    assert tensor.chunks is not None  # None: a sizes-only tensor, which no writer writes
    for chunk in tensor.chunks():
        if isinstance(chunk, FileRange):
            # (never FileRange(*chunk): its len() is its byte count, so unpacking it preallocated a tuple
            # of 8 bytes per byte of the range, zeroed: 246 MB per 31 MB piece of a 20 GB save)
            yield from iter_range(files.fd(chunk.path), chunk, buf)
        else:
            yield chunk


def archive_name(path: "str | os.PathLike[str]") -> str:
    """The directory ``torch.save(obj, path)`` puts its records under: the file name up to its first
    dot (``fp32.pt`` -> ``fp32``); ``archive`` (torch's name for a file object) when that is not one
    plain path component."""
    name = os.path.basename(os.fspath(path)).split(".", 1)[0]
    return name if _good_archive(name) else "archive"


def _good_archive(name: str) -> bool:
    return bool(name) and name not in (".", "..") and not any(c in "/\\" or ord(c) < 32 for c in name)


def save(obj: object, fh: BinaryIO, *, archive: str = "archive", files: Optional[SourceFiles] = None) -> int:
    """Write ``obj`` to ``fh`` (a binary file object opened for writing, at offset 0) as
    ``torch.save(obj, fh)`` writes it, records under ``archive/`` (``torch.save`` to a path uses the
    file name up to its first dot; to a file object ``archive``). Returns the bytes written.
    ``files``: a :class:`SourceFiles` the caller keeps open across several files (default: one of
    this call's own).
    ``TypeError`` for an object that is not plain data; :class:`~..errors.CheckpointError` when a
    tensor's bytes do not add up to its size."""
    if not _good_archive(archive):
        raise ValueError(f"archive name {archive!r} is not one path component")
    import io

    data = io.BytesIO()
    pickler = _Pickler(data)
    pickler.dump(obj)
    pickled = data.getvalue()
    out = _ZipOut(fh, archive)
    crcs: List[int] = []

    def small(name: str, value: bytes) -> None:
        out.record(name, [value], len(value))
        crcs.append(zlib.crc32(value))

    small("data.pkl", pickled)
    small(".format_version", _FORMAT_VERSION)
    small(".storage_alignment", str(ALIGNMENT).encode())
    small("byteorder", sys.byteorder.encode())
    buf = bytearray(CHUNK)
    with SourceFiles() as own:
        for storage in pickler.storages:
            out.record(f"data/{storage.key}", _stream(storage.tensor, buf, files or own), storage.tensor.nbytes)
            crcs.append(out.entries[-1][2])
    small("version", _FILE_VERSION)
    # torch: 20 digits of a hash of the record names, then 20 of the records' combined CRC-32s; an id,
    # read by nobody to check anything. Here: the same shape, deterministic in the same inputs.
    names = zlib.crc32("\n".join(e[0].decode("utf-8") for e in out.entries).encode("utf-8"))
    combined = 0
    for c in crcs:
        combined = (combined * 1_000_003 + c) % 10**20
    small(".data/serialization_id", f"{names:020d}{combined:020d}".encode())
    out.finish()
    return out.pos
