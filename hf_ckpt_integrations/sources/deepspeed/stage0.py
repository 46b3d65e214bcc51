"""No ZeRO (stage 0): the weights are whole in ``mp_rank_MM_model_states.pt``'s ``module``.

Without ZeRO, ``engine.save_checkpoint`` writes no ``*_optim_states.pt`` for a plain torch
optimizer: data-parallel rank 0 of each model-parallel rank writes the module state dict (every
parameter and persistent buffer, whole) and the optimizer's own state dict under ``optimizer``;
``param_shapes`` and ``shared_params`` are recorded as None. Trained in fp32, the module
weights are the fp32 weights the optimizer steps: they are exported as they are. A 16-bit
module (fp16, or bf16 under DeepSpeed's ``FP16_Optimizer``/``FP16_UnfusedOptimizer``) keeps
its fp32 masters in the optimizer's state, per parameter group and without names: that layout
is refused by name (what the file records) unless the export asks for the module's own dtype
(``--dtype bf16``/``fp16``), which the module weights are exactly.

Tied parameters have no ``shared_params`` record here: the module state dict holds them under
every name, as views of one storage, which is how they are recognised (:func:`tied_names`).
"""

from collections import OrderedDict
from typing import Dict

from ...errors import LayoutError
from ...formats.dtypes import to_user
from ...formats.torch_files import TensorRef
from ...plan import TensorPlan
from .fields import tensor_pieces

__all__ = ["plan_stage0", "tied_names", "optimizer_kind"]


def optimizer_kind(model) -> str:
    """What wrapped the optimizer of a stage-0 save, as the model-states file records it: the
    keys of its ``optimizer`` state (``fp32_groups``: FP16_UnfusedOptimizer, ``fp32_groups_flat``:
    FP16_Optimizer, ``single_partition_of_fp32_groups``: BF16_Optimizer), else a plain torch
    optimizer (``state`` + ``param_groups``), or ``none`` when no optimizer was saved."""
    opt = model.get("optimizer")
    if not isinstance(opt, dict):
        return "none"
    if "single_partition_of_fp32_groups" in opt:
        return "BF16_Optimizer"
    if "fp32_groups_flat" in opt:
        return "FP16_Optimizer"
    if "fp32_groups" in opt:
        return "FP16_UnfusedOptimizer"
    return "torch optimizer"


def tied_names(module: Dict[str, object]) -> Dict[str, str]:
    """``{alias: stored name}`` for module entries that are views of the same bytes (tied
    parameters, saved under each name); the first name in state-dict order is the stored one,
    as ``named_parameters`` reports it and DeepSpeed's ``shared_params`` records it."""
    first: Dict[tuple, str] = {}
    out: Dict[str, str] = OrderedDict()
    for name, ref in module.items():
        if not isinstance(ref, TensorRef):
            continue
        key = (ref.path, ref.storage.key, ref.storage_offset, tuple(ref.shape), tuple(ref.stride))
        if key in first:
            out[name] = first[key]
        else:
            first[key] = name
    return out


def plan_stage0(model, model_path, module, buffer_names, tensors, out_dtype, what) -> Dict[str, str]:
    """Fill ``tensors`` with the module's weights (fp32: the weights the optimizer stepped) and
    return the tied aliases. ``what``: the checkpoint as the files record it, for messages.
    Raises :class:`LayoutError` for a 16-bit module whose fp32 masters sit in an unnamed
    optimizer state (exporting the 16-bit copy as if it were the trained fp32 weights would be
    silently lossy)."""
    aliases = tied_names(module)
    params = {n: r for n, r in module.items() if isinstance(r, TensorRef) and n not in aliases
              and n not in buffer_names}
    dtypes = {r.dtype for r in params.values()}
    if dtypes - {"F32"} and not (len(dtypes) == 1 and out_dtype in dtypes):
        kind = optimizer_kind(model)
        raise LayoutError(f"{model_path}: {what}: the module weights are {'/'.join(sorted(dtypes))} and the fp32 "
                          f"masters are in the {kind}'s state, per parameter group and without names; reading "
                          f"them is not supported yet: pass --dtype {to_user(dtypes.pop()) if len(dtypes) == 1 else 'bf16'} "
                          "to export the module weights the engine holds, exactly as saved")
    kind = "master" if dtypes <= {"F32"} else "module"
    for name, ref in params.items():
        tensors[name] = TensorPlan(name, ref.shape, ref.dtype, [[tensor_pieces(ref, 0, ref.numel)]], kind=kind)
    return aliases
