"""Commit strategies: how a finished write becomes visible at its destination, all or nothing.

The writer (:mod:`.orchestrator`) stages every file it writes in a directory the strategy gives
it, then asks the strategy to make them visible. Only rank 0 calls a strategy, in this order::

    staging = strategy.begin()      # check the destination, take its lock, clear leftovers
    ...every rank writes its shards into staging; rank 0 adds the index and config...
    strategy.commit(names)          # make exactly these staged files visible; unlock
    # or, on any failure before or during commit:
    strategy.abort()                # remove the staging directory; the destination as before; unlock

Two strategies:

- :class:`SiblingSwap` (exports): a fresh sibling directory ``.<dst>.hfckpt-tmp-PID`` renamed
  into place (``renameat2(RENAME_EXCHANGE)`` with ``--overwrite``), so ``dst`` is absent, the
  previous complete export or the new one.
- :class:`MergeIntoCheckpoint` (save-time hooks): files merged into an existing checkpoint
  directory, which holds other files (optimizer state, trainer state) that stay. The staged set
  is recorded in a journal before anything moves; the old weight set's index goes first, then the
  new shards, the new index last, then the old set's other weight files: no index ever names a
  file of the other set. A crash mid-move is rolled forward by the next writer into the same
  directory (under the lock), from the journal.

Both hold an exclusive ``flock`` on ``.<dst>.hfckpt-lock`` (a sibling of ``dst``) from
``begin`` to the end of ``commit``/``abort``: a second writer into the same destination fails at
once with a :class:`~.errors.DestinationError` naming the holder's pid.
"""

import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import sys
from typing import Iterable, List, Optional

from .errors import DestinationError
from .formats.names import SAVED_WEIGHTS_RE
from .guards import check_destination

__all__ = ["CommitStrategy", "SiblingSwap", "MergeIntoCheckpoint", "DirLock", "fsync_path", "disk_error",
           "TMP_MARKER", "LOCK_SUFFIX", "STAGING_NAME", "weight_files"]

TMP_MARKER = ".hfckpt-tmp-"
LOCK_SUFFIX = ".hfckpt-lock"
# MergeIntoCheckpoint's staging directory inside the checkpoint directory.
STAGING_NAME = ".hfckpt-tmp-weights"
_JOURNAL = ".hfckpt-commit.json"


def fsync_path(path) -> None:
    """fsync a file, or a directory (its entries: a rename or a new file in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_error(dst, e: OSError) -> DestinationError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DestinationError(f"{dst}: no space left while writing ({e.strerror}); free space or choose "
                                "another directory — nothing was written")
    return DestinationError(f"{dst}: cannot write ({e.strerror or e}); check the path and permissions — "
                            "nothing was written")


# renameat2(2) flags (Linux >= 3.15, glibc >= 2.28).
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the call or the flag is not available (the
    caller falls back to plain renames), OSError for a real failure (EEXIST, ENOSPC...)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # old kernel, or a file system without the flag (some FUSE/NFS)
    raise OSError(err, os.strerror(err), dst)


class DirLock:
    """An exclusive ``flock`` on ``lock_path`` (its file holds the holder's pid); ``what`` names the
    destination in the refusal. Not POSIX: no lock (the rest still holds)."""

    def __init__(self, lock_path: str, what: str):
        self.path = lock_path
        self.what = what
        self._fd = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise DestinationError(f"{self.what}: another export into it is running (pid {holder} holds "
                                       f"{self.path}); wait for it to finish or choose another directory")
            try:  # the previous holder unlinks the file before unlocking: retry on a fresh one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)  # while still holding it (see acquire)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


class CommitStrategy:
    """How staged files become visible at ``dst``; rank 0 alone calls it (see module doc).

    ``begin() -> staging directory``; ``commit(names)``; ``abort()``. ``abort`` is idempotent and
    a no-op after ``commit``; every call after ``begin`` releases the lock when it returns.
    """

    dst: str

    def begin(self) -> str:
        raise NotImplementedError

    def commit(self, names: Iterable[str]) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Remove the staging directory ``self.path`` and release the lock (both strategies stage
        into a directory of their own and hold ``self._lock`` in state ``staged``)."""
        if self._state != "staged":
            return
        self._state = "done"
        try:
            shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._lock.release()


class SiblingSwap(CommitStrategy):
    """A temporary sibling of ``dst`` that becomes ``dst`` on commit, or vanishes.

    Also a context manager: ``with SiblingSwap(dst, overwrite=...) as
    tmp: ...write into tmp...`` commits on a clean exit and aborts on an exception.

    Crash and concurrency safety (docs/reliability.md):

    - the lock (:class:`DirLock` on ``.<dst>.hfckpt-lock``) is held from ``begin`` to the end of
      ``commit``/``abort``: a second writer into the same ``dst`` fails at once with a clear error;
    - holding the lock proves every ``.<dst>.hfckpt-tmp-*`` sibling belongs to a dead writer
      (killed, power loss): they are removed on entry, and a previous export parked as
      ``...-old-PID`` by an interrupted fallback replace is moved back first;
    - ``overwrite`` swaps the directories in one ``renameat2(RENAME_EXCHANGE)`` on Linux, so
      ``dst`` is always the old complete export or the new one; elsewhere (or where the file
      system lacks the flag) two renames, and a crash between them is repaired by the next run.

    What it removes, and nothing else: its own staging directory; with ``overwrite`` the previous
    ``dst``, which must be a flat directory of files (what an export is — never a directory
    holding subdirectories, such as a save dir, a home or the working directory); and temp
    siblings named ``.<dst>.hfckpt-tmp-*`` that are files, links (the link itself) or flat
    directories. ``dst`` is resolved through symbolic links first and must stay clear of
    ``inputs`` and ``configs`` (:func:`~.guards.check_destination`), checked in ``begin``.
    """

    LOCK_SUFFIX = LOCK_SUFFIX

    def __init__(self, dst, *, overwrite: bool = False, inputs=(), configs=()):
        self._raw, self._inputs, self._configs = dst, list(inputs), list(configs)
        self.overwrite = overwrite
        self.dst = self.path = self.lock_path = None
        self._lock = None
        self._state = "new"  # new -> staged -> done

    def _resolve(self) -> None:
        self.dst = check_destination(self._raw, inputs=self._inputs, configs=self._configs)
        self._parent, base = os.path.dirname(self.dst), os.path.basename(self.dst)
        self._prefix = f".{base}{TMP_MARKER}"
        self.path = os.path.join(self._parent, f"{self._prefix}{os.getpid()}")
        self.lock_path = os.path.join(self._parent, f".{base}{LOCK_SUFFIX}")
        self._lock = DirLock(self.lock_path, self.dst)

    def _remove_stale(self) -> None:
        """Under the lock: every temp sibling of ``dst`` is left over from a dead writer. Only
        what a writer makes is removed: a file, a link, or a flat directory of files."""
        stale = sorted(n for n in os.listdir(self._parent) if n.startswith(self._prefix))
        for n in stale:
            p = os.path.join(self._parent, n)
            if n.startswith(f"{self._prefix}old-") and not os.path.lexists(self.dst):
                os.rename(p, self.dst)  # the previous complete export, parked by a fallback replace
            elif not stat.S_ISDIR(os.lstat(p).st_mode):
                os.unlink(p)  # a file, or a link (never what it points at)
            elif _subdirectory(p) is None:
                shutil.rmtree(p)

    def _check_replaceable(self) -> None:
        """``dst`` exists: refuse unless ``overwrite`` and it is a flat directory (an export)."""
        if not self.overwrite:
            raise DestinationError(f"{self.dst}: already exists; choose a new directory or pass --overwrite")
        if not stat.S_ISDIR(os.lstat(self.dst).st_mode):
            raise DestinationError(f"{self.dst}: exists and is not a directory; remove it or choose another path")
        sub = _subdirectory(self.dst)
        if sub is not None:
            raise DestinationError(f"{self.dst}: holds a subdirectory ({sub}), so it is not an earlier export; "
                                   "--overwrite replaces only an export (a directory of files): remove it yourself "
                                   "or choose another directory")

    def begin(self) -> str:
        self._resolve()
        made = False
        try:
            try:
                os.makedirs(self._parent, exist_ok=True)
                self._lock.acquire()
                self._remove_stale()
                if os.path.lexists(self.dst):
                    self._check_replaceable()
                made = not os.path.lexists(self.path)
                os.mkdir(self.path)
            except OSError as e:
                raise disk_error(self.dst, e) from e
        except BaseException:
            # Also an interrupt (SIGINT/SIGTERM) that lands right after the mkdir, before the
            # caller owns the directory: remove it here, since abort will not run.
            if made and os.path.isdir(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
            self._lock.release()
            raise
        self._state = "staged"
        return self.path

    def commit(self, names: Iterable[str] = ()) -> None:
        """Swap the staging directory into place (``names`` is not needed: the whole directory is the
        export). Raises :class:`~.errors.DestinationError` (staging removed) on an OS error."""
        if self._state != "staged":
            return
        self._state = "done"
        try:
            fsync_path(self.path)
            with _signals_held():  # an interrupt lands before the swap or after its cleanup
                self._swap()
            fsync_path(self._parent)
        except OSError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise disk_error(self.dst, e) from e
        finally:
            self._lock.release()

    def __enter__(self) -> str:
        return self.begin()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
            return False
        self.abort()
        if isinstance(exc, OSError):
            raise disk_error(self.dst, exc) from exc
        return False

    def _swap(self) -> None:
        if not os.path.lexists(self.dst):
            if not _renameat2(self.path, self.dst, _RENAME_NOREPLACE):
                os.rename(self.path, self.dst)
        elif _renameat2(self.path, self.dst, _RENAME_EXCHANGE):
            shutil.rmtree(self.path, ignore_errors=True)  # now holds the previous export
        else:
            old = f"{self._prefix}old-{os.getpid()}"
            old = os.path.join(self._parent, old)
            os.rename(self.dst, old)
            os.rename(self.path, self.dst)
            shutil.rmtree(old, ignore_errors=True)


class MergeIntoCheckpoint(CommitStrategy):
    """Staged files merged into the (existing or new) directory ``dst``; its other files stay.

    ``begin`` creates ``dst/.hfckpt-tmp-weights/`` under the lock (first rolling forward a commit a
    crash interrupted, or removing an unfinished staging directory). ``commit(names)`` writes the
    journal (the staged names) into the staging directory, then, in ``dst``: removes the weight
    index files (:data:`~.formats.names.SAVED_WEIGHTS_RE`) — so no index names a file of the other set — moves the
    staged files in (index files last), and with ``replace_existing`` removes the previous save's
    weight files not in the new set. Every step is idempotent, so a rerun from the journal
    finishes an interrupted commit.
    """

    def __init__(self, dst, *, replace_existing: bool = True):
        self.dst = os.path.abspath(os.fspath(dst))
        self.path = os.path.join(self.dst, STAGING_NAME)
        parent, base = os.path.split(self.dst)
        self.lock_path = os.path.join(parent, f".{base}{LOCK_SUFFIX}")
        self.replace_existing = replace_existing
        self._lock = DirLock(self.lock_path, self.dst)
        self._state = "new"

    def begin(self) -> str:
        try:
            os.makedirs(self.dst, exist_ok=True)
            self._lock.acquire()
            try:
                self.recover()
                os.mkdir(self.path)
            except BaseException:
                self._lock.release()
                raise
        except OSError as e:
            raise disk_error(self.dst, e) from e
        self._state = "staged"
        return self.path

    def recover(self) -> bool:
        """Under the lock: finish a commit a crash interrupted (its journal is in the staging
        directory), or remove an unfinished staging directory. True when a commit was finished."""
        journal = os.path.join(self.path, _JOURNAL)
        if os.path.isfile(journal):
            with open(journal, encoding="utf-8") as fh:
                record = json.load(fh)
            self._apply(record["files"], record["replace_existing"])
            return True
        if os.path.lexists(self.path):
            if os.path.isdir(self.path) and not os.path.islink(self.path):
                shutil.rmtree(self.path)
            else:
                os.unlink(self.path)
        return False

    def commit(self, names: Iterable[str]) -> None:
        if self._state != "staged":
            return
        self._state = "done"
        names = sorted(names, key=lambda n: (n.endswith(".index.json"), n))  # index files last
        try:
            try:
                for n in names:
                    fsync_path(os.path.join(self.path, n))
                tmp = os.path.join(self.path, _JOURNAL + ".tmp")
                with open(tmp, "w", encoding="utf-8") as fh:
                    json.dump({"files": names, "replace_existing": self.replace_existing}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, os.path.join(self.path, _JOURNAL))
                fsync_path(self.path)
            except OSError as e:  # nothing moved yet
                shutil.rmtree(self.path, ignore_errors=True)
                raise disk_error(self.dst, e) from e
            with _signals_held():
                self._apply(names, self.replace_existing)
        finally:
            self._lock.release()

    def _apply(self, names: List[str], replace_existing: bool) -> None:
        keep = set(names)
        pending = [n for n in names if os.path.lexists(os.path.join(self.path, n))]
        if pending:
            for n in weight_files(self.dst):
                if n.endswith(".index.json"):
                    os.remove(os.path.join(self.dst, n))
        for n in pending:
            os.replace(os.path.join(self.path, n), os.path.join(self.dst, n))
        if replace_existing:
            for n in weight_files(self.dst):
                if n not in keep:
                    os.remove(os.path.join(self.dst, n))
        fsync_path(self.dst)
        shutil.rmtree(self.path, ignore_errors=True)



def weight_files(directory) -> List[str]:
    """The weight files (and their index) in ``directory``, sorted; [] when it does not exist."""
    try:
        return sorted(n for n in os.listdir(directory) if SAVED_WEIGHTS_RE.match(n))
    except FileNotFoundError:
        return []


_HELD = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def _signals_held():
    """Delay SIGINT/SIGTERM/SIGHUP (POSIX) until the block is done: the swap and the removal of the
    previous export run to the end, and the interrupt is raised after them."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _subdirectory(path) -> Optional[str]:
    """The name of one subdirectory of ``path`` (not following links), or None for a flat directory."""
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
    return None
