"""torch.save's legacy (non-zip) format, read as a stream without running code from it.

``torch.save(..., _use_new_zipfile_serialization=False)`` (DeepSpeed's ``checkpoint_serialization:
false``) writes a sequence of pickles, then the storages. Each pickle is read from the file's
position up to its STOP by the budgeted unpickler (:func:`~.unpickler.load_stream`) through the
file's own small buffer: nothing pre-scans for where the pickles end and nothing holds the file in
memory, whatever its size. :mod:`.torch_files` reads the zip format and calls :func:`read`.
"""

from typing import Any, BinaryIO, Callable, Optional, Protocol, Tuple, Union

from ..errors import CheckpointError, UnsafeCheckpointError, short_repr
from ..guards import StrPath, open_regular
from .dtypes import SIZES as DTYPE_SIZES
from .unpickler import MAX_PICKLE_BYTES, Allowlist, load_stream

__all__ = ["MAGIC", "PROTOCOL", "is_legacy", "read"]


class _StorageLike(Protocol):
    """What a reader's ``storage(...)`` returns (:class:`.torch_files.StorageRef`; torch_files imports
    this module, so it is named by what is read of it)."""
    @property
    def dtype(self) -> str: ...

# torch.save's legacy (non-zip) format, ``_use_new_zipfile_serialization=False`` (DeepSpeed's
# ``checkpoint_serialization: false``): pickles of the magic number, the protocol version and the
# sys info, then the object (storages as persistent ids ``("storage", type, key, location, numel,
# view)``), then the sorted storage keys; then each storage in key order: an 8-byte little-endian
# element count and its raw bytes (torch/serialization.py ``_legacy_save``).
MAGIC = 0x1950A86A20F9469CFC6C
PROTOCOL = 1001


class _PickleReader:
    """The pickles at the start of a legacy file, read through the file's own small buffer: every
    read is bounded (one object's bytes by :data:`_MAX_READ`, all the pickles' by
    :data:`MAX_PICKLE_BYTES`), so memory stays a few MiB whatever the file's size and a crafted run
    of opcodes is refused by the unpickler's budgets as it goes, never pre-scanned."""

    def __init__(self, fh: BinaryIO, path: str) -> None:
        self._fh, self._path, self._pos = fh, path, fh.tell()  # our own count: tell() may cost a syscall

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int) -> None:
        self._pos = self._fh.seek(pos)

    def _check(self, end: int) -> None:
        if end > MAX_PICKLE_BYTES:
            raise CheckpointError(f"{self._path}: the pickles of this legacy torch.save file run past "
                                  f"{MAX_PICKLE_BYTES} bytes; no checkpoint's metadata is that large: the file is "
                                  "corrupt or crafted")

    def read(self, n: int) -> bytes:
        if n > _MAX_READ:
            raise CheckpointError(f"{self._path}: a pickled object of {n} bytes (over {_MAX_READ}) in a legacy "
                                  "torch.save file; no checkpoint's metadata holds one: the file is corrupt or crafted")
        self._check(self._pos + n)
        data = self._fh.read(n)
        self._pos += len(data)
        return data

    def readinto(self, buf: Union[bytearray, memoryview]) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)

    def readline(self) -> bytes:
        line = self._fh.readline(_MAX_LINE)
        self._pos += len(line)
        self._check(self._pos)
        if line and not line.endswith(b"\n"):
            raise CheckpointError(f"{self._path}: corrupt pickle in a legacy torch.save file (a line over "
                                  f"{_MAX_LINE} bytes); copy it again from the training run")
        return line

    def load(self, allowed: Allowlist, persistent_load: Optional[Callable[[Any], Any]] = None) -> Any:
        """The next pickle (from the file's position to its STOP), with :func:`~.unpickler.load_stream`."""
        return load_stream(self, path=self._path, allowed=allowed, persistent_load=persistent_load)


_MAX_READ = 16 * 2**20  # one string or bytes object of a legacy file's pickles
_MAX_LINE = 2**16  # one text line (a protocol-0/1 opcode's argument: a global's module name...)


def read(fh: BinaryIO, path: str, file_size: int, allowed: Allowlist,
         storage: Callable[[Any, str, int, int], _StorageLike]) -> Any:
    """The object of the legacy file open as ``fh`` (``path``, ``file_size`` bytes), unpickled with
    the allowlist ``allowed``; ``storage(type, key, numel, offset)`` makes the reader's reference to
    the storage ``key`` of ``numel`` elements at byte ``offset`` (refusing an unknown type).

    Raises :class:`UnsafeCheckpointError` for a disallowed global or persistent id,
    :class:`CheckpointError` for a file that is damaged, inconsistent or over a budget.
    """
    pickles = _PickleReader(fh, path)
    header = [pickles.load(allowed={}) for _ in range(3)]
    magic, version, info = header
    if magic != MAGIC or version != PROTOCOL or type(info) is not dict:
        raise CheckpointError(f"{path}: not a torch.save file (neither a zip archive nor the legacy format's "
                              "header); pass the checkpoint's own files")
    if info.get("little_endian") is not True:
        raise CheckpointError(f"{path}: a legacy torch.save file written on a big-endian machine; load and re-save "
                              "it there with a current torch")
    main_start = pickles.tell()
    recorded: dict[str, Tuple[str, int, Any]] = {}

    def record(pid: Any) -> _StorageLike:  # first pass: which storages the object names, of what dtype and size
        if not (type(pid) is tuple and len(pid) == 6 and pid[0] == "storage"):
            raise UnsafeCheckpointError(f"{path}: refused for safety: unexpected persistent id {short_repr(pid)}")
        _, dtype, key, _location, numel, view = pid
        if type(key) is not str or type(numel) is not int or numel < 0 or view is not None:
            raise CheckpointError(f"{path}: a storage reference ({short_repr(pid)}) is malformed; the file is corrupt")
        ref = storage(dtype, key, numel, 0)
        if recorded.setdefault(key, (ref.dtype, numel, dtype)) != (ref.dtype, numel, dtype):
            raise CheckpointError(f"{path}: storage {short_repr(key)} is recorded twice, differently; the file is "
                                  "corrupt or crafted")
        return ref

    pickles.load(allowed, persistent_load=record)
    keys = pickles.load(allowed={})
    keys_end = pickles.tell()
    if type(keys) is not list or not all(type(k) is str for k in keys) or len(set(keys)) != len(keys):
        raise CheckpointError(f"{path}: the legacy format's storage key list is malformed; the file is corrupt")
    if set(recorded) != set(keys):
        raise CheckpointError(f"{path}: the storage key list does not match the storages the object names; the file "
                              "is corrupt or crafted: copy it again from the training run")
    offsets: dict[str, int] = {}
    at = keys_end
    for key in keys:
        dtype, numel, _ = recorded[key]
        pickles.seek(at)
        count = fh.read(8)
        if len(count) != 8:
            raise CheckpointError(f"{path}: truncated (storage {key} is missing); copy it again from the training "
                                  "run")
        if int.from_bytes(count, "little") != numel:
            raise CheckpointError(f"{path}: storage {key} holds {int.from_bytes(count, 'little')} elements, the "
                                  f"pickle records {numel}; the file is corrupt: copy it again")
        offsets[key] = at + 8
        at += 8 + numel * DTYPE_SIZES[dtype]
        if at > file_size:
            raise CheckpointError(f"{path}: truncated (storage {key} runs past the end of the file); copy it again "
                                  "from the training run")

    def persistent_load(pid: Any) -> _StorageLike:  # the same pickle again: the ids the first pass checked
        _, marker = recorded[pid[2]][1:]
        return storage(marker, pid[2], recorded[pid[2]][1], offsets[pid[2]])

    pickles.seek(main_start)  # the object again, its storages now at their offsets
    return pickles.load(allowed, persistent_load=persistent_load)


def is_legacy(path: StrPath) -> bool:
    """Whether ``path`` starts as torch.save's legacy format does (a protocol-2 pickle of its magic number).
    Opened as every source file is (:func:`~..guards.open_regular`): a FIFO is not legacy, never a hang."""
    try:
        with open_regular(path, what="the checkpoint file") as fh:
            head = fh.read(14)
    except (OSError, CheckpointError):
        return False
    return head[:4] == b"\x80\x02\x8a\x0a" and int.from_bytes(head[4:], "little") == MAGIC


