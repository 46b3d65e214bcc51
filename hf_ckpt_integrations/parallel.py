"""Rank-parallel export: N processes write the output shards of one plan between them.

Under ``torchrun --nproc_per_node N -m hf_ckpt_integrations export SRC DST`` (or any launcher
that sets the ``torch.distributed`` env: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) the ranks run the one writer (:func:`~.orchestrator.write`) with the
:class:`~.commit.SiblingSwap` strategy:

1. rank 0's plan is broadcast (the plan is built once; every rank writes from the same one);
   rank 0 checks ``dst``, creates the staging directory and assigns shard ``i`` to rank
   ``i % world_size``; every rank checks it can see the staging directory (multi-node: ``dst``
   must be on a file system all ranks share);
2. every rank writes its shards into it (:func:`~.writer.write_shard`, one at a time, fsynced);
3. all ranks exchange their failures: if any rank failed, rank 0 removes the staging directory
   and every rank raises :class:`~.comm.WriteError`;
4. otherwise rank 0 writes the index and config files and renames the directory into place,
   and broadcasts the outcome, so every rank returns the same report or raises.

The bytes written are the ones :func:`~.export.write_plan` writes in one process: same split,
same headers, same tensor bytes. Collectives go through ``torch.distributed`` (gloo is enough:
only a few small objects travel; the data never leaves the file system).
"""

import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from .comm import torchrun_comm
from .guards import StrPath
from .export import export_finisher
from .orchestrator import write
from .plan import ExportPlan
from .writer import MAX_SHARD_SIZE, check_max_shard_size, decided, export_strategy

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["write_plan_parallel", "world_from_env"]


def world_from_env() -> int:
    """``WORLD_SIZE`` as set by torchrun (1 when absent): the CLI's test for taking this path."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def write_plan_parallel(plan: Optional[ExportPlan], dst: StrPath, *, dtype: Optional[str] = None,
                        max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE, overwrite: bool = False,
                        quiet: bool = False, group: "Optional[ProcessGroup]" = None) -> Dict[str, Any]:
    """Write ``plan`` to ``dst`` from every rank of ``group``; call on all ranks with the same arguments
    (``plan`` is needed on rank 0 only: the others receive rank 0's).

    Initializes the default process group from the torchrun environment (backend gloo) when none
    exists, and destroys it again before returning. Returns, on every rank, the report
    :func:`~.export.write_plan` returns plus ``world_size`` and ``shards_by_rank``. Raises
    :class:`~.errors.DestinationError` (rank 0's own check of ``dst``) or
    :class:`~.comm.WriteError` (failures collected from all ranks) on every rank; in both
    cases nothing is left at ``dst`` but what was there before.
    """
    max_shard_size = check_max_shard_size(max_shard_size)  # the same answer on every rank, before any collective
    with torchrun_comm(group) as comm:
        plan = comm.broadcast(plan if comm.rank == 0 else None)
        assert plan is not None, "rank 0 passes the plan"
        strategy = export_strategy(dst, plan, overwrite=overwrite)
        report = write(decided(plan, dtype), strategy, comm=comm, max_shard_size=max_shard_size,
                       finish=export_finisher(plan), quiet=quiet,
                       what=f"{os.path.abspath(os.fspath(dst))}: rank-parallel export")
    keys = ("destination", "files", "shards", "tensor_bytes", "bytes_on_disk", "config_files", "warnings", "seconds",
            "world_size", "shards_by_rank")
    return {k: report[k] for k in keys}
