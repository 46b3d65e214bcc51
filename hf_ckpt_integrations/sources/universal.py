"""DeepSpeed universal checkpoints (``ds_to_universal`` output) -> :class:`~..plan.ExportPlan`.

Layout: ``<dir>/zero/<param name>/fp32.pt`` holds ``{"param": full fp32 tensor, "cat_dim": ...}``
(DeepSpeed has already merged the tensor-parallel slices and dropped vocabulary padding), next
to ``exp_avg.pt`` / ``exp_avg_sq.pt`` which are never read, and the ``mp_rank_XX_model_states.pt``
files copied from the original save (parameter order, buffers, tied parameters).
"""

import os
from typing import Optional

from .. import safe_load
from ..errors import CheckpointError, LayoutError
from ..plan import ExportPlan, Piece, TensorPlan

__all__ = ["is_universal_dir", "build_plan"]


def is_universal_dir(path: str) -> bool:
    zero = os.path.join(path, "zero")
    try:
        return any(os.path.isfile(os.path.join(zero, n, "fp32.pt")) for n in os.listdir(zero))
    except OSError:
        return False


def build_plan(path: str, *, config_dir: Optional[str] = None) -> ExportPlan:
    path = os.path.abspath(path)
    zero = os.path.join(path, "zero")
    names = sorted(n for n in os.listdir(zero) if os.path.isfile(os.path.join(zero, n, "fp32.pt")))
    order, buffers, shared = [], {}, {}
    model_states = os.path.join(path, "mp_rank_00_model_states.pt")
    if os.path.isfile(model_states):
        meta = safe_load.load(model_states)
        module = meta.get("module") or {}
        order = [n for n in module if n in names]
        shared = {str(k): str(v) for k, v in (meta.get("shared_params") or {}).items()}
        for n in meta.get("buffer_names") or []:
            if isinstance(module.get(n), safe_load.TensorRef):
                buffers[n] = module[n]
    order += [n for n in names if n not in order]
    tensors = []
    for name in order:
        f = os.path.join(zero, name, "fp32.pt")
        obj = safe_load.load(f)
        ref = obj.get("param") if isinstance(obj, dict) else None
        if not isinstance(ref, safe_load.TensorRef):
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
    return ExportPlan(engine="deepspeed-universal", source=path, tag=os.path.basename(path), stage=None, dp_size=1,
                      mp_size=1, mp_axis="none", tensors=tensors,
                      aliases={a: t for a, t in shared.items() if a not in names}, dtypes={"master": "F32"},
                      config_dir=config_dir, files=files,
                      notes=["universal checkpoint: tensors already merged by ds_to_universal"])
