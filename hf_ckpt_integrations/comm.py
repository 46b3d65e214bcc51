"""The one communication layer: every collective the package makes goes through a :class:`Comm`.

As torch DCP's ``_DistWrapper`` (``torch/distributed/checkpoint/utils.py``) does for its save and
load paths, it runs a step on the coordinator and turns a failure on any rank into the same error on
every rank, so no caller writes its own "rank 0 tries, then tell the others" block:

- :meth:`Comm.on_rank0` — ``fn()`` on rank 0, its result on every rank; a failure there raises the
  same :class:`WriteError` on every rank (one collective);
- :meth:`Comm.all_ok` — every rank passes its own failure (or None); if any rank failed, every rank
  raises the same :class:`WriteError` naming each failed rank (one collective);
- :meth:`Comm.broadcast`, :meth:`Comm.all_gather`, :meth:`Comm.barrier` — the plain collectives.

Device rules (``docs/gpu.md``): a tensor in a collective must be on the device its process group
moves — the rank's current accelerator for NCCL (a CPU tensor raises there), the CPU for gloo.
:func:`collective_device` decides it from the group's backend, in one place; :class:`Traffic` is the
tensor side of every save-time read (ZeRO-3 partitions, DTensor gathers): it stages each tensor on
that device and has the ranks agree (:meth:`Traffic.agree`, one small all-reduce) before each
collective read, so a failure while staging on one rank (an out-of-memory) is the same
:class:`WriteError` on every rank instead of a rank that skips a collective its peers enter.
Pickled objects never travel on an accelerator group: :class:`TorchComm` of the default group sends
them over a gloo side group (created once, with the world's timeout but at least 30 minutes), which
also keeps rank 0's planning off NCCL's watchdog.

Every rank of the group makes the same calls in the same order. With one process (the base
:class:`Comm`, world 1) there are no collectives, and a failure raises the original error (a
:class:`~.errors.CheckpointError` says precisely what is wrong; there is no other rank to tell).

Ranks come from ``torch.distributed`` whenever it is initialised (:func:`default_comm`), never from
Accelerate's state, which on a CPU-only DeepSpeed launch reports one process on every rank.
"""

import contextlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union, cast

from .errors import CheckpointError, DestinationError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["WriteError", "Comm", "TorchComm", "default_comm", "torchrun_comm", "failure_message",
           "collective_device", "Traffic"]

T = TypeVar("T")


class WriteError(DestinationError):
    """A step failed on one or more ranks; raised on every rank with the same message.

    ``failures`` maps each failed rank to its message (as DCP's ``CheckpointException.failures``).
    Nothing of the failed write is visible at the destination.
    """

    def __init__(self, what: str, failures: Dict[int, str], consequence: str = "nothing was written") -> None:
        self.what = what
        self.failures = {int(r): str(m) for r, m in failures.items()}
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.failures)} — {lines}; {consequence}")

    def __reduce__(self) -> Tuple[type, Tuple[str, Dict[int, str]]]:
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

    def all_gather(self, obj: T) -> List[T]:
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
        result: Optional[T] = None
        failure: Optional[str] = None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:  # every rank must hear of it, or the others wait forever
                failure = failure_message(e)
        result, failure = self.broadcast((result, failure))
        if failure is not None:
            raise WriteError(what, {0: failure}, consequence)
        return cast(T, result)  # fn's result on rank 0, broadcast


def _device_types(backend: str) -> List[str]:
    """The device types a backend moves (``"cpu:gloo,cuda:nccl"`` names them itself)."""
    import torch.distributed as dist

    backend = str(backend).lower()
    if ":" in backend:
        return [pair.split(":")[0] for pair in backend.split(",")]
    return list(dist.Backend.backend_capability.get(backend, ["cpu"]))


def collective_device(group: "Optional[ProcessGroup]" = None) -> "torch.device":
    """The device a tensor must be on to take part in a collective of ``group`` (default: the
    world): the CPU when the group's backend moves CPU tensors (gloo), else this rank's accelerator
    device — the group's bound device (``init_process_group(device_id=...)``), else the current
    device, except that a process that never called ``set_device`` (current device 0) under a
    launcher that sets ``LOCAL_RANK`` gets device ``LOCAL_RANK`` (every rank on device 0 is what NCCL
    refuses)."""
    import torch
    import torch.distributed as dist

    kinds = _device_types(dist.get_backend(group))
    if "cpu" in kinds:
        return torch.device("cpu")
    pg = group if group is not None else dist.group.WORLD
    bound = getattr(pg, "bound_device_id", None)
    if bound is not None:
        return torch.device(bound)
    kind = kinds[0]
    module = getattr(torch, kind)
    index = module.current_device()
    local = os.environ.get("LOCAL_RANK", "")
    if index == 0 and local.isdigit() and 0 < int(local) < module.device_count():
        index = int(local)
    return torch.device(kind, index)


class Traffic:
    """The tensor side of the save-time collectives of one write: every rank builds one (the same
    calls in the same order) and passes its tensors through it.

    - :attr:`device`: where tensors must be (:func:`collective_device` of the world, decided once);
    - :meth:`stage`: a tensor on that device (a CPU-offloaded partition is copied there first, as
      DeepSpeed and torch DCP do; one already there is returned as is);
    - :meth:`agree`: before each collective read, every rank passes its own failure (or None);
      one small all-reduce, and only when some rank failed a gather of the messages: every rank then
      raises the same :class:`WriteError`, and every later read raises it again without a collective
      (no rank enters a collective its peers skip);
    - :meth:`exchange`: point-to-point operations, batched (``batch_isend_irecv``: on NCCL one
      grouped call on the group's communicator, not a 2-rank communicator per pair).
    """

    def __init__(self, dist: Optional[ModuleType] = None, what: str = "reading the live model") -> None:
        if dist is None:
            import torch.distributed
            dist = torch.distributed
        self.dist, self.what = dist, what
        self.rank = dist.get_rank()
        self.failed: Optional[WriteError] = None
        self._device: "Optional[torch.device]" = None

    @property
    def device(self) -> "torch.device":
        if self._device is None:
            self._device = collective_device()
        return self._device

    def stage(self, t: "torch.Tensor") -> "torch.Tensor":
        """``t`` on :attr:`device` (a copy when it is elsewhere)."""
        if t.device == self.device:
            return t
        return t.to(self.device, non_blocking=False)

    def empty(self, numel: int, dtype: "torch.dtype") -> "torch.Tensor":
        """A receive buffer on :attr:`device`."""
        import torch

        return torch.empty(numel, dtype=dtype, device=self.device)

    def agree(self, error: Optional[BaseException]) -> None:
        """Collective: raise the same :class:`WriteError` on every rank when any rank passed a failure."""
        if self.failed is not None:
            raise self.failed
        import torch

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.device)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX)
        if int(flag.item()) == 0:
            return
        try:  # every rank's message, on the CPU; with one process the error itself
            default_comm().all_ok(error, self.what)
        except WriteError as e:
            self.failed = e
            raise

    def exchange(self, ops: Sequence[Tuple[Callable[..., Any], "torch.Tensor", int]]) -> None:
        """Run point-to-point ``ops`` (``(dist.isend | dist.irecv, tensor, peer)``) as one batch and wait."""
        if not ops:
            return
        works = self.dist.batch_isend_irecv([self.dist.P2POp(op, t, peer) for op, t, peer in ops])
        for w in works:
            w.wait()


_SIDE_GROUPS: "Dict[int, Tuple[ProcessGroup, ProcessGroup]]" = {}  # id(world) -> (world, its gloo side group)


def _object_group(dist: ModuleType, group: "Optional[ProcessGroup]") -> "Optional[ProcessGroup]":
    """The group pickled objects travel on: ``group`` when it moves CPU tensors, else (the default
    group on NCCL) a gloo group over the same ranks, created once — on every rank, at the same
    call, since every rank makes the same calls."""
    if group is not None or "cpu" in _device_types(dist.get_backend(group)):
        return group
    world = dist.group.WORLD
    side = _SIDE_GROUPS.get(id(world))
    if side is None or side[0] is not world:
        # The world's timeout, but never less than torch's gloo default (30 min): rank 0 may plan for
        # a while (NCCL's 10-minute default would stop it).
        from datetime import timedelta

        from torch.distributed.distributed_c10d import _get_default_store, default_pg_timeout

        try:
            timeout = max(_get_default_store().timeout, default_pg_timeout)
        except (AttributeError, RuntimeError, ValueError):
            timeout = default_pg_timeout
        side = _SIDE_GROUPS[id(world)] = (world, dist.new_group(backend="gloo", timeout=timedelta(
            seconds=timeout.total_seconds())))
    return side[1]


class TorchComm(Comm):
    """``torch.distributed`` (``group``, default the world): a few small pickled objects travel, on
    the CPU (a gloo side group when the default group is NCCL: see the module doc)."""

    def __init__(self, dist: Optional[ModuleType] = None, group: "Optional[ProcessGroup]" = None) -> None:
        if dist is None:
            import torch.distributed
            dist = torch.distributed
        self.dist, self.group = dist, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._objects: "Optional[ProcessGroup]" = None

    @property
    def objects(self) -> "Optional[ProcessGroup]":
        if self._objects is None:
            self._objects = _object_group(self.dist, self.group)
        return self._objects

    def broadcast(self, obj: T) -> T:
        box = [obj]
        src = 0 if self.group is None else self.dist.get_global_rank(self.group, 0)
        self.dist.broadcast_object_list(box, src=src, group=self.objects)
        return box[0]

    def all_gather(self, obj: T) -> List[T]:
        out: List[Any] = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.objects)
        return out

    def barrier(self) -> None:
        self.dist.barrier(group=self.objects)


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
def torchrun_comm(group: "Optional[ProcessGroup]" = None) -> Iterator[TorchComm]:
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
