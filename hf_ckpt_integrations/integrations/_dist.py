"""Save-time writes: every rank of the job writes HF weights into a checkpoint directory.

:func:`write_distributed` is the save-time front end of the one writer
(:func:`~..orchestrator.write`, whose module doc gives the call order and which ranks make each
call) with the :class:`~..commit.MergeIntoCheckpoint` strategy: shards are staged in
``dst/.hfckpt-tmp-weights/`` and merged into ``dst`` (a checkpoint directory that keeps its other
files) only when every rank succeeded; otherwise every rank raises the same
:class:`~..orchestrator.WriteError` (``SaveError``) naming each failed rank.

Ranks come from ``torch.distributed`` when it is initialised, never from Accelerate's state
(which on a CPU-only DeepSpeed launch reports one process on every rank).
"""

import os
from typing import Callable, List, Optional, Sequence

from ..commit import STAGING_NAME, MergeIntoCheckpoint
from ..formats.names import SAVED_WEIGHTS_RE
from ..formats.safetensors import floating_dtypes
from ..orchestrator import Assignment, WriteError, default_comm, write
from ..writer import MAX_SHARD_SIZE, OutTensor, copy_config_files

__all__ = ["SaveError", "rank_world", "barrier", "all_ranks_ok", "broadcast_from_0", "write_distributed",
           "existing_weights", "existing_weights_dtype", "remove_weights", "consolidate_checkpoint", "STAGING_NAME",
           "write_config_on_rank0"]

_SAVE_CONSEQUENCE = "the destination was left without the new weights: fix the cause and save again"


# The old name of the one failure type (``failures``: rank -> message).
SaveError = WriteError


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
    """Exchange this rank's error (or ``None``); raise :class:`~..orchestrator.WriteError` on every rank
    if any failed."""
    text = None if error is None else f"{context}{type(error).__name__}: {error}"
    dist = _dist()
    if dist:
        gathered: List[Optional[str]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, text)
    else:
        gathered = [text]
    failures = {r: t for r, t in enumerate(gathered) if t is not None}
    if failures:
        raise WriteError(what, failures, _SAVE_CONSEQUENCE) from error


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


def _holds_plan_dtypes(directory, plan) -> bool:
    """True when ``directory`` already holds safetensors weights with every tensor of ``plan`` in its
    decided output dtype (the Trainer's own save, written in the target dtype)."""
    from ..formats.safetensors import read_hf_dir

    names = existing_weights(directory)
    if not names or not all(n.endswith((".safetensors", ".json")) for n in names):
        return False
    held = {name: entry[1] for name, entry in read_hf_dir(directory).items()}
    return all(held.get(t.name) == t.out_dtype for t in plan.tensors)


def remove_weights(directory) -> None:
    for n in existing_weights(directory):
        os.remove(os.path.join(directory, n))


def write_distributed(tensors: Sequence[OutTensor], dst, *, max_shard_size=MAX_SHARD_SIZE,
                      collective: bool = False, config_dir: Optional[str] = None,
                      replace_existing: bool = True, what: str = "HF export", fmt: str = "safetensors",
                      bind: Optional[Callable[[Assignment], Sequence[OutTensor]]] = None) -> dict:
    """Write ``tensors`` as HF weights into the existing-or-new directory ``dst`` (see module doc).

    Called by every rank with the same ``tensors`` (names, sizes, order): writer tensors, or a live
    source's plan (:class:`~..plan.TensorPlan` with :class:`~..plan.LivePiece`\ s, whose reads the
    writer calls with each tensor's writing rank). ``bind(assignment)``, when given, returns the
    tensors to write once the writer has assigned shards to ranks. With ``collective`` (reading a
    tensor is a collective) ranks that do not write a shard ``drain()`` its tensors. Existing
    weight files in ``dst`` are replaced as a set only after every rank has written its shards
    (``replace_existing``); other files are kept. Returns ``{"files": [shard names], "tensor_bytes":
    n, "written_here": [...], "sharded": bool, "shards_by_rank": {...}}``. Raises
    :class:`~..orchestrator.WriteError` on every rank when any rank failed.
    """
    def finish(staging, tensors):
        return {"config_files": copy_config_files(config_dir, staging, tensors=tensors)}

    report = write(tensors, MergeIntoCheckpoint(dst, replace_existing=replace_existing), comm=default_comm(),
                   max_shard_size=max_shard_size, fmt=fmt, collective=collective, bind=bind,
                   finish=finish if config_dir else None, what=what, consequence=_SAVE_CONSEQUENCE)
    return {"files": report["shard_files"], "tensor_bytes": report["tensor_bytes"],
            "written_here": report["written_here"], "sharded": report["sharded"],
            "shards_by_rank": report["shards_by_rank"]}


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
    ``"bf16"``, ``"fp16"``. ``existing``: ``"auto"`` keeps weights already there when each of their
    tensors has the dtype the export would write (:mod:`..dtype_rule`), ``"replace"`` always
    rewrites them. Returns ``{"action": "kept"|"written", ...}``.
    Raises :class:`SaveError` on every rank when any rank failed (plan refused, disk full, ...).
    """
    if existing not in ("auto", "replace"):
        raise ValueError(f"existing={existing!r}; use 'auto' or 'replace'")
    from ..mapped_files import MappedFiles
    from ..sources import build_plan
    from ..writer import plan_tensors

    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    what = what or f"consolidating {checkpoint_dir}"
    # The plan is built once, on rank 0, from the files every rank sees; the others receive it. Its
    # output dtypes (the one rule, fp32-kept modules included) say whether the weights there will do.
    plan, decision, error = None, None, None
    if rank_world()[0] == 0:
        try:
            plan = build_plan(checkpoint_dir, tag=tag, dtype=dtype, config=config)
            decision = "keep" if existing == "auto" and _holds_plan_dtypes(checkpoint_dir, plan) else "write"
        except Exception as e:
            error = e
    all_ranks_ok(error, f"{what}: planning")
    plan, decision = broadcast_from_0((plan, decision))
    if decision == "keep":
        return {"action": "kept", "files": existing_weights(checkpoint_dir)}
    with MappedFiles() as files:
        tensors = plan_tensors(plan, dtype, files, ranges=True)
        report = write_distributed(tensors, checkpoint_dir, max_shard_size=max_shard_size,
                                   config_dir=plan.config_dir, replace_existing=True, what=what)
    return {"action": "written", **report}
