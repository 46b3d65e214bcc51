"""Rank files read in worker processes: each rank file's pickle is independent of the others', and
reading one is pure Python (the restricted unpickler, ~3 s CPU for a 45,395-DTensor file), so a
1,024-rank save read in one process is an hour of one core. Rank 0's file is read first in the
calling process (later ranks are checked against its names and :mod:`.rows` records); the others
are read by up to ``min(CPUs, 8)`` workers (the CPUs shared among torchrun's ``LOCAL_WORLD_SIZE`` ranks,
which each plan the same save in a rank-parallel export), rank ``1 + k + i*n`` by worker ``k``.

Why ``python -c`` subprocesses and not :mod:`multiprocessing`: ``spawn``/``forkserver`` import the
caller's ``__main__`` again in every worker (a training script without a ``__main__`` guard would
train again), and ``fork`` copies a process whose other threads (NCCL, data loaders) may hold locks.

What crosses the pipes is plain data (tuples, dicts, strings, numbers: rank 0's records out, each
rank's placed shards and offset shifts back), read on both sides with a loader that admits no
global at all. Nothing a worker says can refuse or pass a file: a rank it did not deliver (its file
refused, the worker killed or unable to start) is read again in the calling process, in rank order,
so the error raised is the one the in-process read raises, naming that file, and the lowest such
rank's. The exports are the same whichever process read a file (tests/sources/fsdp/test_fsdp_rank_files.py).

``HFCKPT_READ_PROCESSES``: ``0`` reads every file in the calling process; ``N`` uses ``N`` workers
whatever the files' size; unset, workers are used when rank 0's file took long enough that the
others would take over :data:`MIN_SECONDS` in one process (and there are 2+ CPUs). Each worker holds
one file's unpickled tree at a time (447 MB peak RSS measured for a 45,395-DTensor file).
"""

import io
import logging
import os
import pickle
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ...errors import OptionError

__all__ = ["ENV", "MIN_SECONDS", "MAX_WORKERS", "processes", "read_in_workers", "plain_loads", "serve"]

ENV = "HFCKPT_READ_PROCESSES"
MIN_SECONDS = 4.0  # worker start-up (~0.3 s each, an interpreter and this package) is paid back well before
MAX_WORKERS = 8  # each holds one file's tree; more rarely helps: the disk becomes the limit
_log = logging.getLogger(__name__)
_PKG = __name__.rpartition(".")[0]
# A worker answers on a pipe of its own (its fd in argv), never on stdout: what the interpreter's start
# (a sitecustomize, a .pth file) or an import prints goes to stdout, which is the caller's stderr.
_BOOT = ("import os, sys\n"
         "answers = os.fdopen(int(sys.argv[1]), 'wb')\n"
         f"from {_PKG} import read_for_worker\n"
         f"from {_PKG}.workers import serve\n"
         "serve(read_for_worker, sys.stdin.buffer, answers)\n")


def processes(others: int, rank0_seconds: float) -> int:
    """How many workers read the ``others`` rank files after rank 0's (0: read them here)."""
    raw = os.environ.get(ENV, "").strip()
    if raw:
        if not raw.isdigit():
            raise OptionError(f"{ENV}={raw!r}: not a number of processes; set 0 (read in this process) or N")
        return min(int(raw), others)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    # torchrun's ranks of a rank-parallel export each plan the same save: they share the node's CPUs
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    cpus //= int(local) if local.isdigit() and int(local) > 0 else 1
    if cpus < 2 or others < 2 or rank0_seconds * others < MIN_SECONDS:
        return 0
    return min(cpus, MAX_WORKERS, others)


class _Plain(pickle.Unpickler):
    """Containers, strings and numbers only: a pickle that names any global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}: the rank-file workers exchange plain data only")


def plain_loads(data: bytes) -> Any:
    return _Plain(io.BytesIO(data)).load()


def _frames(stream: Any) -> Any:
    """Length-prefixed pickles of plain data, until the stream ends (or breaks off mid-frame)."""
    while True:
        head = stream.read(8)
        if len(head) < 8:
            return
        size = int.from_bytes(head, "little")
        body = stream.read(size)
        if len(body) < size:
            return
        yield plain_loads(body)


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return len(body).to_bytes(8, "little") + body


def read_in_workers(job: Any, ranks: Sequence[int], n: int) -> Dict[int, Any]:
    """``{rank: what serve's reader returned}`` for the ranks ``n`` workers read; a rank missing from
    the answer (refused, or its worker lost) is the caller's to read. ``job``: plain data the reader
    is given with each rank."""
    env = dict(os.environ, **{ENV: "0"})
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    got: Dict[int, Any] = {}
    failed = threading.Event()
    children: List[subprocess.Popen] = []

    def collect(answers: Any) -> None:
        try:
            with answers:
                for rank, ok, payload in _frames(answers):
                    if not ok:
                        failed.set()  # the caller reads it again and raises; the other workers can stop
                        return
                    got[rank] = payload
        except Exception as e:  # a garbled answer: that worker's ranks are read again in this process
            _log.warning("a rank-file worker's answer was unreadable (%s); reading its files in this process", e)

    threads = []
    try:
        for k in range(n):
            mine = list(ranks[k::n])
            if not mine:
                continue
            r, w = os.pipe()
            try:
                child = subprocess.Popen([sys.executable, "-c", _BOOT, str(w)], stdin=subprocess.PIPE, stdout=2,
                                         pass_fds=(w,), env=env)
            except (OSError, ValueError) as e:  # no interpreter to start (embedded Python): read here
                _log.warning("cannot start a rank-file worker (%s); reading the files in this process", e)
                os.close(r)
                break
            finally:
                os.close(w)  # (the worker holds its own copy: its end closes when it exits)
            children.append(child)
            th = threading.Thread(target=collect, args=(os.fdopen(r, "rb"),), daemon=True)
            th.start()
            threads.append(th)
            assert child.stdin is not None
            try:
                child.stdin.write(_frame((job, mine)))
                child.stdin.close()
            except OSError:  # it died at start: its ranks are read here
                pass
        while any(th.is_alive() for th in threads) and not failed.is_set():
            failed.wait(0.1)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        for th in threads:
            th.join()
    return got


def serve(read: Callable[[Any, int], Any], stdin: Any, stdout: Any) -> None:
    """A worker's loop: ``(job, ranks)`` from ``stdin``; for each rank in order, ``read(job, rank)`` as a
    frame ``(rank, True, answer)``; at the first exception ``(rank, False, None)`` and stop."""
    job, ranks = next(_frames(stdin))
    for rank in ranks:
        try:
            answer: Optional[Tuple[Any, ...]] = read(job, rank)
        except Exception:
            stdout.write(_frame((rank, False, None)))
            stdout.flush()
            return
        stdout.write(_frame((rank, True, answer)))
        stdout.flush()
