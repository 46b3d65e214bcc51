"""DeepSpeed universal checkpoints (``ds_to_universal`` output) -> :class:`~..plan.ExportPlan`.

Layout: ``<dir>/zero/<param name>/fp32.pt`` holds ``{"param": full fp32 tensor, "cat_dim": ...}``
(DeepSpeed has already merged the tensor-parallel slices and dropped vocabulary padding), next
to ``exp_avg.pt`` / ``exp_avg_sq.pt`` which are never read, and the ``mp_rank_XX_model_states.pt``
files copied from the original save (parameter order, buffers, tied parameters).
"""

import os
from typing import Any, Dict, List, Mapping, Optional

from .. import guards
from ..errors import CheckpointError, LayoutError
from ..formats.torch_files import TensorRef
from ..plan import ExportPlan, Piece, TensorPlan
from .protocol import PlanContext
from .deepspeed import allowlist as deepspeed_pickles

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "OPTIONS", "detect", "config_candidates", "plan", "is_universal_dir"]

NAME = "deepspeed-universal"
LOOKS_FOR = "a DeepSpeed universal checkpoint (zero/<param>/fp32.pt, from ds_to_universal)"
MEMORY_NAMES = True  # the model's own parameter names: the Hub-layout pass applies
OPTIONS = ()


def is_universal_dir(path: str) -> bool:
    zero = os.path.join(path, "zero")
    try:
        return any(os.path.isfile(os.path.join(zero, n, "fp32.pt")) for n in os.listdir(zero))
    except OSError:
        return False


def _resolve(path: str, tag: Optional[str]) -> Optional[str]:
    """The universal directory: ``path/tag`` when a tag names one, else ``path`` itself."""
    for cand in ([os.path.join(path, tag)] if tag else []) + [path]:
        if is_universal_dir(cand):
            return cand
    return None


def detect(path: str, tag: Optional[str] = None) -> bool:
    return _resolve(path, tag) is not None


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    found = _resolve(path, tag)
    if found is None:  # no universal checkpoint there: none of its places to look
        return []
    d = os.path.abspath(found)
    return [d, os.path.dirname(d), os.path.dirname(os.path.dirname(d))]


def _recorded_parameters(meta: Mapping[str, Any]) -> List[str]:
    """The parameter names the model states record (``param_shapes``: one mapping per parameter group,
    or one mapping; ``frozen_param_shapes``), in order; [] when it records none."""
    groups = meta.get("param_shapes")
    groups = [groups] if isinstance(groups, dict) else groups if isinstance(groups, list) else []
    frozen = meta.get("frozen_param_shapes")
    groups = groups + ([frozen] if isinstance(frozen, dict) else [])
    return [str(n) for g in groups if isinstance(g, dict) for n in g]


def _check_every_parameter(meta: Mapping[str, Any], names: List[str], zero: str) -> None:
    """Every parameter the model states record has its ``zero/<name>/fp32.pt``: one missing (or not a
    regular file) would be left out of the export silently when no config lists the model's tensors."""
    have = set(names)
    missing = [n for n in _recorded_parameters(meta) if n not in have]
    if missing:
        raise CheckpointError(f"{os.path.join(zero, missing[0], 'fp32.pt')}: missing or not a regular file (the model "
                              f"states record {len(missing)} parameter(s) without their zero/<name>/fp32.pt); the "
                              "universal checkpoint is incomplete: convert or copy it again")


def plan(ctx: PlanContext) -> ExportPlan:
    """Plan the export of the universal checkpoint at ``ctx.path`` (or ``path/tag``); the dtype does
    not apply (ds_to_universal merged the slices; the writer casts)."""
    resolved = _resolve(ctx.path, ctx.tag)
    assert resolved is not None, "plan() of a path detect() did not claim"  # the registry asks detect() first
    path = os.path.abspath(resolved)
    zero = os.path.join(path, "zero")
    names = sorted(n for n in os.listdir(zero) if os.path.isfile(os.path.join(zero, n, "fp32.pt")))
    # Each zero/<param>/ entry and the model states belong to this checkpoint: a link leading out of
    # it (a directory of another run's weights) is refused before anything is read.
    guards.check_inside([os.path.join(zero, n, "fp32.pt") for n in names], guards.source_root(ctx.path),
                        what="a zero/<param>/ entry of the universal checkpoint")
    order, buffers, shared = [], {}, {}
    model_states = os.path.join(path, "mp_rank_00_model_states.pt")
    if os.path.isfile(model_states):
        guards.check_inside([model_states], guards.source_root(ctx.path), what="the model states")
        meta = deepspeed_pickles.load(model_states)
        module = meta.get("module") or {}
        _check_every_parameter(meta, names, zero)
        order = [n for n in module if n in names]
        shared = {str(k): str(v) for k, v in (meta.get("shared_params") or {}).items()}
        for n in meta.get("buffer_names") or []:
            if isinstance(module.get(n), TensorRef):
                buffers[n] = module[n]
    order += [n for n in names if n not in order]
    tensors = []
    for name in order:
        f = os.path.join(zero, name, "fp32.pt")
        obj = deepspeed_pickles.load(f)
        ref = obj.get("param") if isinstance(obj, dict) else None
        if not isinstance(ref, TensorRef):
            raise LayoutError(f"{f}: no 'param' tensor; not a ds_to_universal output file, convert again")
        offset, _ = ref.byte_range()
        tensors.append(TensorPlan(name, ref.shape, ref.dtype, [[Piece(f, offset, ref.numel, ref.dtype)]]))
    for name, ref in buffers.items():
        if name not in names:
            offset, _ = ref.byte_range()
            tensors.append(TensorPlan(name, ref.shape, ref.dtype, [[Piece(ref.path, offset, ref.numel, ref.dtype)]],
                                      kind="buffer"))
    if not tensors:
        raise CheckpointError(f"{zero}: no parameters; not a ds_to_universal output directory")
    files = sorted({p.path for t in tensors for part in t.parts for p in part})
    return ExportPlan(engine="deepspeed-universal", source=path, tag=os.path.basename(path), tensors=tensors,
                      aliases={a: t for a, t in shared.items() if a not in names}, dtypes={"master": "F32"},
                      config_dir=ctx.config_dir, files=files,
                      notes=["universal checkpoint: tensors already merged by ds_to_universal"])
