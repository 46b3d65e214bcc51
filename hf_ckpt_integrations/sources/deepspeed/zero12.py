"""ZeRO-1/2: each parameter group's fp32 masters, flat and cut in equal partitions, one per
data-parallel rank (the arithmetic is :mod:`.partitions`); every partition's place is proven
against the module weights the model-states file holds whole."""

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ...errors import LayoutError
from ...formats.torch_files import TensorRef
from ...mapped_files import MappedFiles
from ...plan import TensorPlan
from . import moe, partitions
from .fields import OptimFile, numel, recorded_shape, tensor_pieces
from .partitions import Fragment

__all__ = ["plan_zero12", "plan_group", "plan_zero12_frozen", "module_copy", "prove_places", "param_alignment_paddings",
           "PLACE_SAMPLES"]


def plan_zero12(ranks: Mapping[int, OptimFile], param_groups: List[Dict[str, Any]], model_path: str,
                tensors: Dict[str, TensorPlan], module: Mapping[str, Any], *, notes: Optional[List[str]] = None,
                experts: Optional[moe.Experts] = None) -> None:
    """Plan every parameter group of one model-parallel rank into ``tensors``. ``experts``: the
    MoE expert files (:func:`.moe.find_expert_files`); groups partitioned over fewer ranks than
    ``ranks`` are expert groups, planned by :mod:`.moe`. ``notes``: a list the plan's notes go to."""
    dp = len(ranks)
    notes = [] if notes is None else notes
    for i, group in enumerate(param_groups):
        names = list(group)
        shapes = [recorded_shape(group[n], model_path, n) for n in names]
        count = _partition_count(ranks[0], i)
        if experts and (count != dp or (names and all(moe.EXPERT_NAME_RE.match(n) for n in names))):
            moe.plan_expert_group(ranks, i, names, shapes, count, model_path, tensors, experts, notes,
                                  plan_group=plan_group)
            continue
        copies = {n: module_copy(module.get(n), shape) for n, shape in zip(names, shapes)}
        plan_group(ranks, i, names, shapes, model_path, copies, tensors, notes)


def _partition_count(rank_file: OptimFile, group: int) -> Optional[int]:
    pc = rank_file.osd.get("partition_count")
    if isinstance(pc, list) and group < len(pc) and isinstance(pc[group], int):
        return pc[group]
    return pc if isinstance(pc, int) else None


def plan_group(ranks: Mapping[int, OptimFile], i: int, names: List[str], shapes: Sequence[Tuple[int, ...]],
               model_path: str, copies: Mapping[str, Optional[TensorRef]], tensors: Dict[str, TensorPlan],
               notes: List[str], *, names_out: Optional[List[str]] = None) -> None:
    """Plan parameter group ``i`` held by ``ranks`` (``{partition rank: RankFile}``, the group's own
    data-parallel ranks), its ``names`` and ``shapes`` in the recorded (flat) order, each proven
    against ``copies`` (name -> module weight or None). ``names_out``: the names written (an
    expert's global name), default ``names``."""
    dp = len(ranks)
    names_out = names if names_out is None else names_out
    parts, pads = [], []
    for r in range(dp):
        osd = ranks[r].osd
        try:
            parts.append(osd["single_partition_of_fp32_groups"][i])
            pads.append(int(osd.get("group_paddings", [0] * (i + 1))[i]))
        except (KeyError, IndexError, TypeError):
            raise LayoutError(f"{ranks[r].path}: has no fp32 partition for parameter group {i}; "
                              "files from different saves are mixed") from None
        if not isinstance(parts[-1], TensorRef) or parts[-1].dtype != "F32":
            raise LayoutError(f"{ranks[r].path}: fp32 partition of group {i} is not an fp32 tensor; "
                              "the file is corrupt")
    gaps = param_alignment_paddings(ranks, i)
    numels = [numel(s) for s in shapes]
    try:
        frags = partitions.zero12_fragments(numels, [p.numel for p in parts], pads, gaps)
    except ValueError as e:
        raise LayoutError(f"{ranks[0].path}: parameter group {i}: {e}; the model-states file "
                          f"{os.path.basename(model_path)} and the optimizer files come from different "
                          "saves or are corrupt") from None
    for r in range(dp):
        recorded = ranks[r].osd.get("param_slice_mappings")
        if isinstance(recorded, list) and i < len(recorded) and isinstance(recorded[i], dict):
            rec = {str(k): _address(v, ranks[r].path) for k, v in recorded[i].items()}
            bad = partitions.check_slice_mappings(names, frags, r, rec)
            if bad and not any(gaps or ()) and _round_robin_recorded(names, numels, parts, pads, r, rec):
                bad = []
                note = (f"parameter group {i} is laid out by round_robin_gradients: its param_slice_mappings "
                        "address the module order, the masters are placed by the flat order (param_shapes)")
                if note not in notes:
                    notes.append(note)
            if bad:
                raise LayoutError(f"{ranks[r].path}: the offsets this file records (param_slice_mappings) "
                                  f"disagree with its place as data-parallel rank {r} for {bad[:3]}; the "
                                  "file was renamed or comes from another save: restore the original names")
    prove_places(ranks, i, names, frags, parts, copies, model_path)
    for name, out, shape, fr in zip(names, names_out, shapes, frags):
        pieces = [tensor_pieces(parts[r], local, count) for r, local, count in fr]
        copy = copies.get(name)
        check = ([pieces], [[tensor_pieces(copy, 0, copy.numel)]]) if copy is not None else None
        tensors[out] = TensorPlan(out, shape, "F32", [pieces], kind="master", module_check=check)


def _round_robin_recorded(names: List[str], numels: List[int], parts: List[TensorRef], pads: List[int], rank: int,
                          recorded: Dict[str, Tuple[int, int]]) -> bool:
    """True when ``recorded`` (rank ``rank``'s ``param_slice_mappings``) are exactly what DeepSpeed
    records under ``round_robin_gradients``: offsets counted in the module order, which the flat
    (recorded) order dealt out over the group's ranks came from (:func:`.partitions.round_robin_order`)."""
    order = partitions.round_robin_order(len(names), len(parts))
    module_order = [0] * len(names)  # every slot is set below: ``order`` is a permutation
    for flat_index, original in enumerate(order):
        module_order[original] = flat_index
    try:
        frags = partitions.zero12_fragments([numels[k] for k in module_order], [p.numel for p in parts], pads)
    except ValueError:
        return False
    return not partitions.check_slice_mappings([names[k] for k in module_order], frags, rank, recorded)


# Elements per rank and parameter group compared with the module weights while planning: both
# ends of the partition and evenly spaced ones between (``verify`` compares every element).
PLACE_SAMPLES = 8


def module_copy(ref: Any, shape: Sequence[int]) -> Optional[TensorRef]:
    """The module weight matching a master of ``shape``, if the model-states file holds one."""
    if isinstance(ref, TensorRef) and ref.shape == tuple(shape) and ref.is_contiguous() and \
            ref.dtype in ("F32", "BF16", "F16"):
        return ref
    return None


def prove_places(ranks: Mapping[int, OptimFile], group: int, names: Sequence[str], frags: List[List[Fragment]],
                 parts: Sequence[TensorRef], copies: Mapping[str, Optional[TensorRef]], model_path: str) -> None:
    """Prove each rank file sits at its place: a few of its fp32 masters, cast to the module weights'
    dtype, must equal the module weights (saved whole in the model-states file) at the positions
    the place implies. ``param_slice_mappings`` cannot do this when several ranks hold slices of
    one parameter: their records are identical, so swapped files look right.

    Raises :class:`LayoutError` naming the file and the element that disagrees.
    """
    from ...casts import cast_bytes  # numpy: the one rounding implementation (bitwise torch's)

    # rank -> [(local start, count, name, offset in param)]
    by_rank: Dict[int, List[Tuple[int, int, str, int]]] = {r: [] for r in range(len(parts))}
    for name, fr in zip(names, frags):
        done = 0
        for r, local, count in fr:
            by_rank[r].append((local, count, name, done))
            done += count
    with MappedFiles() as files:
        for r, spans in by_rank.items():
            n = parts[r].numel
            for pos in sorted({(n - 1) * k // (PLACE_SAMPLES - 1) for k in range(PLACE_SAMPLES)} if n else ()):
                hit = next(((name, off + pos - local) for local, count, name, off in spans
                            if local <= pos < local + count), None)
                if hit is None:
                    continue
                copy = copies.get(hit[0])
                if copy is None:
                    continue
                master = bytes(files.read(*_one(parts[r], pos)))
                want = bytes(files.read(*_one(copy, hit[1])))
                got = cast_bytes(master, "F32", copy.dtype)
                if got != want and not (_is_nan(got, copy.dtype) and _is_nan(want, copy.dtype)):
                    raise LayoutError(
                        f"{ranks[r].path}: its fp32 partition of parameter group {group} does not match the "
                        f"model's own weights ({os.path.basename(model_path)}) at its place as data-parallel "
                        f"rank {r} ({hit[0]}[{hit[1]}]); rank files were swapped, renamed or copied from another "
                        "save: restore the original file names, or copy the tag directory again")


def _one(ref: TensorRef, index: int) -> Tuple[str, int, int]:
    offset, nbytes = ref.byte_range(index, 1)
    return ref.path, offset, nbytes


def _is_nan(raw: bytes, dtype: str) -> bool:
    bits = int.from_bytes(raw, "little")
    if dtype == "F32":
        return (bits & 0x7FFFFFFF) > 0x7F800000
    if dtype == "BF16":
        return (bits & 0x7FFF) > 0x7F80
    return (bits & 0x7FFF) > 0x7C00


def param_alignment_paddings(ranks: Mapping[int, OptimFile], group: int) -> Optional[List[int]]:
    """Zeros DeepSpeed put after each parameter of ``group`` (``param_alignment_paddings``, 0.19+
    with ``parameter_alignment``); ``None`` when the files record none (all releases before 0.19)."""
    recorded = [r.osd.get("param_alignment_paddings") for r in ranks.values()]
    if any(rec != recorded[0] for rec in recorded):
        raise LayoutError(f"{ranks[0].path}: data-parallel ranks record different param_alignment_paddings; "
                          "files from different saves are mixed: copy one save's tag directory again")
    if recorded[0] is None:
        return None
    try:
        return list(recorded[0][group])  # zero12_fragments checks they are non-negative integers
    except (IndexError, KeyError, TypeError):
        raise LayoutError(f"{ranks[0].path}: param_alignment_paddings has no list for parameter group "
                          f"{group}; the file is corrupt") from None


def _address(value: Any, path: str) -> Tuple[int, int]:
    try:
        return int(value.numel), int(value.start)
    except (AttributeError, TypeError, ValueError):
        raise LayoutError(f"{path}: a param_slice_mappings entry is not a fragment address; the file is corrupt")


def plan_zero12_frozen(model: Mapping[str, Any], model_path: str, tensors: Dict[str, TensorPlan]) -> None:
    shapes = model.get("frozen_param_shapes") or {}
    frags = model.get("frozen_param_fragments") or {}
    for name, shape in shapes.items():
        ref = frags.get(name)
        shape = recorded_shape(shape, model_path, name)
        if not isinstance(ref, TensorRef) or ref.numel != numel(shape):
            raise LayoutError(f"{model_path}: frozen parameter {name} has no fragment of {numel(shape)} elements")
        tensors[name] = TensorPlan(name, shape, ref.dtype, [[tensor_pieces(ref, 0, ref.numel)]], kind="frozen")
