"""ZeRO-3: every parameter partitioned on its own across the data-parallel ranks, each rank's
fp32 flat buffer holding its chunks back to back (the arithmetic is :mod:`.partitions`)."""

from collections import OrderedDict
from typing import List, Sequence

from ...errors import LayoutError
from ...formats.torch_files import TensorRef
from ...plan import Piece, TensorPlan, narrow_pieces
from . import partitions
from .allowlist import load
from .fields import numel, recorded_shape, tensor_pieces

__all__ = ["plan_zero3", "plan_zero3_frozen", "segmented_pieces"]


def plan_zero3(ranks, param_groups, model_path, tensors):
    dp = len(ranks)
    merged = OrderedDict()
    for group in param_groups:
        for n, s in group.items():
            merged[n] = recorded_shape(s, model_path, n)
    flats = []
    for r in range(dp):
        groups = ranks[r].osd.get("fp32_flat_groups")
        if not isinstance(groups, list) or not all(isinstance(g, TensorRef) and g.dtype == "F32"
                                                   for g in groups):
            raise LayoutError(f"{ranks[r].path}: no fp32_flat_groups tensors; not a ZeRO-3 optimizer file "
                              "or corrupt")
        flats.append(groups)
    lengths = {sum(g.numel for g in f) for f in flats}
    if len(lengths) != 1:
        raise LayoutError(f"{ranks[0].path}: ranks hold flat buffers of different lengths {sorted(lengths)}; "
                          "files from different saves are mixed")
    names = list(merged)
    try:
        frags = partitions.zero3_fragments([numel(merged[n]) for n in names], dp, lengths.pop())
    except ValueError as e:
        raise LayoutError(f"{ranks[0].path}: {e}; the model-states and optimizer files come from different "
                          "saves or are corrupt") from None
    # One contiguous flat buffer per rank (what DeepSpeed writes): a piece is plain arithmetic, and
    # zero3_fragments has proven every fragment lies inside the buffer (O(1) per piece at 1,024 ranks).
    single = all(len(f) == 1 and f[0].is_contiguous() for f in flats)
    bases = [(f[0].path, f[0].byte_range(0, 0)[0]) for f in flats] if single else None
    for name, fr in zip(names, frags):
        if single:
            pieces = [Piece(bases[r][0], bases[r][1] + 4 * local, count, "F32") for r, local, count in fr]
        else:
            pieces = []
            for r, local, count in fr:
                pieces.extend(segmented_pieces(flats[r], local, count))
        tensors[name] = TensorPlan(name, merged[name], "F32", [pieces], kind="master")


def segmented_pieces(segments: Sequence[TensorRef], start: int, count: int) -> List[Piece]:
    """Pieces for ``count`` elements from ``start`` of the concatenation of ``segments``
    (:func:`~...plan.narrow_pieces` over the segments laid end to end)."""
    try:
        return narrow_pieces([tensor_pieces(seg, 0, seg.numel) for seg in segments], start, count)
    except ValueError:
        raise LayoutError(f"{segments[0].path}: flat buffer shorter than the recorded shapes need") from None


def plan_zero3_frozen(model_files, dp, tensors):
    first = load(model_files[0])
    shapes = first.get("frozen_param_shapes") or {}
    # The other ranks' model files only matter for their frozen fragments: reading all of them
    # (each pickles every parameter's shape) was most of the plan time at 64+ ranks.
    per_rank = [first] + [load(model_files[r]) for r in range(1, dp)] if dp > 1 and shapes else None
    for name, shape in shapes.items():
        shape = recorded_shape(shape, model_files[0], name)
        n = numel(shape)
        chunk = partitions.ceil_div(n, dp)
        pieces = []
        for r in range(dp):
            count = min(chunk, n - r * chunk)
            if count <= 0:
                break
            ref = ((per_rank[r] if per_rank else first).get("frozen_param_fragments") or {}).get(name)
            if not isinstance(ref, TensorRef) or ref.numel < count:
                raise LayoutError(f"{model_files[r]}: frozen parameter {name} has no fragment of {count} "
                                  "elements; files from different saves are mixed")
            pieces.append(tensor_pieces(ref, 0, count))
        tensors[name] = TensorPlan(name, shape, pieces[0].dtype, [pieces], kind="frozen")
