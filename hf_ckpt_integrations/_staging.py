"""What every commit strategy (:mod:`.commit`) stands on: the destination lock, staging entries
marked by their owner, their cleanup, and the :class:`CommitStrategy` interface.

The lock (:class:`DirLock`) is opened without following a link and refused unless it is a
regular file with one name; each staging entry gets an **owner marker** first, a sibling file
``<entry>.owner`` created with ``O_EXCL | O_NOFOLLOW`` holding the package name, pid, host and a
random nonce (also in the entry's name). Cleanup of leftovers touches only an entry whose marker is
valid and whose writer is dead (docs/reliability.md, "What the writer creates and how").
"""

import contextlib
import errno
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import threading
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

from .errors import DestinationError
from .guards import StrPath
from .formats.names import SAVED_WEIGHTS_RE
from .outfiles import NOFOLLOW, open_dir, open_new

__all__ = ["CommitStrategy", "DirLock", "fsync_path", "disk_error", "TMP_MARKER", "LOCK_SUFFIX", "STAGING_NAME",
           "weight_files", "OWNER_SUFFIX", "PACKAGE", "JOURNAL", "JOURNAL_LIMIT", "make_owned", "drop_marker",
           "read_marker", "writer_alive", "remove_dir", "plain_name", "signals_held", "subdirectory", "make_dirs",
           "remove_made_dirs"]

TMP_MARKER = ".hfckpt-tmp-"
LOCK_SUFFIX = ".hfckpt-lock"
# MergeIntoCheckpoint's staging directory inside the checkpoint directory.
STAGING_NAME = ".hfckpt-tmp-weights"
JOURNAL = ".hfckpt-commit.json"
JOURNAL_LIMIT = 1 << 20
# The owner marker of a staging entry: a sibling file named after it.
OWNER_SUFFIX = ".owner"
PACKAGE = "hf_ckpt_integrations"
_MARKER_LIMIT = 4096


def fsync_path(path: StrPath) -> None:
    """fsync a file, or a directory (its entries: a rename or a new file in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_error(dst: Optional[StrPath], e: OSError) -> DestinationError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DestinationError(f"{dst}: no space left while writing ({e.strerror}); free space or choose "
                                "another directory — nothing was written")
    return DestinationError(f"{dst}: cannot write ({e.strerror or e}); check the path and permissions — "
                            "nothing was written")


class DirLock:
    """An exclusive ``flock`` on ``lock_path`` (its file holds the holder's pid); ``what`` names the
    destination in the refusal. Not POSIX: no lock (the rest still holds).

    The file is opened relative to its directory (opened once, not following a link), without
    following a link at its own name, and used only when it is a regular file with one name: a
    link, a hard link or a FIFO planted there is refused, never truncated or written through."""

    def __init__(self, lock_path: str, what: str) -> None:
        self.path = lock_path
        self.what = what
        self._fd: Optional[int] = None  # the lock file, while held
        self._dir: Optional[int] = None  # its directory, while acquiring or held

    def _refuse(self, what: str) -> DestinationError:
        return DestinationError(f"{self.path}: {what}, not the lock file hf-ckpt makes; it was left as it is (not "
                                "followed, not written): remove it and run again")

    def _open(self) -> int:
        name = os.path.basename(self.path)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         0o644, dir_fd=self._dir)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a link (EMLINK on some BSDs)
                raise self._refuse("is a symbolic link") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise self._refuse("is a hard link to another file" if stat.S_ISREG(st.st_mode) else
                               "is not a regular file")
        return fd

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:
            return
        self._dir = open_dir(os.path.dirname(self.path) or ".")
        try:
            with signals_held():  # an interrupt between creating the file and holding it would leave it
                self._acquire(fcntl)
        except BaseException:  # the held interrupt lands here too: unlink a lock this call took
            self.release()
            raise

    def _acquire(self, fcntl: ModuleType) -> None:
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise DestinationError(f"{self.what}: another export into it is running (pid {holder} holds "
                                       f"{self.path}); wait for it to finish or choose another directory")
            if self._same(fd):  # the previous holder unlinks the file before unlocking: retry on a fresh one
                self._fd = fd  # held from here: release() unlinks it, also when the write below fails (ENOSPC)
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return
            os.close(fd)

    def _same(self, fd: int) -> bool:
        try:
            st = os.stat(os.path.basename(self.path), dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)

    def release(self) -> None:
        if self._fd is not None:
            try:
                if self._same(self._fd):  # while still holding it (see acquire); never another file
                    os.unlink(os.path.basename(self.path), dir_fd=self._dir)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None
        if self._dir is not None:
            os.close(self._dir)
            self._dir = None


# ---------------------------------------------------------------- owner markers

# Nonces of the staging entries this process holds now (a marker of this pid with another nonce
# was left by an earlier, interrupted write of this same process).
_LIVE_NONCES: Set[Optional[str]] = set()


def _nonce() -> str:
    return secrets.token_hex(8)


def _host() -> str:
    return socket.gethostname()


def make_owned(dir_fd: int, name_of: Callable[[str], str], *, make_dir: bool = True,
               tries: int = 8) -> Tuple[str, str]:
    """Create a marked entry in the directory ``dir_fd``: for a fresh nonce, the owner marker
    ``name_of(nonce) + OWNER_SUFFIX`` (``O_EXCL | O_NOFOLLOW``, before the entry, so a crash never
    leaves an unmarked entry of ours), then (``make_dir``) the directory ``name_of(nonce)``.
    Returns ``(name, nonce)``. Something already at either name (planted) is left alone and a new
    nonce is drawn; ``FileExistsError`` after ``tries``."""
    for _ in range(tries):
        nonce = _nonce()
        name = name_of(nonce)
        record = {"package": PACKAGE, "pid": os.getpid(), "host": _host(), "nonce": nonce, "entry": name}
        try:
            fh = open_new(name + OWNER_SUFFIX, "w", dir_fd=dir_fd, encoding="utf-8")
        except FileExistsError:
            continue
        _LIVE_NONCES.add(nonce)
        try:
            with fh:
                json.dump(record, fh)
            if make_dir:
                os.mkdir(name, dir_fd=dir_fd)  # mkdir never follows a link at its name
        except FileExistsError:
            drop_marker(dir_fd, name, nonce)
            continue
        except BaseException:  # ENOSPC writing the marker or making the entry (out of inodes): undo the marker
            drop_marker(dir_fd, name, nonce)
            raise
        return name, nonce
    raise FileExistsError(errno.EEXIST, f"no free name for a staging entry after {tries} tries (entries named "
                                        "like it keep appearing)")


def drop_marker(dir_fd: int, name: str, nonce: str) -> None:
    _LIVE_NONCES.discard(nonce)
    try:
        os.unlink(name + OWNER_SUFFIX, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def read_marker(dir_fd: int, name: str) -> Optional[Dict[str, Any]]:
    """The owner record of entry ``name`` (its marker: a regular file with one name, small, a JSON
    object of this package naming ``name``), else None."""
    try:
        fd = os.open(name + OWNER_SUFFIX, os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > _MARKER_LIMIT:
            return None
        record = json.loads(os.read(fd, _MARKER_LIMIT + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)
    if not (isinstance(record, dict) and record.get("package") == PACKAGE and record.get("entry") == name
            and type(record.get("pid")) is int and isinstance(record.get("nonce"), str)
            and isinstance(record.get("host"), str)):
        return None
    return record


def writer_alive(record: Dict[str, Any]) -> Optional[str]:
    """Why the writer that made ``record`` may still be running (None when it is gone)."""
    pid, nonce = record["pid"], record["nonce"]
    if record["host"] != _host():
        return f"written on host {record['host'][:64]!r}, where hf-ckpt cannot tell whether pid {pid} still runs"
    if pid == os.getpid():
        return "this process is still writing it" if nonce in _LIVE_NONCES else None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:  # EPERM: the process exists (another user's)
        pass
    return f"its writer, pid {pid}, still runs"


def remove_dir(dir_fd: int, name: str) -> None:
    """Remove the directory ``name`` (of ``dir_fd``), which :func:`_stale_problem` found to be a flat
    directory: ``shutil.rmtree`` with a descriptor never follows a link inside it."""
    shutil.rmtree(name, dir_fd=dir_fd)


class CommitStrategy:
    """How staged files become visible at ``dst``; rank 0 alone calls it (see module doc).

    ``begin() -> staging directory``; ``commit(names)``; ``abort()``. ``abort`` is idempotent and
    a no-op after ``commit``; every call after ``begin`` releases the lock when it returns.
    ``warnings``: what ``begin`` left alone (entries named like ours that are not), for the report.
    """

    dst: str  # the destination, from begin() on
    warnings: List[str]
    # What abort() and the cleanup below use, kept by each strategy: the state (new -> staged -> done),
    # the open directory the staging entry is in, the entry's name and nonce (set by begin), the lock.
    _state: str
    _dir: Optional[int]
    _name: Optional[str]
    _nonce: Optional[str]
    _lock: Optional[DirLock]

    def begin(self) -> str:
        raise NotImplementedError

    def commit(self, names: Iterable[str]) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Remove the staging directory and its owner marker, and release the lock (both strategies
        stage into a marked directory of their own and hold ``self._lock`` in state ``staged``)."""
        if self._state != "staged":
            return
        self._state = "done"
        try:
            self._discard_staging()
        finally:
            self._release()

    def _discard_staging(self) -> None:
        assert self._dir is not None and self._name is not None and self._nonce is not None  # begin made the entry
        try:
            remove_dir(self._dir, self._name)
        except FileNotFoundError:
            pass
        except OSError:
            return  # keep the marker: the next writer finishes the removal
        drop_marker(self._dir, self._name, self._nonce)

    def _release(self) -> None:
        _LIVE_NONCES.discard(self._nonce)  # this writer is done; a marker left now is a leftover
        try:
            assert self._lock is not None  # made before begin() may fail
            self._lock.release()
        finally:
            if self._dir is not None:
                os.close(self._dir)
                self._dir = None


def plain_name(n: object) -> bool:
    """A file name of the staging directory: no path, no parent, nothing of ours."""
    return (isinstance(n, str) and 0 < len(n) <= 255 and n not in (".", "..") and "/" not in n and "\\" not in n
            and "\0" not in n and not n.startswith(".hfckpt"))


def weight_files(directory: StrPath) -> List[str]:
    """The weight files (and their index) in ``directory``, sorted; [] when it does not exist."""
    try:
        return sorted(n for n in os.listdir(directory) if SAVED_WEIGHTS_RE.match(n))
    except FileNotFoundError:
        return []


_HELD = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Delay SIGINT/SIGTERM/SIGHUP until the block is done: the swap and the removal of the
    previous export run to the end, and the interrupt is raised after them.

    Python runs signal handlers only in the main thread, between bytecodes; so the main thread
    swaps in a handler that notes the signal and, after the block, raises it again for the handler
    that was in place. (A ``pthread_sigmask`` would not do: with other threads alive, as in a
    training process, the kernel hands the signal to one of them and the handler still runs here.)
    In another thread there is nothing to hold: no handler interrupts it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: List[int] = []
    previous: Dict[int, Any] = {}  # signal -> its handler before (a callable, SIG_DFL/SIG_IGN or None)
    try:
        for s in _HELD:
            previous[s] = signal.signal(s, lambda signum, frame: noted.append(signum))
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in dict.fromkeys(noted):
            signal.raise_signal(s)


def subdirectory(path: StrPath) -> Optional[str]:
    """The name of one subdirectory of ``path`` (not following links), or None for a flat directory."""
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
    return None


def make_dirs(path: StrPath) -> List[str]:
    """``os.makedirs(path, exist_ok=True)``, returning the directories it created, outermost first,
    so that a caller that fails later can remove them (:func:`remove_made_dirs`)."""
    path = os.path.abspath(os.fspath(path))
    missing: List[str] = []
    while not os.path.lexists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    made: List[str] = []
    try:
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue  # made by someone else meanwhile: not ours to remove
            made.append(d)
        if missing and not os.path.isdir(missing[0]):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", missing[0])
    except BaseException:
        remove_made_dirs(made)
        raise
    return made


def remove_made_dirs(made: List[str]) -> None:
    """Remove the directories :func:`make_dirs` created, innermost first, each only while empty."""
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            return
