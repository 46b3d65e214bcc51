"""DeepSpeed's ``BF16_Optimizer``: bf16 weights, fp32 masters partitioned over data parallel.

The engine wraps the optimizer in ``BF16_Optimizer`` (``deepspeed/runtime/bf16_optimizer.py``)
for bf16 training with fp32 gradient accumulation (``"data_types": {"grad_accum_dtype": "fp32"}``)
under ZeRO stage 1, and for bf16 pipeline training without ZeRO; older releases also for bf16
with fp32 accumulation at stage 0. Each rank writes ``bf16_zero_pp_rank_D_mp_rank_MM_optim_states.pt``
whose ``optimizer_state_dict`` records no ``zero_stage`` but:

- ``single_partition_of_fp32_groups[i]``: rank D's fp32 partition of parameter group ``i``: the
  group's trainable parameters flattened back to back, padded at the end to a multiple of
  ``2 * dp`` elements, cut into ``dp`` equal partitions; saved *with* its padding (ZeRO-1/2 save
  theirs without);
- ``group_paddings[i]``: that padding, recorded on the last rank only (0 elsewhere);
- ``partition_count[i]``: the group's data-parallel size;
- ``param_slice_mappings[i]``: name -> ``fragment_address(numel, start)`` in this partition.

The parameter order is the model-states file's ``param_shapes`` when ZeRO is on; at stage 0 it
records none, and the order is read from the mappings (rank by rank, each partition's
parameters by offset) with the shapes of the whole bf16 weights in ``module``. Every
placement is checked against the mappings and proven against the bf16 module weights.
"""

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ...errors import LayoutError, short_repr
from ...formats.torch_files import TensorRef
from ...plan import TensorPlan
from . import partitions
from .fields import OptimFile, fragment_address, meta_int, numel, recorded_shape, tensor_pieces
from .partitions import Fragment
from .zero12 import module_copy, prove_places

__all__ = ["is_bf16_optimizer_state", "bf16_fragments", "order_from_mappings", "plan_bf16_optimizer"]

_KEYS = ("single_partition_of_fp32_groups", "partition_count", "param_slice_mappings")


def is_bf16_optimizer_state(osd: Any) -> bool:
    """True for the ``optimizer_state_dict`` of a ``BF16_Optimizer`` (no ``zero_stage``, its own keys)."""
    return isinstance(osd, dict) and "zero_stage" not in osd and all(k in osd for k in _KEYS)


def bf16_fragments(numels: Sequence[int], partition_numel: int, dp: int, padding: int) -> List[List[Fragment]]:
    """Where each parameter of one group lives: ``[(rank, offset in the rank's partition, count)]``
    per parameter. Every saved partition holds ``partition_numel`` elements, the last ones of the
    last rank padding. Raises ``ValueError`` when the numbers do not fit together."""
    if padding < 0 or sum(numels) + padding != dp * partition_numel:
        raise ValueError(f"recorded shapes hold {sum(numels)} elements and {padding} padding, but the {dp} "
                         f"partitions hold {dp} x {partition_numel}")
    # The padding is laid out like one more parameter after the last: the same cut as ZeRO-1/2's.
    return partitions.zero12_fragments(list(numels) + [padding], [partition_numel] * dp, [0] * dp)[:-1]


def order_from_mappings(mappings: List[Dict[str, tuple]]) -> List[str]:
    """The flat order of a group's parameters from each rank's ``{name: (numel, start)}``: rank by
    rank, each partition's parameters by their start; a parameter cut by a partition boundary
    appears once."""
    seen, out = set(), []
    for rec in mappings:
        for name, _ in sorted(rec.items(), key=lambda kv: kv[1][1]):
            if name not in seen:
                seen.add(name)
                out.append(name)
    return out


def plan_bf16_optimizer(ranks: Mapping[int, OptimFile], param_groups: Optional[List[Dict[str, Any]]], model_path: str,
                        tensors: Dict[str, TensorPlan], module: Mapping[str, Any], what: str) -> None:
    """Fill ``tensors`` with the fp32 masters of a ``BF16_Optimizer`` save. ``param_groups``: the
    model-states ``param_shapes`` (None when not recorded, at stage 0); ``module``: the model-states
    module state dict (the bf16 weights, whole); ``what``: the checkpoint as its files record it."""
    dp = len(ranks)
    groups = len(ranks[0].osd["single_partition_of_fp32_groups"])
    for rank_file in ranks.values():
        osd = rank_file.osd
        counts = osd["partition_count"] if isinstance(osd["partition_count"], list) else [osd["partition_count"]]
        counts = [meta_int(c, rank_file.path, "partition_count") for c in counts]
        if any(c != dp for c in counts):
            raise LayoutError(f"{rank_file.path}: {what}: partition_count {counts} differs from the {dp} data-parallel "
                              "rank files of this tag; parameter groups with their own data-parallel size (MoE expert "
                              "groups) are not supported for BF16_Optimizer saves yet")
        if len(osd["single_partition_of_fp32_groups"]) != groups or len(osd["param_slice_mappings"]) != groups:
            raise LayoutError(f"{rank_file.path}: {what}: records {len(osd['single_partition_of_fp32_groups'])} fp32 "
                              f"partitions and {len(osd['param_slice_mappings'])} mappings where rank 0 records "
                              f"{groups}; files from different saves are mixed: copy one save's tag directory again")
    if param_groups is not None and len(param_groups) != groups:
        raise LayoutError(f"{model_path}: records {len(param_groups)} parameter groups (param_shapes) but the "
                          f"{what} optimizer files hold {groups}; files from different saves are mixed")
    for i in range(groups):
        parts, recs, pads = [], [], []
        for r in range(dp):
            osd = ranks[r].osd
            part = osd["single_partition_of_fp32_groups"][i]
            if not isinstance(part, TensorRef) or part.dtype != "F32":
                raise LayoutError(f"{ranks[r].path}: fp32 partition of group {i} is not an fp32 tensor; the file "
                                  "is corrupt")
            parts.append(part)
            rec = osd["param_slice_mappings"][i]
            if not isinstance(rec, dict):
                raise LayoutError(f"{ranks[r].path}: param_slice_mappings[{i}] is {short_repr(rec)}; the file is "
                                  "corrupt")
            recs.append({str(k): fragment_address(v, ranks[r].path) for k, v in rec.items()})
            pads_rec = osd.get("group_paddings") or [0] * groups
            pads.append(meta_int(pads_rec[i] if i < len(pads_rec) else None, ranks[r].path, "group_paddings"))
        if param_groups is not None:
            names = list(param_groups[i])
            shapes = [recorded_shape(param_groups[i][n], model_path, n) for n in names]
        else:
            names = order_from_mappings(recs)
            missing = [n for n in names if not isinstance(module.get(n), TensorRef)]
            if missing:
                raise LayoutError(f"{model_path}: {what}: param_slice_mappings name {missing[:3]}, which the module "
                                  "state dict does not hold (their shapes are recorded nowhere else); the "
                                  "model-states file comes from another save or is corrupt")
            shapes = [tuple(module[n].shape) for n in names]
        sizes = {p.numel for p in parts}
        if len(sizes) != 1 or any(pads[:-1]):
            raise LayoutError(f"{ranks[0].path}: {what}: group {i}'s fp32 partitions hold {sorted(sizes)} elements "
                              f"with paddings {pads}; BF16_Optimizer saves equal partitions, padding on the last "
                              "rank only: files from different saves are mixed")
        try:
            frags = bf16_fragments([numel(s) for s in shapes], sizes.pop(), dp, pads[-1])
        except ValueError as e:
            raise LayoutError(f"{ranks[0].path}: {what}: parameter group {i}: {e}; the model-states file and the "
                              "optimizer files come from different saves or are corrupt") from None
        for r in range(dp):
            bad = partitions.check_slice_mappings(names, frags, r, recs[r])
            if bad:
                raise LayoutError(f"{ranks[r].path}: the offsets this file records (param_slice_mappings) disagree "
                                  f"with its place as data-parallel rank {r} for {bad[:3]}; the file was renamed or "
                                  "comes from another save: restore the original names")
        copies = {n: module_copy(module.get(n), shape) for n, shape in zip(names, shapes)}
        prove_places(ranks, i, names, frags, parts, copies, model_path)
        for name, shape, fr in zip(names, shapes, frags):
            pieces = [tensor_pieces(parts[r], local, count) for r, local, count in fr]
            copy = copies[name]
            check = ([pieces], [[tensor_pieces(copy, 0, copy.numel)]]) if copy is not None else None
            tensors[name] = TensorPlan(name, shape, "F32", [pieces], kind="master", module_check=check)
