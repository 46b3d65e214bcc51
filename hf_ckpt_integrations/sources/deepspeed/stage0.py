"""No ZeRO (stage 0): the weights are whole in ``mp_rank_MM_model_states.pt``'s ``module``.

Without ZeRO, ``engine.save_checkpoint`` writes no ``*_optim_states.pt`` for a plain torch
optimizer: data-parallel rank 0 of each model-parallel rank writes the module state dict (every
parameter and persistent buffer, whole) and the optimizer's own state dict under ``optimizer``;
``param_shapes`` and ``shared_params`` are recorded as None. Trained in fp32, the module
weights are the fp32 weights the optimizer steps: they are exported as they are. A 16-bit
module (fp16, or bf16 under DeepSpeed's ``FP16_Optimizer``/``FP16_UnfusedOptimizer``) keeps
its fp32 masters in the optimizer's state, per parameter group and without names: the plan holds
the 16-bit weights (``inspect`` and ``verify`` read them) and records why an export in another
dtype is refused (``detail["dtype_required"]``, checked by the export front end): only the module's
own dtype (``--dtype bf16``/``fp16``) is what the engine holds, exactly.

Tied parameters have no ``shared_params`` record here: the module state dict holds them under
every name, as views of one storage, which is how they are recognised (:func:`tied_names`).
"""

from collections import OrderedDict
from typing import Any, Collection, Dict, Mapping, Optional, Tuple

from ...formats.dtypes import to_user
from ...formats.torch_files import TensorRef
from ...plan import TensorPlan
from .fields import tensor_pieces

__all__ = ["plan_stage0", "masters_unread", "tied_names", "optimizer_kind"]


def optimizer_kind(model: Mapping[str, Any]) -> str:
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


def plan_stage0(model: Mapping[str, Any], model_path: str, module: Dict[str, Any], buffer_names: Collection[str],
                tensors: Dict[str, TensorPlan], what: str) -> Dict[str, str]:
    """Fill ``tensors`` with the module's weights and return the tied aliases. In fp32 they are the
    weights the optimizer stepped (kind ``master``). A 16-bit module's fp32 masters sit in an
    unnamed optimizer state: its weights are planned as what they are (kind ``module``) and
    :func:`masters_unread` says why a default (fp32) export must not pass them off as the masters.
    ``what``: the checkpoint as the files record it, for messages."""
    aliases = tied_names(module)
    params = {n: r for n, r in module.items() if isinstance(r, TensorRef) and n not in aliases
              and n not in buffer_names}
    kind = "master" if all(r.dtype == "F32" for r in params.values()) else "module"
    for name, ref in params.items():
        tensors[name] = TensorPlan(name, ref.shape, ref.dtype, [[tensor_pieces(ref, 0, ref.numel)]], kind=kind)
    return aliases


def masters_unread(model: Mapping[str, Any], model_path: str, tensors: Mapping[str, TensorPlan],
                   what: str) -> Optional[Tuple[Optional[str], str]]:
    """``(dtype, reason)`` when the parameters :func:`plan_stage0` planned (``tensors``) are 16-bit
    module weights (their fp32 masters unread): an export in ``dtype`` (theirs) writes them exactly
    as the engine holds them; any other is refused with ``reason`` (``dtype`` None: every one is).
    None for an fp32 module."""
    dtypes = {t.src_dtype for t in tensors.values() if t.kind == "module"}
    if not dtypes:
        return None
    only = to_user(dtypes.pop()) if len(dtypes) == 1 else None
    how = (f"pass --dtype {only} to export the module weights the engine holds, exactly as saved" if only else
           "no single dtype holds them all: not supported yet")
    return only, (f"{model_path}: {what}: the module weights are 16-bit and the fp32 masters are in the "
                  f"{optimizer_kind(model)}'s state, per parameter group and without names; reading them is "
                  f"not supported yet: {how}")
