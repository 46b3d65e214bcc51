"""Read torch zip checkpoints without running code from the pickle and without torch.

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (the object tree) and one stored,
uncompressed entry ``<name>/data/<key>`` per storage. :func:`load` unpickles ``data.pkl``
with an allowlist: only plain containers, torch's tensor-rebuild functions and a few
DeepSpeed value types are accepted, each rebuilt into an inert stand-in. Any other global
(``os.system``, ``builtins.eval``, an unknown class) raises
:class:`~hf_ckpt_integrations.errors.UnsafeCheckpointError` before anything is called.

Tensors come back as :class:`TensorRef`: dtype, shape, stride and the absolute byte offset of
their storage in the file. Reading a tensor is then a byte-range read (``mmap``), so a 10 GB
optimizer file whose ``exp_avg`` we never touch costs only its pickle.
"""

import _compat_pickle
import collections
import io
import math
import mmap
import os
import pickle
import struct
import threading
import zipfile
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .errors import CheckpointError, UnsafeCheckpointError

__all__ = ["TensorRef", "StorageRef", "FragmentAddress", "Opaque", "load", "DTYPE_SIZES"]

# safetensors dtype names and element sizes; torch storage classes map onto them.
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U8": 1, "BOOL": 1}
_STORAGE_DTYPES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "UntypedStorage": "U8",
}
_TORCH_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                 "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
                 "bool": "BOOL"}


@dataclass(frozen=True)
class StorageRef:
    """One storage entry of a torch zip file: ``numel`` elements of ``dtype`` at byte ``offset``."""

    path: str
    key: str
    dtype: str
    numel: int
    offset: int


@dataclass(frozen=True)
class TensorRef:
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


class FragmentAddress:
    """Stand-in for the dataclass ``deepspeed.utils.tensor_fragment.fragment_address``
    (pickled as an empty object, then its ``__dict__``)."""

    def __init__(self, numel=None, start=None):
        self.numel, self.start = numel, start

    def __setstate__(self, state):
        if not isinstance(state, dict):
            raise UnsafeCheckpointError("fragment_address with unexpected state")
        self.numel, self.start = state.get("numel"), state.get("start")

    def __repr__(self):
        return f"fragment_address(numel={self.numel}, start={self.start})"


class Opaque:
    """Inert stand-in for an allowlisted object whose content is plain data (e.g. LossScaler)."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return f"Opaque({self.__dict__!r})"


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_tensor(storage, storage_offset, size, stride):
    return TensorRef(storage, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    # ZeRO-3 saves partitions (``ds_tensor``) that carry attributes: torch pickles them as
    # (rebuild function, tensor type, args, __dict__). Keep the tensor, drop the attributes.
    if func not in (_rebuild_tensor_v2, _rebuild_tensor, _rebuild_parameter):
        raise UnsafeCheckpointError("tensor rebuilt through an unexpected function")
    return func(*args)


class _DtypeMarker(str):
    pass


def _zero_stage(value):
    return int(value)


# module -> name -> stand-in. Anything not listed here is refused.
_ALLOWED = {
    "collections": {"OrderedDict": collections.OrderedDict},
    "builtins": {"set": set, "frozenset": frozenset, "slice": slice},
    "torch._utils": {"_rebuild_tensor_v2": _rebuild_tensor_v2, "_rebuild_tensor": _rebuild_tensor,
                     "_rebuild_parameter": _rebuild_parameter,
                     "_rebuild_parameter_with_state": _rebuild_parameter},
    "torch._tensor": {"_rebuild_from_type_v2": _rebuild_from_type_v2},
    "torch": {"Size": tuple, "Tensor": "Tensor", "device": str,
              **{k: _DtypeMarker(v) for k, v in _STORAGE_DTYPES.items()},
              **{k: _DtypeMarker(v) for k, v in _TORCH_DTYPES.items()}},
    "torch.nn.parameter": {"Parameter": "Parameter"},
    "torch.storage": {"UntypedStorage": _DtypeMarker("U8")},
    "argparse": {"Namespace": Opaque},
    "deepspeed.runtime.fp16.loss_scaler": {"LossScaler": Opaque, "DynamicLossScaler": Opaque},
    "deepspeed.runtime.zero.config": {"ZeroStageEnum": _zero_stage},
    "deepspeed.utils.tensor_fragment": {"fragment_address": FragmentAddress},
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: str, storages: dict):
        super().__init__(io.BytesIO(data))
        self._path = path
        self._storages = storages
        # Protocol < 3 (torch.save writes 2) spells builtins the Python 2 way (``__builtin__.set``).
        # The standard unpickler's find_class maps those names, and we replace it, so map them here
        # exactly as it does (a protocol-2 pickle starts with PROTO 2; none at all means 0/1).
        self._py2_names = not (data[:1] == pickle.PROTO and len(data) > 1 and data[1] >= 3)

    def find_class(self, module, name):
        asked = f"{module}.{name}"
        if self._py2_names:  # the mapping of pickle._Unpickler.find_class (fix_imports=True)
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        # The allowlist applies to the mapped name: mapping never widens what may be built.
        target = _ALLOWED.get(module, {}).get(name)
        if target is None:
            raise UnsafeCheckpointError(
                f"{self._path}: refused for safety: its pickle asks for `{asked}`, which is not "
                "on the allowlist of types DeepSpeed checkpoints contain; the file was not executed. "
                "Only export checkpoints you trust through torch.load, or re-save it with plain tensors")
        return target

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: unexpected persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, _DtypeMarker):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: storage of unknown type {dtype!r}")
        entry = self._storages.get(str(key))
        if entry is None:
            raise CheckpointError(f"{self._path}: storage {key} is missing from the archive; "
                                  "the file is truncated or corrupt, copy it again from the training run")
        offset, nbytes = entry
        if int(numel) * DTYPE_SIZES[dtype] > nbytes:
            raise CheckpointError(f"{self._path}: storage {key} is shorter than recorded; "
                                  "the file is corrupt, copy it again from the training run")
        return StorageRef(self._path, str(key), str(dtype), int(numel), offset)


def _check_local_entry(fh, info: zipfile.ZipInfo, path: str) -> int:
    """Cross-check an entry's local header (and data descriptor) with the central directory and
    return the absolute offset of its data.

    Only the central directory is read by ``zipfile``; the data offset comes from the local
    header's name and extra lengths. A damaged local header would otherwise shift every byte
    range read from that entry (a silently wrong tensor), so the two copies must agree.
    """
    def corrupt(what):
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


def _stored_entries(zf: zipfile.ZipFile, fh, file_size: int, path: str):
    """Map storage key -> (absolute data offset, nbytes) for every ``*/data/<key>`` entry."""
    out = {}
    for info in zf.infolist():
        parts = info.filename.split("/")
        if len(parts) < 3 or parts[-2] != "data":
            continue
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path}: storage {info.filename} is compressed; torch never writes that, "
                                  "so the file was re-packed: save it again with torch.save")
        offset = _check_local_entry(fh, info, path)
        if offset + info.file_size > file_size or info.compress_size != info.file_size:
            raise CheckpointError(f"{path}: truncated (storage {parts[-1]} runs past the end of the file); "
                                  "copy it again from the training run")
        out[parts[-1]] = (offset, info.file_size)
    return out


def load(path) -> Any:
    """Unpickle the object tree of a torch zip checkpoint safely; tensors become :class:`TensorRef`.

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
    try:
        with open(path, "rb") as fh:
            try:
                zf = zipfile.ZipFile(fh)
            except zipfile.BadZipFile as e:
                raise CheckpointError(
                    f"{path}: not a torch zip checkpoint ({e}); it is truncated, corrupt, or an old-format "
                    "torch.save file: copy it again, or re-save it with a current torch") from e
            with zf:
                pkls = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
                if len(pkls) != 1:
                    raise CheckpointError(f"{path}: not a torch checkpoint (no single data.pkl inside)")
                storages = _stored_entries(zf, fh, file_size, path)
                try:
                    data = zf.read(pkls[0])  # checks the entry's CRC-32
                except (zipfile.BadZipFile, EOFError, OSError) as e:
                    raise CheckpointError(f"{path}: corrupt pickle entry ({e}); copy it again") from e
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}); check the path and permissions") from e
    except Exception as e:  # a damaged central directory raises a zoo of types inside zipfile
        raise CheckpointError(f"{path}: corrupt zip structure ({type(e).__name__}: {e}); "
                              "copy it again from the training run") from e
    try:
        return _Unpickler(data, path, storages).load()
    except CheckpointError:
        raise
    except Exception as e:  # malformed pickles raise a zoo of types
        raise CheckpointError(f"{path}: corrupt pickle ({type(e).__name__}: {e}); "
                              "copy it again from the training run") from e


class MappedFiles:
    """Read-only mmaps of source files, opened once and shared by all reads of a run."""

    def __init__(self):
        self._maps = {}
        self._lock = threading.Lock()  # the writer's worker threads share one instance

    def get(self, path: str) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(path)
            if m is None:
                with open(path, "rb") as fh:
                    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[path] = m
            return m

    def read(self, path: str, offset: int, nbytes: int) -> memoryview:
        return memoryview(self.get(path))[offset:offset + nbytes]

    def close(self):
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive; the GC closes it
                pass
        self._maps.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
