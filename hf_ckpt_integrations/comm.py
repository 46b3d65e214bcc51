"""The one communication layer: every collective the package makes goes through a :class:`Comm`.

As torch DCP's ``_DistWrapper`` (``torch/distributed/checkpoint/utils.py``) does for its save and
load paths, it runs a step on the coordinator and turns a failure on any rank into the same error on
every rank, so no caller writes its own "rank 0 tries, then tell the others" block:

- :meth:`Comm.on_rank0` — ``fn()`` on rank 0, its result on every rank; a failure there raises the
  same :class:`WriteError` on every rank (one collective);
- :meth:`Comm.all_ok` — every rank passes its own failure (or None); if any rank failed, every rank
  raises the same :class:`WriteError` naming each failed rank (one collective);
- :meth:`Comm.broadcast`, :meth:`Comm.all_gather`, :meth:`Comm.barrier` — the plain collectives.

Every rank of the group makes the same calls in the same order. With one process (the base
:class:`Comm`, world 1) there are no collectives, and a failure raises the original error (a
:class:`~.errors.CheckpointError` says precisely what is wrong; there is no other rank to tell).

Ranks come from ``torch.distributed`` whenever it is initialised (:func:`default_comm`), never from
Accelerate's state, which on a CPU-only DeepSpeed launch reports one process on every rank.
"""

import contextlib
from typing import Callable, Dict, List, TypeVar, Union

from .errors import CheckpointError, DestinationError

__all__ = ["WriteError", "Comm", "TorchComm", "default_comm", "torchrun_comm", "failure_message"]

T = TypeVar("T")


class WriteError(DestinationError):
    """A step failed on one or more ranks; raised on every rank with the same message.

    ``failures`` maps each failed rank to its message (as DCP's ``CheckpointException.failures``).
    Nothing of the failed write is visible at the destination.
    """

    def __init__(self, what: str, failures: Dict[int, str], consequence: str = "nothing was written"):
        self.what = what
        self.failures = {int(r): str(m) for r, m in failures.items()}
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.failures)} — {lines}; {consequence}")

    def __reduce__(self):
        return (type(self), (self.what, self.failures))


def failure_message(e: BaseException) -> str:
    """What the other ranks are told of ``e``: a :class:`~.errors.CheckpointError`'s own sentence,
    else the exception type and message."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


class Comm:
    """The ranks working together. This base is one process: no collectives."""

    rank = 0
    world = 1

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        return [obj]

    def barrier(self) -> None:
        pass

    def all_ok(self, error: Union[BaseException, str, None], what: str,
               consequence: str = "nothing was written") -> None:
        """Every rank passes its own failure (an exception, a message, or None). When any rank failed,
        every rank raises the same :class:`WriteError` naming each failed rank; with one process the
        exception itself is raised. Collective."""
        text = None if error is None else error if isinstance(error, str) else failure_message(error)
        if self.world == 1:
            if isinstance(error, BaseException):
                raise error
            failures = {0: text} if text is not None else {}
        else:
            failures = {r: m for r, m in enumerate(self.all_gather(text)) if m is not None}
        if failures:
            raise WriteError(what, failures, consequence) from (error if isinstance(error, BaseException) else None)

    def on_rank0(self, fn: Callable[[], T], what: str, consequence: str = "nothing was written") -> T:
        """``fn()`` on rank 0 and its (picklable) result on every rank. If it raised, every rank raises
        the same :class:`WriteError` (with one process: ``fn``'s own exception). Collective."""
        if self.world == 1:
            return fn()
        result, failure = None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:  # every rank must hear of it, or the others wait forever
                failure = failure_message(e)
        result, failure = self.broadcast((result, failure))
        if failure is not None:
            raise WriteError(what, {0: failure}, consequence)
        return result


class TorchComm(Comm):
    """``torch.distributed`` (``group``, default the world): a few small pickled objects travel."""

    def __init__(self, dist=None, group=None):
        if dist is None:
            import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def broadcast(self, obj):
        box = [obj]
        src = 0 if self.group is None else self.dist.get_global_rank(self.group, 0)
        self.dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather(self, obj) -> list:
        out: List = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)


def default_comm() -> Comm:
    """:class:`TorchComm` of the default group when ``torch.distributed`` is initialised, else one
    process."""
    try:
        import torch.distributed as dist
    except ImportError:
        return Comm()
    if dist.is_available() and dist.is_initialized():
        return TorchComm(dist)
    return Comm()


@contextlib.contextmanager
def torchrun_comm(group=None):
    """A :class:`TorchComm` of ``group`` for a process started by ``torchrun`` (or any launcher
    setting ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``): the default process group
    is created from that environment (backend gloo) when none exists, and destroyed on exit."""
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch is a dependency of every supported setup
        raise ImportError("rank-parallel export needs torch.distributed: pip install torch") from e
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend="gloo")
    try:
        yield TorchComm(dist, group)
    finally:
        if created:
            dist.destroy_process_group()
