"""The one writer orchestrator: every path that writes HF weights runs :func:`write`.

Offline export (:func:`~.export.write_plan`, one process), rank-parallel export
(:func:`~.parallel.write_plan_parallel`, under torchrun) and the save-time hooks
(:func:`~.integrations._dist.write_distributed`) are thin front ends that build an
:class:`~.plan.ExportPlan` (its output dtypes decided, :func:`~.plan.check_plan` passed) and a
commit strategy (:mod:`.commit`) and call :func:`write`; the writer's per-shard inputs
(:func:`~.writer.plan_tensors`) are its own detail. Call order — every rank of ``comm`` calls
:func:`write` with the same plan (tensor names, sizes and order); "rank 0" is rank 0 of ``comm``:

1. **prepare** (rank 0, :meth:`~.comm.Comm.on_rank0`): ``strategy.begin()`` checks and locks the
   destination and creates the staging directory; :func:`assign` splits the tensors into shards
   (``huggingface_hub``'s split, so the names match ``save_pretrained``) and assigns each shard to a
   rank, once. Both are broadcast (one collective); a refusal raises on every rank.
2. **bind** (every rank): the plan's tensors become the tensors to write; a tensor produced on
   request (:class:`~.plan.LivePiece`: a live engine's parameter, a LoRA merge) is read with the
   rank the assignment names and the tensor's output dtype (a live ZeRO-3 or ColossalAI source
   sends its pieces only to that rank); a source never derives the assignment itself.
3. **write local shards** (every rank): the rank writing a shard streams it into the staging
   directory (:func:`~.writer.write_shard`, fsynced); with ``collective`` (reading a tensor is a
   collective), every other rank walks the same tensors in :func:`~.writer.shard_order` and calls
   their ``drain()`` — also a rank whose own write failed, so nobody hangs.
4. **gather failures** (every rank, :meth:`~.comm.Comm.all_ok`): if any rank failed, rank 0
   ``strategy.abort()``\\ s and every rank raises :class:`~.comm.WriteError` with all ranks' messages.
5. **commit** (rank 0, :meth:`~.comm.Comm.on_rank0`): the index (sharded only), ``finish(staging)``
   (config files), then ``strategy.commit(names)``; every rank returns the same report or raises
   the same :class:`~.comm.WriteError`.

With one process (``comm`` of world 1) there are no collectives and a failure raises the
original error (a :class:`~.errors.CheckpointError`), as a plain export always has.
"""

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .comm import Comm, WriteError, failure_message
from .commit import CommitStrategy, disk_error
from .errors import CheckpointError, DestinationError
from .formats import names
from .formats.dtypes import SIZES
from .formats.names import (ADAPTER_SAFETENSORS_NAME, BIN_INDEX as BIN_INDEX_NAME, BIN_PATTERN, SAFETENSORS_INDEX,
                            SAFETENSORS_PATTERN)
from .outfiles import open_new
from .mapped_files import MappedFiles
from .plan import ExportPlan
from .writer import MAX_SHARD_SIZE, OutTensor, plan_tensors, progress_bar, shard_order, write_shard

__all__ = ["Assignment", "assign", "write", "BIN_PATTERN", "BIN_INDEX_NAME"]


@dataclass
class Assignment:
    """Which file each tensor goes in and which rank writes each file: decided once, on rank 0."""

    shards: List[Tuple[str, List[str]]]  # (file name, tensor names) in file order
    ranks: List[int]  # ranks[i] writes shards[i]
    sharded: bool
    tensor_to_file: Dict[str, str] = field(default_factory=dict)
    _writer: Dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for (f, members), r in zip(self.shards, self.ranks):
            for n in members:
                self.tensor_to_file[n] = f
                self._writer[n] = r

    def writer_of(self, name: str) -> int:
        """The rank that writes tensor ``name``."""
        return self._writer[name]

    def by_rank(self) -> Dict[int, List[str]]:
        out: Dict[int, List[str]] = {}
        for (f, _), r in zip(self.shards, self.ranks):
            out.setdefault(r, []).append(f)
        return out


def assign(tensors: Sequence[OutTensor], max_shard_size, world: int, *, fmt: str = "safetensors") -> Assignment:
    """Split ``tensors`` (in their order) as ``save_pretrained`` does; shard ``i`` goes to rank ``i % world``."""
    pattern = {"safetensors": SAFETENSORS_PATTERN, "bin": BIN_PATTERN}.get(fmt)
    if fmt == "adapter":  # a PEFT adapter: PeftModel.save_pretrained's one unsharded file
        pattern, max_shard_size = ADAPTER_SAFETENSORS_NAME.replace(".safetensors", "{suffix}.safetensors"), 1 << 62
    split = names.split_shards({t.name: t for t in tensors}, lambda t: t.nbytes, max_shard_size=max_shard_size,
                               pattern=pattern)
    shards = [(f, list(members)) for f, members in split.filename_to_tensors.items()]
    return Assignment(shards, [i % world for i in range(len(shards))], split.is_sharded)


def write(plan: ExportPlan, strategy: Optional[CommitStrategy], *, comm: Optional[Comm] = None,
          files: Optional[MappedFiles] = None, max_shard_size=MAX_SHARD_SIZE, fmt: str = "safetensors",
          collective: bool = False, finish: Optional[Callable[[str, Sequence[OutTensor]], dict]] = None,
          what: str = "writing", consequence: str = "nothing was written", workers: int = 1,
          quiet: bool = True) -> dict:
    """Write the tensors of ``plan`` (every output dtype decided: :func:`~.plan.decide_dtypes`)
    through ``strategy`` from every rank of ``comm`` (see the module doc). Stored tensors are read
    through ``files`` (a :class:`~.mapped_files.MappedFiles`; one is opened for the call when
    None); a tensor produced on request (:class:`~.plan.LivePiece`) is read on behalf of the rank
    the assignment names.

    ``strategy`` is used on rank 0 only (other ranks may pass ``None``). ``finish(staging, tensors)``
    runs on rank 0 before the commit (``tensors``: the written tensors' ``name``/``dtype``/``shape``,
    in plan order) and returns extra report fields (config files copied, warnings). ``workers`` > 1
    writes that many shards at once from a thread pool (one process, non-collective only). Returns,
    on every rank, ``{"destination", "files", "shards", "shard_files", "sharded", "tensor_bytes",
    "written_here", "shards_by_rank", "world_size", "seconds", ...finish's fields}``. Raises
    :class:`WriteError` on every rank when any rank failed (with one process: the original error).
    """
    if files is None:
        with MappedFiles() as files:
            return write(plan, strategy, comm=comm, files=files, max_shard_size=max_shard_size, fmt=fmt,
                         collective=collective, finish=finish, what=what, consequence=consequence, workers=workers,
                         quiet=quiet)
    if any(t.out_dtype is None for t in plan.tensors):
        raise ValueError(f"{plan.source}: the plan's output dtypes are not decided (run plan.decide_dtypes)")
    sizes = plan_tensors(plan, None, files, ranges=True)  # what the assignment needs: names and sizes
    return _write_tensors(sizes, strategy, comm=comm, max_shard_size=max_shard_size, fmt=fmt, collective=collective,
                          bind=lambda assignment: plan_tensors(plan, None, files, ranges=True, assignment=assignment),
                          finish=finish, what=what, consequence=consequence, workers=workers, quiet=quiet)


def _write_tensors(tensors: Sequence[OutTensor], strategy: Optional[CommitStrategy], *, comm: Optional[Comm] = None,
                   max_shard_size=MAX_SHARD_SIZE, fmt: str = "safetensors", collective: bool = False,
                   bind: Optional[Callable[[Assignment], Sequence[OutTensor]]] = None,
                   finish: Optional[Callable[[str, Sequence[OutTensor]], dict]] = None, what: str = "writing",
                   consequence: str = "nothing was written", workers: int = 1, quiet: bool = True) -> dict:
    """:func:`write` over the writer's per-shard inputs: ``tensors`` (names and sizes for the
    assignment), then ``bind(assignment)`` (the tensors whose ``chunks()`` are written)."""
    started = time.perf_counter()
    comm = comm or Comm()
    rank, world = comm.rank, comm.world
    if fmt not in ("safetensors", "bin", "adapter"):
        raise ValueError(f"fmt={fmt!r}; use 'safetensors', 'bin' or 'adapter'")

    # 1. prepare: rank 0 locks and stages, and assigns the shards; every rank learns both.
    # From the moment begin() stages a directory, any exception or interrupt (SIGTERM arriving
    # during the assignment or the broadcast) must reach the abort below.
    try:
        staging, assignment = comm.on_rank0(lambda: (strategy.begin(), assign(tensors, max_shard_size, world, fmt=fmt)),
                                            what, consequence)
        return _write_staged(tensors, strategy, comm, assignment, staging, fmt, collective, bind, finish, what,
                             consequence, workers, quiet, started)
    except BaseException as e:  # an interrupt (SIGINT/SIGTERM) too: rank 0 removes what it staged
        if rank == 0:
            strategy.abort()  # a no-op after a commit or an abort
        if world == 1 and isinstance(e, OSError):
            raise disk_error(strategy.dst, e) from e
        raise


def _write_staged(tensors, strategy, comm, assignment, staging, fmt, collective, bind, finish, what, consequence,
                  workers, quiet, started):
    rank, world = comm.rank, comm.world
    error, written = None, []
    try:
        # 2. bind: the source learns who writes each tensor.
        if bind is not None:
            tensors = bind(assignment)
        if not os.path.isdir(staging):
            raise DestinationError(f"{staging}: rank 0 created this staging directory but rank {rank} cannot see it; "
                                   "the destination must be on a file system every rank shares")
        # 3. this rank's shards.
        written, error = _write_local(tensors, assignment, staging, rank, world, fmt, collective, workers, quiet)
    except Exception as e:  # every failure must reach the collective below, or the others hang
        if world == 1:
            raise
        error = failure_message(e)

    # 4. every rank learns every failure.
    try:
        comm.all_ok(error, what, consequence)
    except WriteError:
        if rank == 0:
            strategy.abort()
        comm.barrier()  # the staging directory is gone when any rank raises
        raise

    # 5. rank 0 finishes the directory and commits it.
    by_name = {t.name: t for t in tensors}
    report = {"shards": len(assignment.shards), "shard_files": sorted(f for f, _ in assignment.shards),
              "sharded": assignment.sharded, "tensor_bytes": sum(t.nbytes for t in tensors), "world_size": world,
              "shards_by_rank": assignment.by_rank()}

    def commit():
        try:
            if assignment.sharded:
                names.write_index(staging, assignment.tensor_to_file, total_size=report["tensor_bytes"],
                                  total_parameters=sum(t.nbytes // SIZES[t.dtype] for t in tensors),
                                  name=BIN_INDEX_NAME if fmt == "bin" else SAFETENSORS_INDEX)
            extra = finish(staging, list(by_name.values())) if finish is not None else {}
            staged = sorted(os.listdir(staging))
            strategy.commit(staged)
        except Exception:
            strategy.abort()  # (one process: write() aborts again, a no-op)
            raise
        dst = strategy.dst
        outcome = {**extra, "destination": dst, "files": staged,
                   "bytes_on_disk": sum(os.path.getsize(os.path.join(dst, n)) for n in staged)}
        left = list(getattr(strategy, "warnings", ()))  # entries named like ours it left alone
        if left:
            outcome["warnings"] = left + list(extra.get("warnings", ()))
        return outcome

    outcome = comm.on_rank0(commit, what, consequence)
    return {**report, **outcome, "written_here": written, "seconds": round(time.perf_counter() - started, 3)}


def _write_local(tensors, assignment, staging, rank, world, fmt, collective, workers, quiet):
    """Write this rank's shards; with ``collective``, drain the others'. Returns ``(written, error)``;
    with more than one rank an error is caught (the message) so the collectives keep going."""
    by_name = {t.name: t for t in tensors}
    jobs = [(f, [by_name[n] for n in members], r) for (f, members), r in zip(assignment.shards, assignment.ranks)]
    mine = [(f, ts) for f, ts, r in jobs if r == rank]
    total = sum(t.nbytes for _, ts in mine for t in ts)
    write_one = write_bin_shard if fmt == "bin" else write_shard
    written: List[str] = []
    error = None
    desc = "export" if world == 1 else f"export (rank {rank}/{world})"
    with progress_bar(total, desc, quiet or rank != 0) as bar:
        if world == 1 and workers > 1 and len(mine) > 1 and not collective:
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(min(workers, len(mine)))
            try:
                for future in [pool.submit(write_one, os.path.join(staging, f), ts, bar) for f, ts in mine]:
                    future.result()  # the first failure propagates; the strategy removes everything
            finally:  # on a failure or an interrupt, shards not yet started are not written
                pool.shutdown(wait=True, cancel_futures=True)
            return [f for f, _ in mine], None
        for f, ts, r in jobs:
            if r == rank and error is None:
                tracked = _Tracked(ts) if collective else None
                try:
                    write_one(os.path.join(staging, f), tracked.wrapped if tracked else ts, bar)
                    written.append(f)
                except Exception as e:
                    if world == 1:
                        raise
                    text = (f"{e.strerror or e} (errno {e.errno}); check free space, quota and permissions"
                            if isinstance(e, OSError) else failure_message(e))
                    error = f"writing {f}: {text}"
                    if tracked is not None:  # keep up the collective
                        tracked.drain_rest(ts)
            elif collective:
                for t in shard_order(ts):
                    drain(t)
    return written, error


class _Tracked:
    """Remembers how far a shard's tensors were consumed, so a failed writer can keep up the collective."""

    def __init__(self, tensors: Sequence[OutTensor]):
        self.done = set()
        self.current = None  # (name, the iterator of its chunks) while a tensor is being read
        self.wrapped = [OutTensor(t.name, t.dtype, t.shape, self._chunks(t)) for t in tensors]

    def _chunks(self, t):
        def gen():
            it = iter(t.chunks())
            self.current = (t.name, it)
            # Not ``yield from``: when the writer fails, this generator is closed, and ``yield from``
            # would close ``it`` too, before drain_rest could finish the tensor's collective.
            for chunk in it:
                yield chunk
            self.current = None
            self.done.add(t.name)
        return gen

    def drain_rest(self, tensors):
        if self.current is not None:  # the tensor the failure interrupted: finish its collective
            name, rest = self.current
            for _ in rest:
                pass
            self.done.add(name)
        for t in shard_order(tensors):
            if t.name not in self.done:
                drain(t)


def drain(t: OutTensor) -> None:
    """Take part in ``t``'s collective without keeping its bytes."""
    quiet = getattr(t, "drain", None)
    if quiet is not None:
        quiet()
    else:
        for _ in t.chunks():
            pass


def write_bin_shard(path, tensors: Sequence[OutTensor], progress=None) -> int:
    """``torch.save`` of one shard, each tensor owning exactly its bytes (one shard in memory, never
    a view of a flat buffer, whose whole storage torch.save would write); fsynced. Returns the tensor bytes written."""
    import torch

    from .formats.dtypes import to_torch

    shard = {}
    for t in shard_order(tensors):
        buf = bytearray(t.nbytes)
        view, pos = memoryview(buf), 0
        for chunk in t.chunks():
            n = len(chunk)
            view[pos:pos + n] = memoryview(chunk).cast("B")
            pos += n
        if pos != t.nbytes:
            raise CheckpointError(f"{t.name}: produced {pos} bytes, expected {t.nbytes}; please report this")
        shard[t.name] = (torch.frombuffer(buf, dtype=to_torch(t.dtype)) if t.nbytes else
                         torch.empty(0, dtype=to_torch(t.dtype))).view(t.shape)
    with open_new(path) as fh:
        torch.save(shard, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return sum(t.nbytes for t in tensors)
