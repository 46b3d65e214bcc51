"""A torch-free :class:`~.comm.Comm` for the rank-parallel export: collectives through files in a
rendezvous directory next to the destination.

The rank-parallel export moves only a few small control objects between its ranks (the staging
directory and shard assignment, each rank's failure, the commit's report); the data never leaves
the file system. Importing ``torch`` for a gloo process group cost each rank ~240 MB of RSS and
seconds of start-up, more than the export itself holds. This module needs nothing but the
destination's file system, which every rank must share anyway (rank 0's staging directory is
where every rank writes), so it works under ``torchrun`` on one node or many, under any launcher
that sets ``RANK`` and ``WORLD_SIZE``, or with processes started by hand.

**Where.** ``.<dst>.hfckpt-rdzv-<key>``, a sibling of the destination (its parent is created by
rank 0 when missing). ``key`` is a digest of the launcher's job identity (``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``) and ``WORLD_SIZE``, so
two jobs writing next to each other do not meet; the directory must be owned by the user and
writable by nobody else (every object read there is unpickled, with an allowlist).

**Rendezvous (fresh in every run, whatever an earlier crashed run left).** Rank 0 makes a session
directory named by a random nonce and publishes its name in ``current`` (an atomic rename). Every
other rank reads ``current``, writes ``hello-R`` holding a nonce of its own into that session and
waits for rank 0's ``welcome``, which lists the nonces it received: a rank accepts only a welcome
that names its own nonce, so a session left by an earlier run is never joined (its rank 0 never
answers; the rank keeps reading ``current`` until the new one appears).

**Collectives** (:meth:`broadcast`, :meth:`all_gather`, :meth:`barrier`, numbered in call order):
rank 0 writes ``N.b`` for a broadcast; for a gather every rank writes ``N.R`` and rank 0 combines
them into ``N.all`` (O(world) files read per collective, on every rank). Each file is written to
a temporary name and renamed, so a reader sees all of it or nothing.

**Liveness, never a hang.** Every rank's thread rewrites ``alive-R`` (a counter) every
``HEARTBEAT`` seconds. A rank waiting for another fails with :class:`~.comm.WriteError` when the
other never arrived within ``HFCKPT_PARALLEL_TIMEOUT`` seconds (default 1800: ranks plan at their
own speed before they meet) or its counter stopped for ``HFCKPT_PARALLEL_STALE`` seconds (default
60: the process died, its node went away). The counter is compared with this process's own
monotonic clock, never with another node's. A lost rank is reported like a failed one (the rank's
entry in ``failures``), rank 0 removes the staging directory, and the collectives that follow do
not wait for it. When rank 0 itself is lost, its staging directory stays (its owner marker names
the dead writer: the next export to the same destination removes it). At the end rank 0 waits for
every rank's ``done-R`` and removes the rendezvous directory.
"""

import hashlib
import io
import os
import pickle
import secrets
import shutil
import stat
import threading
import time
from types import TracebackType
from typing import Any, Dict, List, Optional, Set, Type, TypeVar

from ._staging import make_dirs, remove_made_dirs
from .comm import Comm, WriteError, failure_message as _message
from .errors import DestinationError

__all__ = ["FileComm", "RDZV_MARKER", "HEARTBEAT", "rendezvous_dir"]

T = TypeVar("T")

RDZV_MARKER = ".hfckpt-rdzv-"
HEARTBEAT = 1.0  # seconds between a rank's heartbeats
_LIMIT = 64 << 20  # the largest control object read (a report of a few thousand shards is ~1 MB)
# What the control objects may hold besides Python's plain types (dict, list, tuple, str, int,
# float, bool, None: those need no lookup): the orchestrator's shard assignment.
_ALLOWED = {("hf_ckpt_integrations.orchestrator", "Assignment")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not a control object of the rank-parallel export")
        return super().find_class(module, name)


def _loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        raise DestinationError(f"{name}={raw!r}: not a number of seconds; unset it or give e.g. {name}=600") from None
    if value <= 0:
        raise DestinationError(f"{name}={raw!r}: must be more than 0 seconds")
    return value


def rendezvous_dir(dst: str, world: int) -> str:
    """The rendezvous directory of this job for destination ``dst`` (see the module doc)."""
    dst = os.path.abspath(os.fspath(dst))
    ident = "|".join([str(world)] + [os.environ.get(k, "") for k in (
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")])
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}{RDZV_MARKER}{key}")


class _Lost(Exception):
    """A rank this one waits for is gone (never arrived, or its heartbeat stopped)."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank, self.message = rank, message


class FileComm(Comm):
    """The ranks of a rank-parallel export meeting in files next to ``dst`` (module doc).

    A context manager: entering it runs the rendezvous (rank 0 waits for every rank), leaving it
    lets rank 0 wait for every rank's last read and remove the rendezvous directory. ``what``
    names the step in errors (the export's destination)."""

    def __init__(self, dst: str, rank: int, world: int, *, what: str = "rank-parallel export",
                 timeout: Optional[float] = None, stale: Optional[float] = None) -> None:
        if not 0 <= rank < world:
            raise DestinationError(f"RANK={rank} with WORLD_SIZE={world}: the rank must be in 0..{world - 1}")
        self.rank, self.world, self.what = rank, world, what
        self.root = rendezvous_dir(dst, world)
        self.timeout = timeout if timeout is not None else _env_seconds("HFCKPT_PARALLEL_TIMEOUT", 1800.0)
        self.stale = stale if stale is not None else _env_seconds("HFCKPT_PARALLEL_STALE", 60.0)
        self.session: Optional[str] = None
        self.lost: Dict[int, str] = {}  # rank -> why it is not waited for any more
        self._seq = 0
        self._nonce = secrets.token_hex(8)
        self._made: List[str] = []
        self._owned = False
        self._beat_path: Optional[str] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._seen: Dict[int, Any] = {}  # rank -> (its last heartbeat, when this process saw it change)
        self._started = time.monotonic()

    # -- files ---------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        assert self.session is not None
        return os.path.join(self.session, name)

    def _put(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{self._nonce}"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)

    @staticmethod
    def _get(path: str) -> Optional[bytes]:
        try:
            with open(path, "rb") as fh:
                data = fh.read(_LIMIT + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if len(data) > _LIMIT:
            raise DestinationError(f"{path}: larger than {_LIMIT >> 20} MB; not a file of hf-ckpt's rank-parallel "
                                   "export: remove the directory and run again")
        return data

    def _check_root(self) -> None:
        """The rendezvous directory is a real directory of this user that nobody else can write."""
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise DestinationError(f"{self.root}: not a directory of this user closed to others, as hf-ckpt makes its "
                                   "rendezvous directory; it was left as it is: remove it and run again")

    # -- heartbeats ----------------------------------------------------------------------------

    def _beat(self) -> None:
        count = 0
        while not self._stop.wait(HEARTBEAT):
            count += 1
            path = self._beat_path
            if path is not None:
                try:
                    self._put(path, f"{self._nonce} {count}".encode())
                except OSError:
                    pass  # the session is being removed at the end, or the file system hiccupped

    def _start_beating(self, session: str) -> None:
        self._beat_path = os.path.join(session, f"alive-{self.rank}")
        self._put(self._beat_path, f"{self._nonce} 0".encode())
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="hfckpt-heartbeat", daemon=True)
            self._thread.start()

    def _check_alive(self, rank: int, session: str) -> None:
        """Raise :class:`_Lost` when ``rank`` left (its ``done`` file), never arrived within the
        timeout, or stopped beating for ``stale`` seconds."""
        now = time.monotonic()
        left = self._get(os.path.join(session, f"done-{rank}"))
        if left is not None:
            why = left.decode("utf-8", "replace").strip()
            raise _Lost(rank, f"left the export before this step{': ' + why if why else ''}")
        beat = self._get(os.path.join(session, f"alive-{rank}"))
        seen = self._seen.get(rank)
        if beat is None:
            if seen is not None:  # it was there: its session is gone (rank 0 ended and removed it)
                raise _Lost(rank, "ended: its rendezvous files are gone")
            if now - self._started > self.timeout:
                raise _Lost(rank, f"never arrived within {self.timeout:g} s (HFCKPT_PARALLEL_TIMEOUT); was it started "
                                  "with the same WORLD_SIZE and destination, and can it see this file system?")
            return
        if seen is None or seen[0] != beat:
            self._seen[rank] = (beat, now)
        elif now - seen[1] > self.stale:
            raise _Lost(rank, f"no sign of life for {self.stale:g} s (HFCKPT_PARALLEL_STALE): the process died or its "
                              "node is gone")

    def _wait(self, path: str, ranks: List[int], session: Optional[str] = None) -> bytes:
        """Poll for ``path``, watching ``ranks`` (the ones that would write it) for life."""
        delay = 0.002
        while True:
            data = self._get(path)
            if data is not None:
                return data
            for r in ranks:
                if r not in self.lost:
                    self._check_alive(r, session or self.session or "")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    # -- rendezvous ----------------------------------------------------------------------------

    def __enter__(self) -> "FileComm":
        try:
            if self.rank == 0:
                self._meet_as_rank0()
            else:
                self._meet()
        except _Lost as e:
            self._close(failed=True)
            raise WriteError(self.what, {e.rank: e.message}, "nothing was written") from None
        except BaseException as e:
            self._close(failed=True, why=_message(e))
            raise
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._close(failed=kind is not None, why=_message(value) if value is not None else "")

    def _meet_as_rank0(self) -> None:
        self._made = make_dirs(os.path.dirname(self.root))
        try:
            os.mkdir(self.root, 0o700)
        except FileExistsError:
            pass
        self._check_root()
        self._owned = True  # a directory of this user's, closed to others: removed at the end
        self.session = os.path.join(self.root, self._nonce)
        os.mkdir(self.session, 0o700)
        self._start_beating(self.session)
        self._put(os.path.join(self.root, "current"), self._nonce.encode())
        nonces = {0: self._nonce}
        delay = 0.002
        while len(nonces) < self.world:
            for r in range(1, self.world):
                if r not in nonces:
                    data = self._get(self._path(f"hello-{r}"))
                    if data is not None:
                        nonces[r] = data.decode("ascii", "replace")
            missing = [r for r in range(1, self.world) if r not in nonces]
            if missing and time.monotonic() - self._started > self.timeout:
                lost = {r: f"never arrived within {self.timeout:g} s (HFCKPT_PARALLEL_TIMEOUT); was it started with "
                           "the same WORLD_SIZE and destination, and can it see this file system?" for r in missing}
                self._put(self._path("welcome"), pickle.dumps({"failed": lost}))
                raise WriteError(self.what, lost, "nothing was written")
            if missing:
                time.sleep(delay)
                delay = min(delay * 1.5, 0.1)
        self._put(self._path("welcome"), pickle.dumps({"nonces": nonces}))

    def _meet(self) -> None:
        current = os.path.join(self.root, "current")
        joined: Optional[str] = None  # the session this rank said hello to
        delay = 0.002
        while True:
            raw = self._get(current)
            name = raw.decode("ascii", "replace") if raw is not None else None
            if name is not None and name != joined:
                session = os.path.join(self.root, name)
                try:
                    self._check_root()
                    self._put(os.path.join(session, f"hello-{self.rank}"), self._nonce.encode())
                    self._start_beating(session)
                    joined = name
                except FileNotFoundError:
                    pass  # a session of an earlier run, being removed: read current again
            if joined is not None:
                data = self._get(os.path.join(self.root, joined, "welcome"))
                welcome = _loads(data) if data is not None else {}
                if welcome.get("nonces", {}).get(self.rank) == self._nonce:
                    self.session = os.path.join(self.root, joined)
                    self._seen[0] = (b"", time.monotonic())
                    return
                if "failed" in welcome and self.rank not in welcome["failed"]:
                    self.session = os.path.join(self.root, joined)
                    raise WriteError(self.what, welcome["failed"], "nothing was written")
            # A session whose rank 0 is dead (an earlier run's) never welcomes this rank: it keeps
            # reading current until the new rank 0 replaces it, or the timeout.
            if time.monotonic() - self._started > self.timeout:
                raise _Lost(0, f"did not open the rendezvous in {self.root} within {self.timeout:g} s "
                               "(HFCKPT_PARALLEL_TIMEOUT); was it started, with the same WORLD_SIZE and destination?")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.1)

    def _close(self, failed: bool, why: str = "") -> None:
        try:
            if self.session is not None and (self.rank != 0 or failed):
                # Written last, after this rank's last read: rank 0 removes the session once every
                # rank has one. A rank that fails outside a collective (rank 0 too) says why, so
                # its peers stop waiting for it at once.
                self._put(self._path(f"done-{self.rank}"), why.encode() if failed else b"")
            if self.rank == 0 and self.session is not None:
                for r in range(1, self.world):
                    if r in self.lost:
                        continue
                    if self._get(self._path(f"done-{r}")) is None:
                        try:
                            self._wait(self._path(f"done-{r}"), [r])
                        except _Lost:
                            continue
        finally:
            self._stop.set()
            if self._thread is not None:
                self._thread.join()
            if self.rank == 0 and self._owned:
                shutil.rmtree(self.root, ignore_errors=True)
            if self.rank == 0:
                if failed:
                    remove_made_dirs(self._made)

    # -- collectives ---------------------------------------------------------------------------

    def _lost_error(self, lost: Dict[int, str], failures: Optional[Dict[int, str]] = None, what: Optional[str] = None,
                    consequence: str = "nothing was written") -> WriteError:
        self.lost.update(lost)
        return WriteError(what or self.what, {**(failures or {}), **lost}, consequence)

    def broadcast(self, obj: T) -> T:
        self._seq += 1
        path = self._path(f"{self._seq}.b")
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            self._put(path, data)
            return _loads(data)  # every rank returns the same objects
        if 0 in self.lost:
            raise self._lost_error({0: self.lost[0]})
        try:
            return _loads(self._wait(path, [0]))
        except _Lost as e:
            raise self._lost_error({e.rank: e.message}) from None

    def _gather(self, obj: Any) -> Any:
        """Every rank's ``obj`` (None for a rank not heard from) and ``{rank: why}`` for the ranks
        lost in this collective; the same on every rank."""
        self._seq += 1
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        combined = self._path(f"{self._seq}.all")
        if self.rank != 0:
            self._put(self._path(f"{self._seq}.{self.rank}"), mine)
            if 0 in self.lost:
                raise self._lost_error({0: self.lost[0]})
            try:
                result = _loads(self._wait(combined, [0]))
            except _Lost as e:
                raise self._lost_error({e.rank: e.message}) from None
        else:
            values: List[Any] = [_loads(mine)] + [None] * (self.world - 1)
            lost: Dict[int, str] = {}
            for r in range(1, self.world):
                if r in self.lost:
                    continue
                try:
                    values[r] = _loads(self._wait(self._path(f"{self._seq}.{r}"), [r]))
                except _Lost as e:
                    lost[e.rank] = e.message
            data = pickle.dumps({"values": values, "lost": lost}, protocol=pickle.HIGHEST_PROTOCOL)
            self._put(combined, data)
            result = _loads(data)
        self.lost.update(result["lost"])
        return result

    def all_gather(self, obj: T) -> List[T]:
        result = self._gather(obj)
        if result["lost"]:
            raise self._lost_error(result["lost"])
        return list(result["values"])

    def all_ok(self, error: Any, what: str, consequence: str = "nothing was written") -> None:
        """:meth:`~.comm.Comm.all_ok`, where a rank lost during the exchange is one more failure."""
        text = None if error is None else error if isinstance(error, str) else _message(error)
        result = self._gather(text)
        failures = {r: m for r, m in enumerate(result["values"]) if m is not None}
        failures.update(result["lost"])
        if failures:
            raise WriteError(what, failures, consequence) from (error if isinstance(error, BaseException) else None)

    def barrier(self) -> None:
        """Wait for every rank not already lost (a rank lost here was reported by the step that
        called it, or is by the next one)."""
        try:
            self._gather(None)
        except WriteError:
            pass
