"""Write a list of :class:`~..writer.OutTensor` as an HF directory from every rank of a process group.

Call order (every rank makes every call, in the same order; see :func:`write_distributed`):

1. every rank builds the same tensor list (same names, shapes, dtypes, order);
2. :func:`write_distributed` splits it into shards; shard ``i`` is written by rank
   ``i % world_size`` into a staging directory inside the destination; with ``collective=True``
   the other ranks walk the same tensors in :func:`~..writer.shard_order` and drop the bytes
   (a live ZeRO-3 gather is a collective);
3. the ranks exchange their failures; if any rank failed, every rank raises :class:`SaveError`
   naming each failed rank and its error, and the staging directory is removed;
4. rank 0 moves the shards into place, writes the index and config, and every rank waits for it.

Ranks come from ``torch.distributed`` when it is initialised, never from Accelerate's state
(which on a CPU-only DeepSpeed launch reports one process on every rank).
"""

import os
import shutil
from typing import Dict, List, Optional, Sequence

from ..errors import CheckpointError
from ..formats.dtypes import from_user as dtype_from_name, to_torch as torch_dtype
from ..formats.names import BIN_INDEX as BIN_INDEX_NAME, BIN_PATTERN, SAVED_WEIGHTS_RE, split_shards as _split_names
from ..formats.safetensors import floating_dtypes
from ..writer import (INDEX_NAME, MAX_SHARD_SIZE, OutTensor, copy_config_files, fsync_dir, shard_order,
                      split_shards, write_index, write_shard)

__all__ = ["SaveError", "rank_world", "barrier", "all_ranks_ok", "broadcast_from_0", "write_distributed",
           "existing_weights", "existing_weights_dtype", "remove_weights", "consolidate_checkpoint", "STAGING_NAME",
           "split_files"]

STAGING_NAME = ".hfckpt-tmp-weights"


class SaveError(CheckpointError):
    """A save-time export failed on one or more ranks; raised on every rank.

    ``failures`` maps each failed rank to its error text. Nothing was moved into the destination.
    """

    def __init__(self, what: str, failures: Dict[int, str]):
        self.failures = dict(failures)
        lines = "; ".join(f"rank {r}: {e}" for r, e in sorted(self.failures.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(self.failures)} — {lines}; the destination was "
                         "left without the new weights: fix the cause and save again")


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world():
    """``(rank, world_size)`` of the default ``torch.distributed`` group, ``(0, 1)`` without one."""
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def barrier():
    dist = _dist()
    if dist:
        dist.barrier()


def broadcast_from_0(obj):
    """Rank 0's ``obj`` on every rank (so that all ranks take the same decision)."""
    dist = _dist()
    if not dist:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ranks_ok(error: Optional[BaseException], what: str, context: str = "") -> None:
    """Exchange this rank's error (or ``None``); raise :class:`SaveError` on every rank if any failed."""
    text = None if error is None else f"{context}{type(error).__name__}: {error}"
    dist = _dist()
    if dist:
        gathered: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, text)
    else:
        gathered = [text]
    failures = {r: t for r, t in enumerate(gathered) if t is not None}
    if failures:
        raise SaveError(what, failures) from error


def existing_weights(directory) -> List[str]:
    try:
        return sorted(n for n in os.listdir(directory) if SAVED_WEIGHTS_RE.match(n))  # replaced as a whole
    except FileNotFoundError:
        return []


def existing_weights_dtype(directory) -> Optional[str]:
    """The safetensors dtype of the floating tensors already saved in ``directory`` (one dtype),
    else ``None`` (no safetensors weights, or mixed)."""
    names = [n for n in existing_weights(directory) if n.endswith(".safetensors")]
    if not names:
        return None
    dtypes = floating_dtypes(os.path.join(directory, n) for n in names)
    return dtypes.pop() if len(dtypes) == 1 else None


def remove_weights(directory) -> None:
    for n in existing_weights(directory):
        os.remove(os.path.join(directory, n))


class _Tracked:
    """Remembers how far a shard's tensors were consumed, so a failed writer can keep up the collective."""

    def __init__(self, tensors: Sequence[OutTensor]):
        self.done = set()
        self.current = None
        self.wrapped = [OutTensor(t.name, t.dtype, t.shape, self._chunks(t)) for t in tensors]
        self.by_name = {t.name: t for t in tensors}

    def _chunks(self, t):
        def gen():
            self.current = iter(t.chunks())
            yield from self.current
            self.current = None
            self.done.add(t.name)
        return gen

    def drain_rest(self, tensors):
        if self.current is not None:
            for _ in self.current:
                pass
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


def write_distributed(tensors: Sequence[OutTensor], dst, *, max_shard_size=MAX_SHARD_SIZE,
                      collective: bool = False, config_dir: Optional[str] = None,
                      replace_existing: bool = True, what: str = "HF export", fmt: str = "safetensors",
                      one_file: Optional[str] = None) -> dict:
    """Write ``tensors`` as HF weights into the existing-or-new directory ``dst`` (see module doc).

    Called by every rank with the same ``tensors``. Existing weight files in ``dst`` are removed
    only after every rank has written its shards (``replace_existing``); other files are kept.
    Returns ``{"files": [...], "tensor_bytes": n, "written_here": [...]}``. Raises
    :class:`SaveError` on every rank when any rank failed. ``one_file``: write all ``tensors`` into
    that one file (a PEFT adapter's ``adapter_model.safetensors``) instead of ``model*.safetensors``.
    """
    rank, world = rank_world()
    dst = os.path.abspath(os.fspath(dst))
    staging = os.path.join(dst, STAGING_NAME)
    if fmt not in ("safetensors", "bin"):
        raise ValueError(f"fmt={fmt!r}; use 'safetensors' or 'bin'")
    if one_file is not None:
        from types import SimpleNamespace

        split = SimpleNamespace(filename_to_tensors={one_file: [t.name for t in tensors]}, is_sharded=False)
    else:
        split = split_files(tensors, max_shard_size, fmt)
    by_name = {t.name: t for t in tensors}
    error = None
    if rank == 0:
        try:
            os.makedirs(dst, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            os.mkdir(staging)
        except OSError as e:
            error = e
    all_ranks_ok(error, f"{what}: creating {staging}")

    written, context = [], ""
    for i, (filename, names) in enumerate(split.filename_to_tensors.items()):
        shard = [by_name[n] for n in names]
        if i % world == rank and error is None:
            tracked = _Tracked(shard)
            try:
                _write_one(os.path.join(staging, filename), tracked.wrapped, fmt)
                written.append(filename)
            except Exception as e:  # keep up the collective, report below
                error, context = e, f"writing {filename}: "
                if collective:
                    tracked.drain_rest(shard)
        elif collective:
            for t in shard_order(shard):
                drain(t)
    try:
        all_ranks_ok(error, f"{what}: writing shards into {staging}", context)
    except SaveError:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise

    error = None
    if rank == 0:
        try:
            _commit(staging, dst, split, tensors, config_dir, replace_existing, fmt)
        except Exception as e:
            error = e
            shutil.rmtree(staging, ignore_errors=True)
    all_ranks_ok(error, f"{what}: moving the shards into {dst}")
    return {"files": sorted(split.filename_to_tensors), "tensor_bytes": sum(t.nbytes for t in tensors),
            "written_here": written, "sharded": split.is_sharded}


def split_files(tensors, max_shard_size, fmt):
    """The shard split :func:`write_distributed` makes (``fmt``: "safetensors" or "bin")."""
    if fmt == "safetensors":
        return split_shards(list(tensors), max_shard_size)
    return _split_names({t.name: t for t in tensors}, lambda t: t.nbytes, max_shard_size=max_shard_size,
                        pattern=BIN_PATTERN)


def _write_one(path, tensors, fmt):
    if fmt == "safetensors":
        return write_shard(path, tensors)
    # torch.save writes whole storages: give each tensor a storage of exactly its own bytes
    # (one shard in memory, never a view of a flat buffer — seed 002).
    import torch

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
        shard[t.name] = (torch.frombuffer(buf, dtype=torch_dtype(t.dtype)) if t.nbytes else
                         torch.empty(0, dtype=torch_dtype(t.dtype))).view(t.shape)
    with open(path, "wb") as fh:
        torch.save(shard, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _commit(staging, dst, split, tensors, config_dir, replace_existing, fmt="safetensors"):
    index_name = INDEX_NAME if fmt == "safetensors" else BIN_INDEX_NAME
    if split.is_sharded:
        write_index(staging, split, tensors)
        if fmt != "safetensors":
            os.replace(os.path.join(staging, INDEX_NAME), os.path.join(staging, index_name))
    fsync_dir(staging)
    if replace_existing:
        remove_weights(dst)
    # Shards first, index last: an interrupted move never leaves an index naming missing files.
    names = sorted(split.filename_to_tensors)
    for n in names:
        os.replace(os.path.join(staging, n), os.path.join(dst, n))
    if split.is_sharded:
        os.replace(os.path.join(staging, index_name), os.path.join(dst, index_name))
    if config_dir:
        copy_config_files(config_dir, dst, tensors=tensors)
    shutil.rmtree(staging, ignore_errors=True)
    fsync_dir(dst)


def write_config_on_rank0(module, directory, tensors=None, *, keep_existing: bool = False) -> None:
    """Rank 0 writes config.json (with the dtype of ``tensors``, as save_pretrained records it); a
    failure there raises on every rank. ``keep_existing``: rank 0 leaves a config.json already there
    (only rank 0 looks: every rank takes part in the collective whatever it finds). Collective."""
    from ..formats.config import write_config

    error = None
    if rank_world()[0] == 0 and not (keep_existing and os.path.isfile(os.path.join(directory, "config.json"))):
        try:
            write_config(directory, model=module, tensor_dtypes=[t.dtype for t in tensors or ()])
        except Exception as e:
            error = e
    all_ranks_ok(error, f"writing config.json into {directory}")


def consolidate_checkpoint(checkpoint_dir, *, tag: Optional[str] = None, dtype: Optional[str] = None,
                           max_shard_size=MAX_SHARD_SIZE, existing: str = "auto", config: Optional[str] = None,
                           what: Optional[str] = None) -> dict:
    """Write HF weights into ``checkpoint_dir`` from the DeepSpeed checkpoint it holds. Collective.

    Every rank calls it (or a single process without ``torch.distributed``); the directory must be
    on a filesystem all ranks see. ``dtype``: ``None`` (fp32 masters when present), ``"fp32"``,
    ``"bf16"``, ``"fp16"``. ``existing``: ``"auto"`` keeps weights already there when their dtype is
    the target dtype, ``"replace"`` always rewrites them. Returns ``{"action": "kept"|"written", ...}``.
    Raises :class:`SaveError` on every rank when any rank failed (plan refused, disk full, ...).
    """
    if existing not in ("auto", "replace"):
        raise ValueError(f"existing={existing!r}; use 'auto' or 'replace'")
    from ..safe_load import MappedFiles
    from ..sources import build_plan
    from ..writer import plan_tensors

    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    what = what or f"consolidating {checkpoint_dir}"
    target = dtype_from_name(dtype)
    decision, error = None, None
    if rank_world()[0] == 0:
        try:
            decision = "write"
            if existing_weights(checkpoint_dir) and existing == "auto":
                # Without a dtype the export would be the fp32 masters (the plan's default).
                if existing_weights_dtype(checkpoint_dir) == (target or "F32"):
                    decision = "keep"
        except Exception as e:  # reported on every rank below
            error = e
    decision = broadcast_from_0(decision)
    all_ranks_ok(error, what)
    if decision == "keep":
        return {"action": "kept", "files": existing_weights(checkpoint_dir)}

    plan, error = None, None
    try:
        plan = build_plan(checkpoint_dir, tag=tag, dtype=dtype, config=config)
    except Exception as e:
        error = e
    all_ranks_ok(error, f"{what}: planning")
    with MappedFiles() as files:
        tensors = plan_tensors(plan, dtype, files, ranges=True)
        report = write_distributed(tensors, checkpoint_dir, max_shard_size=max_shard_size,
                                   config_dir=plan.config_dir, replace_existing=True, what=what)
    return {"action": "written", **report}
