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

import errno
import os
import stat
import sys
from types import TracebackType
from typing import Callable, Iterable, List, Literal, Optional, Tuple, Type, Union

from .errors import DestinationError, option
from .guards import StrPath, check_destination, is_or_holds
from .outfiles import open_dir
# The lock, the owner markers and the interface live in ._staging, the save-time merge in
# ._merge_commit; every name stays importable from here.
from ._staging import (LOCK_SUFFIX, OWNER_SUFFIX, PACKAGE, STAGING_NAME, TMP_MARKER, CommitStrategy,  # noqa: F401
                       DirLock, disk_error, drop_marker, fsync_path, make_dirs, make_owned, read_marker, remove_dir,
                       remove_made_dirs, signals_held, subdirectory, weight_files, writer_alive)
from ._merge_commit import MergeIntoCheckpoint

__all__ = ["CommitStrategy", "SiblingSwap", "MergeIntoCheckpoint", "DirLock", "fsync_path", "disk_error",
           "TMP_MARKER", "LOCK_SUFFIX", "STAGING_NAME", "weight_files", "OWNER_SUFFIX", "PACKAGE"]

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

    def __init__(self, dst: StrPath, *, overwrite: Optional[bool] = False,
                 inputs: Iterable[Union[str, Tuple[str, str]]] = (), configs: Iterable[Optional[str]] = ()) -> None:
        # overwrite None: the caller offers no way to replace dst (hf-ckpt universal), so the refusal
        # of an existing one names no option.
        self._raw, self._inputs, self._configs = dst, list(inputs), list(configs)
        self.overwrite = overwrite
        self.dst = None  # type: ignore[assignment]  # a str from begin() on (CommitStrategy.dst)
        self.path: Optional[str] = None
        self.lock_path: Optional[str] = None
        self._lock = self._dir = self._name = self._nonce = None
        self.warnings: List[str] = []
        self._state = "new"  # new -> staged -> done

    def _resolve(self) -> None:
        self.dst = check_destination(self._raw, inputs=self._inputs, configs=self._configs)
        self._parent, self._base = os.path.dirname(self.dst), os.path.basename(self.dst)
        self._prefix = f".{self._base}{TMP_MARKER}"
        self.lock_path = os.path.join(self._parent, f".{self._base}{LOCK_SUFFIX}")
        self._lock = DirLock(self.lock_path, self.dst)

    def _entry_name(self, kind: str = "") -> Callable[[str], str]:
        return lambda nonce: f"{self._prefix}{kind}{os.getpid()}-{nonce}"

    def _stale_problem(self, name: str) -> Optional[str]:
        """Why the temp sibling ``name`` must be left alone (None when it is a leftover of ours)."""
        assert self._dir is not None  # under the lock: begin opened it
        record = read_marker(self._dir, name)
        rest = name[len(self._prefix):]
        if rest.startswith("old-"):
            rest = rest[4:]
        if record is None or rest != f"{record['pid']}-{record['nonce']}":
            return "it has no valid owner marker of hf-ckpt"
        alive = writer_alive(record)
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
        sub = subdirectory(path)
        if sub is not None:
            return f"it holds a subdirectory ({sub}), which a writer never makes"
        return None

    def _remove_stale(self) -> None:
        """Under the lock: remove what dead writers left (see the class doc); warn about the rest."""
        assert self._dir is not None  # begin opened it
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
                    remove_dir(self._dir, n)
            os.unlink(n + OWNER_SUFFIX, dir_fd=self._dir)

    def _check_replaceable(self) -> None:
        """``dst`` exists: refuse unless ``overwrite`` and it is a flat directory (an export)."""
        if self.overwrite is None:
            raise DestinationError(f"{self.dst}: already exists; choose a new directory, or remove it first")
        if not self.overwrite:
            raise DestinationError(f"{self.dst}: already exists; choose a new directory or pass {option('overwrite')}")
        if not stat.S_ISDIR(os.lstat(self.dst).st_mode):
            raise DestinationError(f"{self.dst}: exists and is not a directory; remove it or choose another path")
        sub = subdirectory(self.dst)
        if sub is not None:
            raise DestinationError(f"{self.dst}: holds a subdirectory ({sub}), so it is not an earlier export; "
                                   f"{option('overwrite')} replaces only an export (a directory of files): remove it yourself "
                                   "or choose another directory")

    def begin(self) -> str:
        """Check ``dst``, take its lock, clear leftovers and make the marked staging directory; every
        step undone when a later one fails (ENOSPC, out of inodes, an interrupt): nothing is left."""
        self._resolve()
        made: List[str] = []
        try:
            try:
                made = make_dirs(self._parent)
                self._dir = open_dir(self._parent)
                assert self._lock is not None  # _resolve made it
                self._lock.acquire()
                self._remove_stale()
                if os.path.lexists(self.dst):
                    self._check_replaceable()
                with signals_held():  # an interrupt inside make_owned would leave an entry nobody knows of
                    self._name, self._nonce = make_owned(self._dir, self._entry_name())
                    self.path = os.path.join(self._parent, self._name)
                    self._state = "staged"
            except OSError as e:
                raise disk_error(self.dst, e) from e
        except BaseException:
            # Also an interrupt (SIGINT/SIGTERM) held during make_owned and raised as that block
            # ends, before the caller owns the directory: remove it here, since abort will not run.
            self._state = "done"
            if self._name is not None:
                self._discard_staging()
            self._release()
            remove_made_dirs(made)
            raise
        assert self.path is not None  # staged
        return self.path

    def commit(self, names: Iterable[str] = ()) -> None:
        """Swap the staging directory into place (``names`` is not needed: the whole directory is the
        export). Raises :class:`~.errors.DestinationError` (staging removed) on an OS error."""
        if self._state != "staged":
            return
        self._state = "done"
        assert self.path is not None and self._dir is not None  # staged
        try:
            fsync_path(self.path)
            with signals_held():  # an interrupt lands before the swap or after its cleanup
                self._swap()
            os.fsync(self._dir)
        except OSError as e:
            self._discard_staging()
            raise disk_error(self.dst, e) from e
        finally:
            self._release()

    def __enter__(self) -> str:
        return self.begin()

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        if exc_type is None:
            self.commit()
            return False
        self.abort()
        if isinstance(exc, OSError):
            raise disk_error(self.dst, exc) from exc
        return False

    def _swap(self) -> None:
        d, name, base = self._dir, self._name, self._base
        assert d is not None and name is not None and self._nonce is not None  # staged
        if not os.path.lexists(self.dst):
            if not _renameat2(name, base, _RENAME_NOREPLACE, d):
                os.rename(name, base, src_dir_fd=d, dst_dir_fd=d)
        elif _renameat2(name, base, _RENAME_EXCHANGE, d):
            remove_dir(d, name)  # now holds the previous export
        else:
            old, old_nonce = make_owned(d, self._entry_name("old-"), make_dir=False)
            os.rename(base, old, src_dir_fd=d, dst_dir_fd=d)
            os.rename(name, base, src_dir_fd=d, dst_dir_fd=d)
            remove_dir(d, old)
            drop_marker(d, old, old_nonce)
        drop_marker(d, name, self._nonce)
