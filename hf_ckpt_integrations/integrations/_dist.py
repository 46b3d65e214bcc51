"""Save-time writes: every rank of the job writes HF weights into a checkpoint directory.

:func:`write_distributed` is the save-time front end of the one writer
(:func:`~..orchestrator.write`, whose module doc gives the call order and which ranks make each
call) with the :class:`~..commit.MergeIntoCheckpoint` strategy: shards are staged in
``dst/.hfckpt-tmp-weights/`` and merged into ``dst`` (a checkpoint directory that keeps its other
files) only when every rank succeeded; otherwise every rank raises the same
:class:`~..comm.WriteError` naming each failed rank. Every collective goes through
:mod:`..comm` (``default_comm()``: ranks from ``torch.distributed`` when it is initialised).
"""

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple, Union

from ..comm import default_comm
from ..commit import STAGING_NAME, MergeIntoCheckpoint, weight_files as existing_weights
from ..formats.config import write_config
from ..formats.safetensors import floating_dtypes
from ..guards import StrPath
from ..orchestrator import write
from ..plan import ExportPlan
from ..writer import MAX_SHARD_SIZE

if TYPE_CHECKING:
    import torch

    from ..formats.out_tensor import OutTensor
    from ..mapped_files import MappedFiles

__all__ = ["write_distributed", "existing_weights", "existing_weights_dtype", "consolidate_checkpoint", "consolidate",
           "STAGING_NAME", "write_config_on_rank0", "SAVE_CONSEQUENCE"]

# What a failed save-time write leaves (every WriteError of the hooks says it).
SAVE_CONSEQUENCE = "the destination was left without the new weights: fix the cause and save again"


def existing_weights_dtype(directory: StrPath) -> Optional[str]:
    """The safetensors dtype of the floating tensors already saved in ``directory`` (one dtype),
    else ``None`` (no safetensors weights, or mixed)."""
    names = [n for n in existing_weights(directory) if n.endswith(".safetensors")]
    if not names:
        return None
    dtypes = floating_dtypes(os.path.join(directory, n) for n in names)
    return dtypes.pop() if len(dtypes) == 1 else None


def _holds_plan_dtypes(directory: StrPath, plan: ExportPlan) -> bool:
    """True when ``directory`` already holds safetensors weights with every tensor of ``plan`` in its
    decided output dtype (the Trainer's own save, written in the target dtype)."""
    from ..formats.safetensors import read_hf_dir

    names = existing_weights(directory)
    if not names or not all(n.endswith((".safetensors", ".json")) for n in names):
        return False
    held = {name: entry[1] for name, entry in read_hf_dir(directory).items()}
    return all(held.get(t.name) == t.out_dtype for t in plan.tensors)


def write_distributed(plan: ExportPlan, dst: StrPath, *, max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE,
                      collective: bool = False, config_dir: Optional[str] = None,
                      replace_existing: bool = True, what: str = "HF export", fmt: str = "safetensors",
                      files: "Optional[MappedFiles]" = None) -> Dict[str, Any]:
    """Write the tensors of ``plan`` as HF weights into the existing-or-new directory ``dst`` (see
    module doc).

    Called by every rank with the same plan (names, sizes, order; output dtypes decided): an offline
    source's (read through ``files``), or a live source's (:class:`~..plan.LivePiece` objects, whose
    reads the writer calls with each tensor's writing rank). With ``collective`` (reading a
    tensor is a collective) ranks that do not write a shard ``drain()`` its tensors. Existing
    weight files in ``dst`` are replaced as a set only after every rank has written its shards
    (``replace_existing``); other files are kept. Returns ``{"files": [shard names], "tensor_bytes":
    n, "written_here": [...], "sharded": bool, "shards_by_rank": {...}}``. Raises
    :class:`~..comm.WriteError` on every rank when any rank failed.
    """
    def finish(staging: str, tensors: "Sequence[OutTensor]") -> Dict[str, Any]:
        return {"config_files": write_config(staging, config_dir=config_dir, tensor_dtypes=[t.dtype for t in tensors])}

    report = write(plan, MergeIntoCheckpoint(dst, replace_existing=replace_existing), comm=default_comm(),
                   files=files, max_shard_size=max_shard_size, fmt=fmt, collective=collective,
                   finish=finish if config_dir else None, what=what, consequence=SAVE_CONSEQUENCE)
    return {"files": report["shard_files"], "tensor_bytes": report["tensor_bytes"],
            "written_here": report["written_here"], "sharded": report["sharded"],
            "shards_by_rank": report["shards_by_rank"]}


def write_config_on_rank0(module: "torch.nn.Module", directory: str, plan: Optional[ExportPlan] = None, *,
                          keep_existing: bool = False) -> None:
    """Rank 0 writes config.json (with the output dtype of ``plan``'s tensors, as save_pretrained records it); a
    failure there raises on every rank. ``keep_existing``: rank 0 leaves a config.json already there
    (only rank 0 looks: every rank takes part in the collective whatever it finds). Collective."""
    def write_it() -> None:
        if not (keep_existing and os.path.isfile(os.path.join(directory, "config.json"))):
            write_config(directory, model=module,  # (dtypes decided: the writer's plan)
                         tensor_dtypes=[t.out_dtype for t in plan.tensors if t.out_dtype is not None] if plan else [])

    default_comm().on_rank0(write_it, f"writing config.json into {directory}", SAVE_CONSEQUENCE)


def consolidate(checkpoint_dir: StrPath, dst: StrPath, *, what: str, tag: Optional[str] = None,
                dtype: Optional[str] = None, config: Optional[str] = None,
                check: Optional[Callable[[ExportPlan], object]] = None,
                max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE,
                replace_existing: bool = True, fmt: str = "safetensors", copy_config: bool = True,
                keep: Optional[Callable[[ExportPlan], bool]] = None) -> Optional[Dict[str, Any]]:
    """Write into ``dst`` the export of the engine checkpoint in ``checkpoint_dir``. Collective.

    The plan is built once, on rank 0, from the files every rank sees, where ``check(plan)`` may
    refuse it (raise) and ``keep(plan)``, when given, may say that what ``dst`` holds already will
    do; every rank receives both and, unless kept, writes its shards (:func:`write_distributed`; the
    plan's config files copied when ``copy_config``). Returns :func:`write_distributed`'s report, or
    ``None`` when kept (nothing written). Raises the same :class:`~..comm.WriteError` on every rank
    when any rank failed (with one process: the error itself)."""
    from ..mapped_files import MappedFiles
    from ..sources import build_plan
    from ..writer import decided

    def plan_it() -> Tuple[ExportPlan, bool]:
        plan = build_plan(checkpoint_dir, tag=tag, dtype=dtype, config=config)
        if check is not None:
            check(plan)
        return plan, bool(keep is not None and keep(plan))

    plan, kept = default_comm().on_rank0(plan_it, f"{what}: planning", SAVE_CONSEQUENCE)
    if kept:
        return None
    with MappedFiles() as files:
        return write_distributed(decided(plan, dtype), dst, max_shard_size=max_shard_size,
                                 config_dir=plan.config_dir if copy_config else None,
                                 replace_existing=replace_existing, what=what, fmt=fmt, files=files)


def consolidate_checkpoint(checkpoint_dir: StrPath, *, tag: Optional[str] = None, dtype: Optional[str] = None,
                           max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE, existing: str = "auto",
                           config: Optional[str] = None, what: Optional[str] = None) -> Dict[str, Any]:
    """Write HF weights into ``checkpoint_dir`` from the DeepSpeed checkpoint it holds. Collective.

    Every rank calls it (or a single process without ``torch.distributed``); the directory must be
    on a filesystem all ranks see. ``dtype``: ``None`` (fp32 masters when present), ``"fp32"``,
    ``"bf16"``, ``"fp16"``. ``existing``: ``"auto"`` keeps weights already there when each of their
    tensors has the dtype the export would write (:mod:`..dtype_rule`), ``"replace"`` always
    rewrites them. Returns ``{"action": "kept"|"written", ...}``.
    Raises :class:`~..comm.WriteError` on every rank when any rank failed (plan refused, disk full,
    ...); with one process, the error itself.
    """
    if existing not in ("auto", "replace"):
        raise ValueError(f"existing={existing!r}; use 'auto' or 'replace'")
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    what = what or f"consolidating {checkpoint_dir}"
    # The plan's output dtypes (the one rule, fp32-kept modules included) say, on rank 0, whether
    # the weights there will do.
    keep = (lambda plan: _holds_plan_dtypes(checkpoint_dir, plan)) if existing == "auto" else None
    report = consolidate(checkpoint_dir, checkpoint_dir, what=what, tag=tag, dtype=dtype, config=config,
                         max_shard_size=max_shard_size, keep=keep)
    if report is None:
        return {"action": "kept", "files": existing_weights(checkpoint_dir)}
    return {"action": "written", **report}
