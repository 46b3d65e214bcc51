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

A few hundred bytes of pickle can describe a tuple nested a million deep, or a DAG whose
every level references the previous one twice (2^N nodes once walked, hashed or printed).
So the unpickler is the pure-Python one, instrumented: it counts opcodes, hashes only
shallow keys, calls allowlisted callables only with arguments they cannot blow up on, and
the loaded tree is walked once, iteratively, within :data:`MAX_DEPTH` and :data:`MAX_NODES`
(counting shared nodes every time they are reached). Anything over a budget is a
:class:`~hf_ckpt_integrations.errors.CheckpointError`, in bounded time and memory.
"""

import _compat_pickle
import collections
import io
import math
import mmap
import os
import pickle
import struct
import reprlib
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .errors import CheckpointError, UnsafeCheckpointError
from .formats.dtypes import SIZES as DTYPE_SIZES, STORAGE_CLASSES, TORCH_NAMES

__all__ = ["TensorRef", "StorageRef", "FragmentAddress", "Opaque", "Record", "record_type", "TORCH_GLOBALS",
           "TORCH_TENSOR_ALLOWED", "load", "loads",
           "check_crc", "short_repr",
           "DTYPE_SIZES", "MAX_PICKLE_BYTES", "MAX_OPS", "MAX_NODES", "MAX_DEPTH", "MAX_NDIM"]

# Budgets for one file's pickle (a DeepSpeed data.pkl of a 70B model is a few MB, its tree
# ~10^5 nodes, 8 levels deep): far above any real checkpoint, far below what hurts a machine.
MAX_PICKLE_BYTES = 512 * 2**20
MAX_OPS = 20_000_000  # opcodes executed (each makes at most one object)
MAX_NODES = 2_000_000  # tree nodes, a shared node counted each time it is reached
MAX_DEPTH = 100
MAX_NDIM = 64
_MAX_KEY_LEN = 16  # a tuple used as a dict key or set element: this many atoms at most



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


class Record:
    """Inert stand-in for an allowlisted plain-data class of another library's pickle (torch DCP's
    ``Metadata``, ``ChunkStorageMetadata``...): NEWOBJ makes an empty one, BUILD stores the pickled
    state as ``state`` (a dict of fields, or the tuple a ``__getstate__`` returned). Nothing else
    runs. Hashed by identity, so a record may key a dict (DCP's ``MetadataIndex``) without the
    unpickler hashing anything it read. Make one type per class with :func:`record_type`."""

    kind = "Record"

    def __init__(self, *args):
        self.state = None

    def __setstate__(self, state):
        self.state = state

    def field(self, name, default=None):
        """Field ``name`` of a dict state (``default`` when absent or the state is not a dict)."""
        return self.state.get(name, default) if type(self.state) is dict else default

    def __repr__(self):
        return f"{self.kind}({short_repr(self.state)})"


def record_type(name: str) -> type:
    """A :class:`Record` subclass named ``name``, for one allowlisted class."""
    return type(name, (Record,), {"kind": name})


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def short_repr(value) -> str:
    """``repr`` for a value read from a file, bounded in depth and length (a DAG's full repr is 2^N)."""
    return _REPR.repr(value)


def _ints(value, what):
    if not isinstance(value, (tuple, list)) or len(value) > MAX_NDIM or \
            not all(type(v) in (int, bool) for v in value):
        raise CheckpointError(f"tensor {what} is not a list of at most {MAX_NDIM} integers "
                              f"({short_repr(value)})")
    return tuple(int(v) for v in value)


def _tensor(storage, storage_offset, size, stride) -> "TensorRef":
    """A :class:`TensorRef`, refused unless every element it views lies inside its storage (a view
    reaching outside would export the zip's own headers, or another storage, as weights)."""
    if not isinstance(storage, StorageRef):
        raise CheckpointError(f"tensor built on {type(storage).__name__}, not a storage")
    shape, stride = _ints(size, "shape"), _ints(stride, "stride")
    where = f"{storage.path}: a tensor in storage {storage.key}"
    if type(storage_offset) not in (int, bool) or len(stride) != len(shape) or \
            any(d < 0 for d in shape) or any(st < 0 for st in stride) or storage_offset < 0:
        raise CheckpointError(f"{where} has an invalid view (offset {short_repr(storage_offset)}, shape "
                              f"{list(shape)}, stride {list(stride)}); the file is corrupt, copy it again")
    last = int(storage_offset) + sum((d - 1) * st for d, st in zip(shape, stride))
    if (0 not in shape and last >= storage.numel) or storage_offset > storage.numel:
        raise CheckpointError(f"{where} reaches element {last} of a storage of {storage.numel}; the file "
                              "is corrupt or crafted: copy it again from the training run")
    return TensorRef(storage, int(storage_offset), shape, stride)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    return _tensor(storage, storage_offset, size, stride)


def _rebuild_tensor(storage, storage_offset, size, stride):
    return _tensor(storage, storage_offset, size, stride)


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
    if type(value) is not int:
        raise CheckpointError(f"ZeroStageEnum of {short_repr(value)}, not an integer")
    return value


def _device(*args):
    # torch.device("cpu") / ("cuda", 0): only atoms (``str`` of a DAG would print 2^N nodes)
    if len(args) > 2 or not all(type(a) in (str, int) for a in args):
        raise CheckpointError(f"torch.device{short_repr(args)} is not a device")
    return str(args[0]) if args else ""


def _check_key(key):
    """Dict keys and set elements get hashed (and compared): only atoms, or short tuples of atoms —
    hashing a nested tuple DAG takes 2^depth steps."""
    if type(key) in _ATOMS or isinstance(key, Record):
        return
    if type(key) is tuple and len(key) <= _MAX_KEY_LEN and all(type(k) in _ATOMS for k in key):
        return
    raise CheckpointError(f"a dict key or set element of type {type(key).__name__} "
                          f"({short_repr(key)}); checkpoints key by names and numbers only")


_ATOMS = (str, int, float, bool, bytes, type(None))


def _check_keys(keys):
    for k in keys:
        _check_key(k)


def _guarded_set(iterable=()):
    items = list(iterable)
    _check_keys(items)
    return set(items)


def _guarded_frozenset(iterable=()):
    items = list(iterable)
    _check_keys(items)
    return frozenset(items)


def _guarded_ordered_dict(*args):
    if len(args) > 1:
        raise CheckpointError("OrderedDict with more than one argument")
    out = collections.OrderedDict()
    for pair in (list(args[0]) if args else ()):
        if type(pair) not in (tuple, list) or len(pair) != 2:
            raise CheckpointError("OrderedDict built from something other than pairs")
        _check_key(pair[0])
        out[pair[0]] = pair[1]
    return out


def _guarded_size(dims=()):
    return _ints(dims, "shape")


# torch.Size and the torch dtypes (``torch.float32``...): every torch pickle spells them this way.
TORCH_GLOBALS = {"Size": _guarded_size, **{v: _DtypeMarker(k) for k, v in TORCH_NAMES.items()}}

# module -> name -> stand-in. Anything not listed here is refused.
_ALLOWED = {
    "collections": {"OrderedDict": _guarded_ordered_dict},
    "builtins": {"set": _guarded_set, "frozenset": _guarded_frozenset, "slice": slice},
    "torch._utils": {"_rebuild_tensor_v2": _rebuild_tensor_v2, "_rebuild_tensor": _rebuild_tensor,
                     "_rebuild_parameter": _rebuild_parameter,
                     "_rebuild_parameter_with_state": _rebuild_parameter},
    "torch._tensor": {"_rebuild_from_type_v2": _rebuild_from_type_v2},
    "torch": {"Size": _guarded_size, "Tensor": "Tensor", "device": _device,
              **{k: _DtypeMarker(v) for k, v in STORAGE_CLASSES.items()},
              **{v: _DtypeMarker(k) for k, v in TORCH_NAMES.items()}},
    "torch.nn.parameter": {"Parameter": "Parameter"},
    "torch.storage": {"UntypedStorage": _DtypeMarker("U8")},
    "argparse": {"Namespace": Opaque},
    "deepspeed.runtime.fp16.loss_scaler": {"LossScaler": Opaque, "DynamicLossScaler": Opaque},
    "deepspeed.runtime.zero.config": {"ZeroStageEnum": _zero_stage},
    "deepspeed.utils.tensor_fragment": {"fragment_address": FragmentAddress},
}


# The allowlist of a pickle holding only tensors (one chunk of a torch DCP .distcp file).
# (torch's tensor rebuild takes an empty OrderedDict of backward hooks)
TORCH_TENSOR_ALLOWED = {m: v for m, v in _ALLOWED.items() if m in ("torch", "collections") or m.startswith("torch.")}


class _Unpickler(pickle._Unpickler):
    """The pure-Python unpickler (the C one cannot be instrumented) with budgets at the opcodes
    that can blow up: see the module docstring. About 2x slower than the C one here (most of the
    time is in our own rebuild functions either way): 2.2 s instead of 1.1 s for a 3.8 MB pickle
    of 20,000 tensors, milliseconds for the engine files of the tests."""

    def __init__(self, data: bytes, path: str, storages: Optional[dict], allowed: Optional[dict] = None):
        super().__init__(io.BytesIO(data))
        self._path = path
        self._storages = storages  # None: a plain pickle (no torch zip around it), storages refused
        self._allowed = _ALLOWED if allowed is None else allowed
        self._what = "DeepSpeed checkpoints contain" if allowed is None else "this format contains"
        # Protocol < 3 (torch.save writes 2) spells builtins the Python 2 way (``__builtin__.set``).
        # The standard unpickler's find_class maps those names, and we replace it, so map them here
        # exactly as it does (a protocol-2 pickle starts with PROTO 2; none at all means 0/1).
        self._py2_names = not (data[:1] == pickle.PROTO and len(data) > 1 and data[1] >= 3)

    def load(self):
        # pickle._Unpickler.load with an opcode budget (CPython 3.8+ internals: _Unframer, _Stop).
        self._unframer = pickle._Unframer(self._file_read, self._file_readline)
        self.read = self._unframer.read
        self.readinto = self._unframer.readinto
        self.readline = self._unframer.readline
        self.metastack = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = self.read, self._dispatch
        try:
            for _ in range(MAX_OPS):
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)
        except pickle._Stop as stop:
            return stop.value
        raise CheckpointError(f"{self._path}: its pickle runs past {MAX_OPS} operations; no checkpoint's "
                              "metadata is that large: the file is corrupt or crafted")

    # Opcodes that hash (dict and set builders) see only shallow keys.
    def _load_setitem(self):
        _check_key(self.stack[-2])
        pickle._Unpickler.load_setitem(self)

    def _load_setitems(self):
        _check_keys(self.stack[0::2])  # (after MARK the stack holds k1 v1 k2 v2 ...)
        pickle._Unpickler.load_setitems(self)

    def _load_dict(self):
        _check_keys(self.stack[0::2])
        pickle._Unpickler.load_dict(self)

    def _load_newobj(self):
        # NEWOBJ builds the DeepSpeed value types (fragment_address, LossScaler, Namespace)
        cls = self.stack[-2]
        if cls not in (Opaque, FragmentAddress) and not (isinstance(cls, type) and issubclass(cls, Record)):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: its pickle creates "
                                        f"{short_repr(self.stack[-2])} by NEWOBJ; the file was not executed")
        pickle._Unpickler.load_newobj(self)

    def _load_build(self):
        # BUILD sets an object's state: only on our stand-ins (never on a TensorRef, once checked).
        # A state dict's attributes (``_metadata``: module versions) are dropped, nothing reads them.
        if type(self.stack[-2]) is collections.OrderedDict:
            self.stack.pop()
            return
        if type(self.stack[-2]) not in (Opaque, FragmentAddress) and not isinstance(self.stack[-2], Record):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: its pickle sets the state of a "
                                        f"{type(self.stack[-2]).__name__}; the file was not executed")
        pickle._Unpickler.load_build(self)

    def _refuse(self):
        raise UnsafeCheckpointError(f"{self._path}: refused for safety: its pickle uses a protocol-0/1 "
                                    "or keyword object constructor that torch.save never writes; the file "
                                    "was not executed")

    def find_class(self, module, name):
        asked = f"{module}.{name}"
        if self._py2_names:  # the mapping of pickle._Unpickler.find_class (fix_imports=True)
            if (module, name) in _compat_pickle.NAME_MAPPING:
                module, name = _compat_pickle.NAME_MAPPING[(module, name)]
            elif module in _compat_pickle.IMPORT_MAPPING:
                module = _compat_pickle.IMPORT_MAPPING[module]
        # The allowlist applies to the mapped name: mapping never widens what may be built.
        target = self._allowed.get(module, {}).get(name)
        if target is None:
            raise UnsafeCheckpointError(
                f"{self._path}: refused for safety: its pickle asks for `{asked}`, which is not "
                f"on the allowlist of types {self._what}; the file was not executed. "
                "Only export checkpoints you trust through torch.load, or re-save it with plain tensors")
        return target

    def persistent_load(self, pid):
        if self._storages is None or not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: unexpected persistent id "
                                        f"{short_repr(pid)}")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, _DtypeMarker):
            raise UnsafeCheckpointError(f"{self._path}: refused for safety: storage of unknown type "
                                        f"{short_repr(dtype)}")
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise CheckpointError(f"{self._path}: a storage reference ({short_repr(key)}, "
                                  f"{short_repr(numel)} elements) is malformed; the file is corrupt")
        # torch.load reads <archive>/data/<key> of data.pkl's own archive, and nothing else
        entry = (self._storages or {}).get(key)
        if entry is None:
            raise CheckpointError(f"{self._path}: storage {short_repr(key)} is missing from the archive; "
                                  "the file is truncated or corrupt, copy it again from the training run")
        offset, nbytes = entry
        if numel * DTYPE_SIZES[dtype] > nbytes:
            raise CheckpointError(f"{self._path}: storage {key} is shorter than recorded; "
                                  "the file is corrupt, copy it again from the training run")
        return StorageRef(self._path, key, str(dtype), numel, offset)


def _hashed_items(real):
    def load(self):  # set builders: every element on the (marked) stack gets hashed
        _check_keys(self.stack)
        real(self)
    return load


_D = pickle._Unpickler.dispatch
_Unpickler._dispatch = {
    **_D,
    pickle.SETITEM[0]: _Unpickler._load_setitem,
    pickle.SETITEMS[0]: _Unpickler._load_setitems,
    pickle.DICT[0]: _Unpickler._load_dict,
    pickle.ADDITEMS[0]: _hashed_items(_D[pickle.ADDITEMS[0]]),
    pickle.FROZENSET[0]: _hashed_items(_D[pickle.FROZENSET[0]]),
    pickle.NEWOBJ[0]: _Unpickler._load_newobj,
    pickle.BUILD[0]: _Unpickler._load_build,
    pickle.NEWOBJ_EX[0]: _Unpickler._refuse,
    pickle.OBJ[0]: _Unpickler._refuse,
    pickle.INST[0]: _Unpickler._refuse,
}
del _D


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


def _stored_entries(zf: zipfile.ZipFile, fh, file_size: int, path: str, archive: str):
    """Map storage key -> (absolute data offset, nbytes) for every ``<archive>/data/<key>`` entry,
    the names ``torch.load`` resolves (``archive``: data.pkl's directory, ``""`` at the root)."""
    out = {}
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


def _open_zip(fh, path):
    try:
        return zipfile.ZipFile(fh)
    except zipfile.BadZipFile as e:
        raise CheckpointError(
            f"{path}: not a torch zip checkpoint ({e}); it is truncated, corrupt, or an old-format "
            "torch.save file: copy it again, or re-save it with a current torch") from e


def _pickle_entry(zf, path):
    pkls = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
    if len(pkls) != 1:
        raise CheckpointError(f"{path}: not a torch checkpoint (no single data.pkl inside)")
    return pkls[0]


def check_crc(path, ranges) -> list:
    """CRC-32 of every storage entry of ``path`` that holds a byte of ``ranges`` (``(offset, nbytes)``
    pairs, absolute), compared with the zip's central directory; return the names that differ.

    ``load`` only checks data.pkl's CRC (the storages are read as byte ranges, never through
    zipfile); ``verify`` calls this to catch a flipped bit in the partitions it used.
    """
    path = os.fspath(path)
    ranges = sorted((o, o + n) for o, n in ranges if n)
    bad = []
    with open(path, "rb") as fh, _open_zip(fh, path) as zf:
        archive = os.path.dirname(_pickle_entry(zf, path).filename)
        entries = _stored_entries(zf, fh, os.fstat(fh.fileno()).st_size, path, archive)
        by_offset = {}
        prefix = f"{archive}/data/" if archive else "data/"
        for key, (off, n) in entries.items():
            by_offset[off] = (prefix + key, n, zf.getinfo(prefix + key).CRC)
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
            for off, (name, n, crc) in sorted(by_offset.items()):
                if not any(lo < off + n and off < hi for lo, hi in ranges):
                    continue
                got = 0
                for pos in range(off, off + n, _CRC_BLOCK):
                    got = zlib.crc32(m[pos:min(pos + _CRC_BLOCK, off + n)], got)
                if got != crc:
                    bad.append(name)
    return bad


_CRC_BLOCK = 16 * 2**20


class _Window:
    """Bytes ``[start, start + size)`` of an open file, as a seekable read-only file of ``size``
    bytes: a torch zip archive stored inside a larger file (one chunk of a torch DCP ``.distcp``)."""

    def __init__(self, fh, start: int, size: int):
        self._fh, self._start, self._size, self._pos = fh, start, size, 0

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def read(self, n=-1):
        n = self._size - self._pos if n is None or n < 0 else min(n, max(0, self._size - self._pos))
        self._fh.seek(self._start + self._pos)
        data = self._fh.read(n)
        self._pos += len(data)
        return data


def load(path, *, offset: int = 0, length: Optional[int] = None, allowed: Optional[dict] = None) -> Any:
    """Unpickle the object tree of a torch zip checkpoint safely; tensors become :class:`TensorRef`.

    ``offset``/``length``: the archive is bytes ``[offset, offset + length)`` of ``path`` (a chunk
    of a torch DCP ``.distcp`` file); tensors' offsets stay absolute in ``path``. ``allowed``: the
    allowlist (module -> name -> stand-in) instead of the DeepSpeed one.

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
    try:
        with open(path, "rb") as raw:
            fh = raw if where == path else _Window(raw, offset, size)
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
    return _unpickle(data, path, where, storages, allowed)


def loads(path, *, allowed: dict) -> Any:
    """Unpickle a plain pickle file (not a torch zip: torch DCP's ``.metadata``) safely, with the
    allowlist ``allowed``; same budgets and refusals as :func:`load`, no tensor storages."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PICKLE_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e}); check the path and permissions") from e
    if not data:
        raise CheckpointError(f"{path}: empty file (0 bytes); the save was interrupted, "
                              "use an earlier checkpoint or copy it again")
    if len(data) > MAX_PICKLE_BYTES:
        raise CheckpointError(f"{path}: over {MAX_PICKLE_BYTES} bytes; no checkpoint's metadata is that large: "
                              "the file is corrupt or crafted")
    return _unpickle(data, path, path, None, allowed)


def _unpickle(data, path, where, storages, allowed):
    try:
        obj = _Unpickler(data, path, storages, allowed).load()
        _check_tree(obj, where)
        return obj
    except CheckpointError as e:
        if str(e).startswith(path):
            raise
        raise type(e)(f"{where}: {e}; the file is corrupt or crafted: copy it again from the training "
                      "run") from None
    except Exception as e:  # malformed pickles raise a zoo of types
        raise CheckpointError(f"{where}: corrupt pickle ({type(e).__name__}: {_ERR_REPR.repr(e.args)}); "
                              "copy it again from the training run") from None


_ERR_REPR = reprlib.Repr()
_ERR_REPR.maxlevel, _ERR_REPR.maxstring, _ERR_REPR.maxother = 2, 200, 60


def _check_tree(obj, path) -> None:
    """Walk the loaded tree once, level by level, within the budgets (a shared node is counted each
    time it is reached, so a DAG or a cycle that a later walk would expand runs out of budget here)."""
    level, depth, count = [obj], 0, 0
    while level:
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path}: its pickle nests deeper than {MAX_DEPTH} levels; no checkpoint "
                                  "does that: the file is corrupt or crafted")
        count += len(level)
        below = []
        for node in level:
            t = type(node)
            if t in _ATOMS or t is TensorRef:
                continue
            if t in (dict, collections.OrderedDict):
                below.extend(node.keys())
                below.extend(node.values())
            elif t in (list, tuple, set, frozenset):
                below.extend(node)
            elif t in (Opaque, FragmentAddress) or isinstance(node, Record):
                below.extend(vars(node).values())
            elif t is slice:
                below.extend((node.start, node.stop, node.step))
            # (other stand-ins, str subclasses and StorageRef, hold nothing from the file)
            if count + len(below) > MAX_NODES:
                raise CheckpointError(f"{path}: its pickle describes over {MAX_NODES} objects (counting shared "
                                      "ones each time they are used); no checkpoint's metadata is that large: "
                                      "the file is corrupt or crafted")
        level, depth = below, depth + 1


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
