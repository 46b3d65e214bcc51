"""Rank-parallel export: N processes write the output shards of one plan between them.

Under ``torchrun --nproc_per_node N -m hf_ckpt_integrations export SRC DST`` (or any launcher
that sets the ``torch.distributed`` env: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) every rank builds the same plan from metadata and the same
:func:`~.writer.split_shards` layout, then:

1. rank 0 checks ``dst`` and creates the staging directory (:class:`~.writer.Staging`) and
   broadcasts its path; every rank checks it can see it (multi-node: ``dst`` must be on a file
   system all ranks share);
2. every rank writes shards ``i`` with ``i % world_size == rank`` into it
   (:func:`~.writer.write_shard`, one shard at a time, each fsynced);
3. all ranks exchange their failures (``all_gather_object``): if any rank failed, rank 0
   removes the staging directory and every rank raises :class:`ParallelExportError`;
4. otherwise rank 0 writes the index and config files and renames the directory into place,
   and broadcasts the outcome, so every rank returns the same report or raises.

The bytes written are the ones :func:`~.writer.write_plan` writes in one process: same split,
same headers, same tensor bytes. Collectives go through ``torch.distributed`` (gloo is enough:
only a few small objects travel; the data never leaves the file system).
"""

import os
import time
from typing import Dict, List, Optional

from .errors import CheckpointError, DestinationError
from .plan import ExportPlan
from .safe_load import MappedFiles
from .writer import (MAX_SHARD_SIZE, Staging, check_max_shard_size, copy_config_files, plan_inputs, plan_tensors,
                     progress_bar, split_shards, write_index, write_shard)

__all__ = ["ParallelExportError", "write_plan_parallel", "world_from_env"]


class ParallelExportError(DestinationError):
    """One or more ranks failed; ``failures`` maps rank -> that rank's message. Nothing was written."""

    def __init__(self, dst, failures: Dict[int, str]):
        self.failures = dict(failures)
        lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"{dst}: rank-parallel export failed on {len(self.failures)} rank(s) — {lines}; "
                         "nothing was written")


def world_from_env() -> int:
    """``WORLD_SIZE`` as set by torchrun (1 when absent): the CLI's test for taking this path."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _dist():
    try:
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - torch is a dependency of every supported setup
        raise ImportError("rank-parallel export needs torch.distributed: pip install torch") from e
    return dist


def _message(e: BaseException) -> str:
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def write_plan_parallel(plan: ExportPlan, dst, *, dtype: Optional[str] = None, max_shard_size=MAX_SHARD_SIZE,
                        overwrite: bool = False, quiet: bool = False, group=None) -> dict:
    """Write ``plan`` to ``dst`` from every rank of ``group``; call on all ranks with the same arguments.

    Initializes the default process group from the torchrun environment (backend gloo) when none
    exists, and destroys it again before returning. Returns, on every rank, the report
    :func:`~.writer.write_plan` returns plus ``world_size`` and ``shards_by_rank``. Raises
    :class:`~.errors.DestinationError` (rank 0's own check of ``dst``) or
    :class:`ParallelExportError` (failures collected from all ranks) on every rank; in both cases
    nothing is left at ``dst`` but what was there before.
    """
    max_shard_size = check_max_shard_size(max_shard_size)  # the same answer on every rank, before any collective
    dist = _dist()
    created = not dist.is_initialized()
    if created:
        dist.init_process_group(backend="gloo")
    try:
        return _write(dist, plan, dst, dtype, max_shard_size, overwrite, quiet, group)
    finally:
        if created:
            dist.destroy_process_group()


def _write(dist, plan, dst, dtype, max_shard_size, overwrite, quiet, group):
    started = time.perf_counter()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    staging = None

    # 1. rank 0 checks dst and prepares the staging directory; everyone learns its path (or the refusal).
    box: List = [None, None]
    if rank == 0:
        try:
            staging = Staging(dst, overwrite=overwrite, inputs=plan_inputs(plan), configs=[plan.config_dir])
            box = [staging.__enter__(), None]
        except CheckpointError as e:
            box = [None, str(e)]
    dist.broadcast_object_list(box, src=0, group=group)
    tmp, refusal = box
    if refusal is not None:
        raise DestinationError(refusal)
    try:
        return _write_staged(dist, plan, dst, staging, tmp, rank, world, dtype, max_shard_size, quiet, group, started)
    except BaseException as e:  # an interrupt (SIGINT/SIGTERM) too: rank 0 removes what it created
        if staging is not None:
            staging.__exit__(type(e), e, None)  # no-op when it already ran
        raise


def _write_staged(dist, plan, dst, staging, tmp, rank, world, dtype, max_shard_size, quiet, group, started):
    dst = staging.dst if staging is not None else os.path.abspath(os.fspath(dst))

    skipped: List[str] = []
    with MappedFiles() as files:
        error = None
        mine: List[str] = []
        try:
            if not os.path.isdir(tmp):
                raise DestinationError(f"{tmp}: rank 0 created this staging directory but rank {rank} cannot "
                                       "see it; the destination must be on a file system every rank shares")
            tensors = plan_tensors(plan, dtype, files, ranges=True)
            split = split_shards(tensors, max_shard_size)
            by_name = {t.name: t for t in tensors}
            shards = list(split.filename_to_tensors.items())
            mine = [f for i, (f, _) in enumerate(shards) if i % world == rank]
            total = sum(by_name[n].nbytes for f, names in shards if f in mine for n in names)
            # 2. this rank's shards, one at a time.
            with progress_bar(total, f"export (rank {rank}/{world})", quiet or rank != 0) as bar:
                for filename, names in shards:
                    if filename in mine:
                        try:
                            write_shard(os.path.join(tmp, filename), [by_name[n] for n in names], bar)
                        except OSError as e:
                            raise DestinationError(f"writing {filename}: {e.strerror or e} (errno {e.errno}); "
                                                   "check free space, quota and permissions") from e
        except Exception as e:  # every failure must reach the collective below, or the others hang
            error = _message(e)

        # 3. all ranks learn every failure.
        errors: List = [None] * world
        dist.all_gather_object(errors, error, group=group)
        failures = {r: m for r, m in enumerate(errors) if m is not None}
        if failures:
            if rank == 0:
                staging.__exit__(ParallelExportError, ParallelExportError(dst, failures), None)
            dist.barrier(group=group)  # the staging directory is gone when any rank returns
            raise ParallelExportError(dst, failures)

        # 4. rank 0 finishes the directory and renames it into place.
        outcome: List = [None, [], dst, skipped]  # [rank 0's failure, config files copied, dst, warnings]
        if rank == 0:
            try:
                if split.is_sharded:
                    write_index(tmp, split, tensors)
                outcome[1] = copy_config_files(plan.config_dir, tmp, skipped, tensors=tensors)
            except Exception as e:
                outcome[0] = _message(e)
                try:
                    staging.__exit__(type(e), e, None)
                except CheckpointError as wrapped:
                    outcome[0] = str(wrapped)
            else:
                try:
                    staging.__exit__(None, None, None)
                except CheckpointError as e:
                    outcome[0] = str(e)
        dist.broadcast_object_list(outcome, src=0, group=group)
        if outcome[0] is not None:
            raise ParallelExportError(dst, {0: outcome[0]})
        dst = outcome[2]

    shards_by_rank: Dict[int, List[str]] = {}
    for i, (f, _) in enumerate(shards):
        shards_by_rank.setdefault(i % world, []).append(f)
    names = sorted(os.listdir(dst))
    return {"destination": dst, "files": names, "shards": len(shards), "tensor_bytes": sum(t.nbytes for t in tensors),
            "bytes_on_disk": sum(os.path.getsize(os.path.join(dst, f)) for f in names),
            "config_files": outcome[1], "warnings": outcome[3],
            "seconds": round(time.perf_counter() - started, 3), "world_size": world,
            "shards_by_rank": shards_by_rank}
