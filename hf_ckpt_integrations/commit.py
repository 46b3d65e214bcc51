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

What they create, and how (docs/reliability.md, "What the writer creates and how"): the lock is
opened without following a link and refused unless it is a regular file with one name; each
staging directory gets an **owner marker** first, a sibling file ``<entry>.owner`` created with
``O_EXCL | O_NOFOLLOW`` holding the package name, pid, host and a random nonce (which is also in
the entry's name); files inside staging are created new (:mod:`.outfiles`). Cleanup of leftovers
touches only an entry whose marker is valid and whose writer is dead, that is a real directory of
files and is neither a source nor the config directory: anything else is left alone, with a
warning.
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
import sys
from typing import Iterable, List, Optional

from .errors import DestinationError
from .formats.names import SAVED_WEIGHTS_RE
from .guards import check_destination, is_or_holds
from .outfiles import NOFOLLOW, open_dir, open_new

__all__ = ["CommitStrategy", "SiblingSwap", "MergeIntoCheckpoint", "DirLock", "fsync_path", "disk_error",
           "TMP_MARKER", "LOCK_SUFFIX", "STAGING_NAME", "weight_files", "OWNER_SUFFIX", "PACKAGE"]

TMP_MARKER = ".hfckpt-tmp-"
LOCK_SUFFIX = ".hfckpt-lock"
# MergeIntoCheckpoint's staging directory inside the checkpoint directory.
STAGING_NAME = ".hfckpt-tmp-weights"
_JOURNAL = ".hfckpt-commit.json"
_JOURNAL_LIMIT = 1 << 20
# The owner marker of a staging entry: a sibling file named after it.
OWNER_SUFFIX = ".owner"
PACKAGE = "hf_ckpt_integrations"
_MARKER_LIMIT = 4096


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


def _renameat2(src: str, dst: str, flags: int, dir_fd: int = _AT_FDCWD) -> bool:
    """``renameat2(src, dst, flags)`` (names relative to ``dir_fd``); False where the call or the flag is not available (the
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
    if fn(dir_fd, os.fsencode(src), dir_fd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # old kernel, or a file system without the flag (some FUSE/NFS)
    raise OSError(err, os.strerror(err), dst)


class DirLock:
    """An exclusive ``flock`` on ``lock_path`` (its file holds the holder's pid); ``what`` names the
    destination in the refusal. Not POSIX: no lock (the rest still holds).

    The file is opened relative to its directory (opened once, not following a link), without
    following a link at its own name, and used only when it is a regular file with one name: a
    link, a hard link or a FIFO planted there is refused, never truncated or written through."""

    def __init__(self, lock_path: str, what: str):
        self.path = lock_path
        self.what = what
        self._fd = self._dir = None

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
                    os.ftruncate(fd, 0)
                    os.write(fd, f"{os.getpid()}\n".encode())
                    self._fd = fd
                    return
                os.close(fd)
        except BaseException:
            os.close(self._dir)
            self._dir = None
            raise

    def _same(self, fd) -> bool:
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
_LIVE_NONCES: set = set()


def _nonce() -> str:
    return secrets.token_hex(8)


def _host() -> str:
    return socket.gethostname()


def _make_owned(dir_fd: int, name_of, *, make_dir: bool = True, tries: int = 8):
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
            with open_new(name + OWNER_SUFFIX, "w", dir_fd=dir_fd, encoding="utf-8") as fh:
                json.dump(record, fh)
        except FileExistsError:
            continue
        _LIVE_NONCES.add(nonce)
        if not make_dir:
            return name, nonce
        try:
            os.mkdir(name, dir_fd=dir_fd)  # mkdir never follows a link at its name
            return name, nonce
        except FileExistsError:
            _drop_marker(dir_fd, name, nonce)
    raise FileExistsError(errno.EEXIST, f"no free name for a staging entry after {tries} tries (entries named "
                                        "like it keep appearing)")


def _drop_marker(dir_fd: int, name: str, nonce: str) -> None:
    _LIVE_NONCES.discard(nonce)
    try:
        os.unlink(name + OWNER_SUFFIX, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def _read_marker(dir_fd: int, name: str) -> Optional[dict]:
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


def _writer_alive(record: dict) -> Optional[str]:
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


def _remove_dir(dir_fd: int, name: str) -> None:
    """Remove the directory ``name`` (of ``dir_fd``), which :func:`_stale_problem` found to be a flat
    directory: ``shutil.rmtree`` with a descriptor never follows a link inside it."""
    shutil.rmtree(name, dir_fd=dir_fd)


class CommitStrategy:
    """How staged files become visible at ``dst``; rank 0 alone calls it (see module doc).

    ``begin() -> staging directory``; ``commit(names)``; ``abort()``. ``abort`` is idempotent and
    a no-op after ``commit``; every call after ``begin`` releases the lock when it returns.
    ``warnings``: what ``begin`` left alone (entries named like ours that are not), for the report.
    """

    dst: str
    warnings: List[str]

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
        try:
            _remove_dir(self._dir, self._name)
        except FileNotFoundError:
            pass
        except OSError:
            return  # keep the marker: the next writer finishes the removal
        _drop_marker(self._dir, self._name, self._nonce)

    def _release(self) -> None:
        _LIVE_NONCES.discard(self._nonce)  # this writer is done; a marker left now is a leftover
        try:
            self._lock.release()
        finally:
            if self._dir is not None:
                os.close(self._dir)
                self._dir = None


class SiblingSwap(CommitStrategy):
    """A temporary sibling of ``dst`` that becomes ``dst`` on commit, or vanishes.

    Also a context manager: ``with SiblingSwap(dst, overwrite=...) as
    tmp: ...write into tmp...`` commits on a clean exit and aborts on an exception.

    Crash and concurrency safety (docs/reliability.md):

    - the lock (:class:`DirLock` on ``.<dst>.hfckpt-lock``) is held from ``begin`` to the end of
      ``commit``/``abort``: a second writer into the same ``dst`` fails at once with a clear error;
    - the staging directory is ``.<dst>.hfckpt-tmp-PID-NONCE`` (a random nonce: nobody can plant
      something at its name beforehand), marked by its owner file ``….owner`` (module doc);
    - leftovers of a dead writer (killed, power loss) are removed on entry: only entries whose
      marker is valid and whose writer is gone, each a real flat directory that is not and does not
      hold or lie in a source or the config directory; a previous export parked as
      ``...-old-PID-NONCE`` by an interrupted fallback replace is moved back first. Anything else
      named like them is left alone (a warning in the report);
    - ``overwrite`` swaps the directories in one ``renameat2(RENAME_EXCHANGE)`` on Linux, so
      ``dst`` is always the old complete export or the new one; elsewhere (or where the file
      system lacks the flag) two renames, and a crash between them is repaired by the next run.

    What it removes, and nothing else: its own staging directory; with ``overwrite`` the previous
    ``dst``, which must be a flat directory of files (what an export is — never a directory
    holding subdirectories, such as a save dir, a home or the working directory); and the marked
    leftovers above. ``dst`` is resolved through symbolic links first and must stay clear of
    ``inputs`` and ``configs`` (:func:`~.guards.check_destination`, the one destination guard),
    checked in ``begin``; every rename and removal is relative to the directory then opened.
    """

    LOCK_SUFFIX = LOCK_SUFFIX

    def __init__(self, dst, *, overwrite: bool = False, inputs=(), configs=()):
        self._raw, self._inputs, self._configs = dst, list(inputs), list(configs)
        self.overwrite = overwrite
        self.dst = self.path = self.lock_path = None
        self._lock = self._dir = self._name = self._nonce = None
        self.warnings: List[str] = []
        self._state = "new"  # new -> staged -> done

    def _resolve(self) -> None:
        self.dst = check_destination(self._raw, inputs=self._inputs, configs=self._configs)
        self._parent, self._base = os.path.dirname(self.dst), os.path.basename(self.dst)
        self._prefix = f".{self._base}{TMP_MARKER}"
        self.lock_path = os.path.join(self._parent, f".{self._base}{LOCK_SUFFIX}")
        self._lock = DirLock(self.lock_path, self.dst)

    def _entry_name(self, kind: str = ""):
        return lambda nonce: f"{self._prefix}{kind}{os.getpid()}-{nonce}"

    def _stale_problem(self, name: str) -> Optional[str]:
        """Why the temp sibling ``name`` must be left alone (None when it is a leftover of ours)."""
        record = _read_marker(self._dir, name)
        rest = name[len(self._prefix):]
        if rest.startswith("old-"):
            rest = rest[4:]
        if record is None or rest != f"{record['pid']}-{record['nonce']}":
            return "it has no valid owner marker of hf-ckpt"
        alive = _writer_alive(record)
        if alive:
            return alive
        try:
            st = os.stat(name, dir_fd=self._dir, follow_symlinks=False)
        except FileNotFoundError:
            return None  # only the marker is left
        if not stat.S_ISDIR(st.st_mode):
            return "it is not a directory"
        path = os.path.join(self._parent, name)
        for kept in [*self._inputs, *self._configs]:  # (lying inside one: dst's parent is checked)
            kept = kept[0] if isinstance(kept, tuple) else kept
            if kept and is_or_holds(path, kept):
                return f"it is or holds {kept}, which this export reads"
        sub = _subdirectory(path)
        if sub is not None:
            return f"it holds a subdirectory ({sub}), which a writer never makes"
        return None

    def _remove_stale(self) -> None:
        """Under the lock: remove what dead writers left (see the class doc); warn about the rest."""
        names = set(os.listdir(self._dir))
        entries = {n[:-len(OWNER_SUFFIX)] if n.endswith(OWNER_SUFFIX) else n
                   for n in names if n.startswith(self._prefix)}
        for n in sorted(entries):
            problem = self._stale_problem(n)
            if problem is not None:
                if n in names:  # a marker alone is no data: say nothing
                    self.warnings.append(f"{os.path.join(self._parent, n)}: left as it is ({problem}); remove it "
                                         "yourself if it is a leftover")
                continue
            if n in names:
                parked = n[len(self._prefix):].startswith("old-")
                if parked and not os.path.lexists(self.dst):
                    os.rename(n, self._base, src_dir_fd=self._dir, dst_dir_fd=self._dir)  # the previous export
                else:
                    _remove_dir(self._dir, n)
            os.unlink(n + OWNER_SUFFIX, dir_fd=self._dir)

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
        try:
            try:
                os.makedirs(self._parent, exist_ok=True)
                self._dir = open_dir(self._parent)
                self._lock.acquire()
                self._remove_stale()
                if os.path.lexists(self.dst):
                    self._check_replaceable()
                self._name, self._nonce = _make_owned(self._dir, self._entry_name())
                self.path = os.path.join(self._parent, self._name)
            except OSError as e:
                raise disk_error(self.dst, e) from e
        except BaseException:
            # Also an interrupt (SIGINT/SIGTERM) that lands right after the mkdir, before the
            # caller owns the directory: remove it here, since abort will not run.
            if self._name is not None:
                self._discard_staging()
            self._release()
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
            os.fsync(self._dir)
        except OSError as e:
            self._discard_staging()
            raise disk_error(self.dst, e) from e
        finally:
            self._release()

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
        d, name, base = self._dir, self._name, self._base
        if not os.path.lexists(self.dst):
            if not _renameat2(name, base, _RENAME_NOREPLACE, d):
                os.rename(name, base, src_dir_fd=d, dst_dir_fd=d)
        elif _renameat2(name, base, _RENAME_EXCHANGE, d):
            _remove_dir(d, name)  # now holds the previous export
        else:
            old, old_nonce = _make_owned(d, self._entry_name("old-"), make_dir=False)
            os.rename(base, old, src_dir_fd=d, dst_dir_fd=d)
            os.rename(name, base, src_dir_fd=d, dst_dir_fd=d)
            _remove_dir(d, old)
            _drop_marker(d, old, old_nonce)
        _drop_marker(d, name, self._nonce)


class MergeIntoCheckpoint(CommitStrategy):
    """Staged files merged into the (existing or new) directory ``dst``; its other files stay.

    ``begin`` creates ``dst/.hfckpt-tmp-weights/`` (marked by ``dst/.hfckpt-tmp-weights.owner``)
    under the lock, first rolling forward a commit a crash interrupted, or removing an unfinished
    staging directory — only one a dead writer of ours marked; anything else at that name is
    refused, never read, moved or removed. ``commit(names)`` writes the journal (the staged names)
    into the staging directory, then, in ``dst``: removes the weight index files
    (:data:`~.formats.names.SAVED_WEIGHTS_RE`) — so no index names a file of the other set — moves
    the staged files in (index files last), and with ``replace_existing`` removes the previous
    save's weight files not in the new set. Every step is idempotent, so a rerun from the journal
    finishes an interrupted commit.
    """

    def __init__(self, dst, *, replace_existing: bool = True):
        self.dst = os.path.abspath(os.fspath(dst))
        self.path = os.path.join(self.dst, STAGING_NAME)
        parent, base = os.path.split(self.dst)
        self.lock_path = os.path.join(parent, f".{base}{LOCK_SUFFIX}")
        self.replace_existing = replace_existing
        self._lock = DirLock(self.lock_path, self.dst)
        self._dir = self._nonce = None
        self._name = STAGING_NAME
        self.warnings: List[str] = []
        self._state = "new"

    def begin(self) -> str:
        try:
            os.makedirs(self.dst, exist_ok=True)
            self._dir = open_dir(self.dst)
            try:
                self._lock.acquire()
                self.recover()
                _, self._nonce = _make_owned(self._dir, lambda nonce: STAGING_NAME, tries=1)
            except BaseException:
                self._release()
                raise
        except OSError as e:
            raise disk_error(self.dst, e) from e
        self._state = "staged"
        return self.path

    def _refuse(self, why: str) -> DestinationError:
        return DestinationError(f"{self.path}: {why}, so it is not a staging directory hf-ckpt left; it was left as "
                                "it is (not read, moved or removed): remove it and save again")

    def recover(self) -> bool:
        """Under the lock: finish a commit a crash interrupted (its journal is in the staging
        directory), or remove an unfinished staging directory. True when a commit was finished.
        Only a real directory whose owner marker is ours and whose writer is gone is touched."""
        d = self._dir if self._dir is not None else None
        opened = d is None
        if opened:
            d = open_dir(self.dst)
        try:
            return self._recover(d)
        finally:
            if opened:
                os.close(d)

    def _recover(self, d: int) -> bool:
        try:
            st = os.stat(STAGING_NAME, dir_fd=d, follow_symlinks=False)
        except FileNotFoundError:
            record = _read_marker(d, STAGING_NAME)
            if record is not None and _writer_alive(record) is None:
                os.unlink(STAGING_NAME + OWNER_SUFFIX, dir_fd=d)  # a marker whose directory is gone
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise self._refuse("is a symbolic link or a file")
        record = _read_marker(d, STAGING_NAME)
        if record is None:
            raise self._refuse("has no valid owner marker of hf-ckpt")
        alive = _writer_alive(record)
        if alive:
            raise self._refuse(alive)
        journal = self._read_journal(d)
        if journal is not None:
            self._apply(*journal)
        else:
            _remove_dir(d, STAGING_NAME)
            os.unlink(STAGING_NAME + OWNER_SUFFIX, dir_fd=d)
        return journal is not None

    def _read_journal(self, d: int):
        """``(names, replace_existing)`` from the staging directory's journal, None without one;
        refused when it is not what :meth:`commit` writes (plain names of regular staged files)."""
        sd = os.open(STAGING_NAME, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW, dir_fd=d)
        try:
            try:
                fd = os.open(_JOURNAL, os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK, dir_fd=sd)
            except FileNotFoundError:
                return None
            except OSError:
                raise self._refuse(f"its {_JOURNAL} is not a regular file") from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise self._refuse(f"its {_JOURNAL} is not a regular file")
                raw = os.read(fd, _JOURNAL_LIMIT + 1)
            finally:
                os.close(fd)
            try:
                record = json.loads(raw.decode("utf-8"))
                names, replace = record["files"], record["replace_existing"]
            except (ValueError, KeyError, TypeError, RecursionError):
                raise self._refuse(f"its {_JOURNAL} is not a journal hf-ckpt writes") from None
            if (len(raw) > _JOURNAL_LIMIT or not isinstance(names, list) or not isinstance(replace, bool)
                    or not all(_plain_name(n) for n in names)):
                raise self._refuse(f"its {_JOURNAL} names something other than files of it")
            for n in names:
                try:
                    st = os.stat(n, dir_fd=sd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # moved already
                if not stat.S_ISREG(st.st_mode):
                    raise self._refuse(f"its {n} is not a regular file")
            return names, replace
        finally:
            os.close(sd)

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
                with open_new(tmp, "w", encoding="utf-8") as fh:
                    json.dump({"files": names, "replace_existing": self.replace_existing}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, os.path.join(self.path, _JOURNAL))
                fsync_path(self.path)
            except OSError as e:  # nothing moved yet
                self._discard_staging()
                raise disk_error(self.dst, e) from e
            with _signals_held():
                self._apply(names, self.replace_existing)
        finally:
            self._release()

    def _apply(self, names: List[str], replace_existing: bool) -> None:
        keep = set(names)
        pending = [n for n in names if os.path.lexists(os.path.join(self.path, n))]
        if pending:
            for n in weight_files(self.dst):
                if n.endswith(".index.json"):
                    os.remove(os.path.join(self.dst, n))
        for n in pending:  # a rename replaces a link at the target name, never writes through it
            os.replace(os.path.join(self.path, n), os.path.join(self.dst, n))
        if replace_existing:
            for n in weight_files(self.dst):
                if n not in keep:
                    os.remove(os.path.join(self.dst, n))
        fsync_path(self.dst)
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.unlink(os.path.join(self.dst, STAGING_NAME + OWNER_SUFFIX))
        except FileNotFoundError:
            pass


def _plain_name(n) -> bool:
    """A file name of the staging directory: no path, no parent, nothing of ours."""
    return (isinstance(n, str) and 0 < len(n) <= 255 and n not in (".", "..") and "/" not in n and "\\" not in n
            and "\0" not in n and not n.startswith(".hfckpt"))


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
