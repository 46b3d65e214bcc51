"""The save-time commit strategy: staged files merged into an existing checkpoint directory
(:class:`MergeIntoCheckpoint`; the call order is :mod:`.commit`'s)."""

import json
import os
import shutil
import stat
from typing import Iterable, List, Optional, Tuple

from .errors import DestinationError
from .guards import StrPath
from .outfiles import NOFOLLOW, open_dir, open_new
from ._staging import (JOURNAL, JOURNAL_LIMIT, LOCK_SUFFIX, OWNER_SUFFIX, STAGING_NAME, CommitStrategy, DirLock,
                       disk_error, make_dirs, make_owned, plain_name, remove_made_dirs, read_marker, remove_dir, signals_held, writer_alive,
                       fsync_path, weight_files)

__all__ = ["MergeIntoCheckpoint"]


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

    _lock: DirLock  # made here, never None
    _name: str

    def __init__(self, dst: StrPath, *, replace_existing: bool = True) -> None:
        self.dst = os.path.abspath(os.fspath(dst))
        self.path = os.path.join(self.dst, STAGING_NAME)
        parent, base = os.path.split(self.dst)
        self.lock_path = os.path.join(parent, f".{base}{LOCK_SUFFIX}")
        self.replace_existing = replace_existing
        self._lock = DirLock(self.lock_path, self.dst)
        self._dir = None
        self._nonce = None
        self._name = STAGING_NAME
        self.warnings: List[str] = []
        self._state = "new"

    def begin(self) -> str:
        """Take the lock, recover or clear an earlier staging directory, make the marked staging
        directory; every step undone when a later one fails (ENOSPC included): ``dst``, when this
        call created it, is removed again."""
        made: List[str] = []
        try:
            try:
                made = make_dirs(self.dst)
                self._dir = open_dir(self.dst)
                self._lock.acquire()
                self.recover()
                with signals_held():  # an interrupt inside make_owned would leave an entry nobody knows of
                    _, self._nonce = make_owned(self._dir, lambda nonce: STAGING_NAME, tries=1)
                    self._state = "staged"
            except BaseException:  # an interrupt held above lands here: remove what was staged
                self._state = "done"
                if self._nonce is not None:
                    self._discard_staging()
                self._release()
                remove_made_dirs(made)
                raise
        except OSError as e:
            raise disk_error(self.dst, e) from e
        return self.path

    def _refuse(self, why: str) -> DestinationError:
        return DestinationError(f"{self.path}: {why}, so it is not a staging directory hf-ckpt left; it was left as "
                                "it is (not read, moved or removed): remove it and save again")

    def recover(self) -> bool:
        """Under the lock: finish a commit a crash interrupted (its journal is in the staging
        directory), or remove an unfinished staging directory. True when a commit was finished.
        Only a real directory whose owner marker is ours and whose writer is gone is touched."""
        d = self._dir
        opened = d is None
        if d is None:
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
            record = read_marker(d, STAGING_NAME)
            if record is not None and writer_alive(record) is None:
                os.unlink(STAGING_NAME + OWNER_SUFFIX, dir_fd=d)  # a marker whose directory is gone
            return False
        if not stat.S_ISDIR(st.st_mode):
            raise self._refuse("is a symbolic link or a file")
        record = read_marker(d, STAGING_NAME)
        if record is None:
            raise self._refuse("has no valid owner marker of hf-ckpt")
        alive = writer_alive(record)
        if alive:
            raise self._refuse(alive)
        journal = self._read_journal(d)
        if journal is not None:
            self._apply(*journal)
        else:
            remove_dir(d, STAGING_NAME)
            os.unlink(STAGING_NAME + OWNER_SUFFIX, dir_fd=d)
        return journal is not None

    def _read_journal(self, d: int) -> Optional[Tuple[List[str], bool]]:
        """``(names, replace_existing)`` from the staging directory's journal, None without one;
        refused when it is not what :meth:`commit` writes (plain names of regular staged files)."""
        sd = os.open(STAGING_NAME, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW, dir_fd=d)
        try:
            try:
                fd = os.open(JOURNAL, os.O_RDONLY | NOFOLLOW | os.O_NONBLOCK, dir_fd=sd)
            except FileNotFoundError:
                return None
            except OSError:
                raise self._refuse(f"its {JOURNAL} is not a regular file") from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise self._refuse(f"its {JOURNAL} is not a regular file")
                raw = os.read(fd, JOURNAL_LIMIT + 1)
            finally:
                os.close(fd)
            try:
                record = json.loads(raw.decode("utf-8"))
                names, replace = record["files"], record["replace_existing"]
            except (ValueError, KeyError, TypeError, RecursionError):
                raise self._refuse(f"its {JOURNAL} is not a journal hf-ckpt writes") from None
            if (len(raw) > JOURNAL_LIMIT or not isinstance(names, list) or not isinstance(replace, bool)
                    or not all(plain_name(n) for n in names)):
                raise self._refuse(f"its {JOURNAL} names something other than files of it")
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
                tmp = os.path.join(self.path, JOURNAL + ".tmp")
                with open_new(tmp, "w", encoding="utf-8") as fh:
                    json.dump({"files": names, "replace_existing": self.replace_existing}, fh)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, os.path.join(self.path, JOURNAL))
                fsync_path(self.path)
            except OSError as e:  # nothing moved yet
                self._discard_staging()
                raise disk_error(self.dst, e) from e
            with signals_held():
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
