"""Rank-parallel export: N processes write the output shards of one plan between them.

Under ``torchrun --nproc_per_node N -m hf_ckpt_integrations export SRC DST`` (or any launcher
that sets ``RANK`` and ``WORLD_SIZE``; processes started by hand do too) the ranks run the one
writer (:func:`~.orchestrator.write`) with the :class:`~.commit.SiblingSwap` strategy:

1. the ranks meet in a rendezvous directory next to ``dst`` (:class:`~.filecomm.FileComm`: files
   on the destination's file system, which every rank must share anyway; no ``torch``); every rank
   built the plan itself from the same source (metadata only) and the ranks check that their
   plans name the same tensors, dtypes and shapes;
2. rank 0 checks ``dst``, creates the staging directory and assigns shard ``i`` to rank
   ``i % world_size``; every rank checks it can see the staging directory (multi-node: ``dst``
   must be on a file system all ranks share);
3. every rank writes its shards into it (:func:`~.writer.write_shard`, one at a time, fsynced);
4. all ranks exchange their failures: if any rank failed (or was lost: it never arrived, or its
   heartbeat stopped), rank 0 removes the staging directory and every rank raises
   :class:`~.comm.WriteError`;
5. otherwise rank 0 writes the index and config files and renames the directory into place,
   and tells every rank the outcome, so every rank returns the same report or raises.

The bytes written are the ones :func:`~.export.write_plan` writes in one process: same split,
same headers, same tensor bytes. A caller already inside a ``torch.distributed`` process group
(``group`` given, or the default group initialised: a training job exporting at its end) keeps
the collectives on that group (:class:`~.comm.TorchComm`; rank 0's plan is broadcast there):
torch is loaded anyway, and its ranks need not share a rendezvous directory.
"""

import contextlib
import hashlib
import os
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, Union

from .comm import Comm, WriteError, torchrun_comm
from .guards import StrPath
from .export import export_finisher
from .errors import DestinationError
from .filecomm import FileComm
from .orchestrator import write
from .plan import ExportPlan
from .writer import MAX_SHARD_SIZE, check_max_shard_size, decided, export_strategy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["write_plan_parallel", "world_from_env"]


def world_from_env() -> int:
    """``WORLD_SIZE`` as set by torchrun (1 when absent): the CLI's test for taking this path."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank_from_env() -> int:
    """``RANK`` as set by torchrun (0 when absent)."""
    raw = os.environ.get("RANK", "0") or "0"
    try:
        return int(raw)
    except ValueError:
        raise DestinationError(f"RANK={raw!r}: not a rank number; the launcher sets it (0..WORLD_SIZE-1)") from None


def torch_group_active(group: "Optional[ProcessGroup]" = None) -> bool:
    """Whether the collectives go through ``torch.distributed``: a ``group`` is given, or this
    process already initialised the default group (never imports torch to find out)."""
    if group is not None:
        return True
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def plan_digest(plan: ExportPlan) -> str:
    """What the ranks must agree on: every output tensor's name, dtype and shape, in order."""
    h = hashlib.sha256()
    for t in plan.tensors:
        h.update(f"{t.name}\0{t.out_dtype}\0{tuple(t.shape)}\n".encode())
    return h.hexdigest()


def write_plan_parallel(plan: Optional[ExportPlan], dst: StrPath, *, dtype: Optional[str] = None,
                        max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE, overwrite: bool = False,
                        quiet: bool = False, group: "Optional[ProcessGroup]" = None) -> Dict[str, Any]:
    """Write ``plan`` to ``dst`` from every rank; call on all ranks with the same arguments.

    Without a ``torch.distributed`` group (the CLI under torchrun, or processes started with
    ``RANK`` and ``WORLD_SIZE``) every rank passes its own plan of the same source, and the ranks
    meet through files next to ``dst`` (:class:`~.filecomm.FileComm`; torch is not imported). With
    ``group``, or the default group already initialised, the collectives go through it and
    ``plan`` is needed on rank 0 only (the others receive rank 0's). Returns, on every rank, the
    report :func:`~.export.write_plan` returns plus ``world_size`` and ``shards_by_rank``. Raises
    :class:`~.errors.DestinationError` (rank 0's own check of ``dst``) or
    :class:`~.comm.WriteError` (failures collected from all ranks, a rank that never arrived or
    stopped) on every rank; in both cases nothing is left at ``dst`` but what was there before.
    """
    max_shard_size = check_max_shard_size(max_shard_size)  # the same answer on every rank, before any collective
    what = f"{os.path.abspath(os.fspath(dst))}: rank-parallel export"
    with _comm(dst, group, what) as comm:
        if isinstance(comm, FileComm) or comm.world == 1:
            if plan is None:
                raise ValueError("write_plan_parallel without a torch.distributed group: pass the plan on every rank")
            plan = decided(plan, dtype)
            digests = comm.all_gather(plan_digest(plan))
            differ = {r: "its plan of the source differs from rank 0's (other tensors, dtypes or shapes): every rank "
                         "must read the same checkpoint with the same options" for r, d in enumerate(digests)
                      if d != digests[0]}
            if differ:
                raise WriteError(what, differ)
        else:
            plan = comm.broadcast(plan if comm.rank == 0 else None)
            assert plan is not None, "rank 0 passes the plan"
            plan = decided(plan, dtype)
        strategy = export_strategy(dst, plan, overwrite=overwrite)
        report = write(plan, strategy, comm=comm, max_shard_size=max_shard_size, finish=export_finisher(plan),
                       quiet=quiet, what=what)
    keys = ("destination", "files", "shards", "tensor_bytes", "bytes_on_disk", "config_files", "warnings", "seconds",
            "world_size", "shards_by_rank")
    return {k: report[k] for k in keys}


@contextlib.contextmanager
def _comm(dst: StrPath, group: "Optional[ProcessGroup]", what: str) -> Iterator[Comm]:
    """The ranks of this export: ``torch.distributed``'s when a group is active, else files next to ``dst``."""
    if torch_group_active(group):
        with torchrun_comm(group) as comm:
            yield comm
        return
    world = world_from_env()
    if world <= 1:
        yield Comm()
        return
    with FileComm(os.fspath(dst), rank_from_env(), world, what=what) as comm:
        yield comm
