"""ZeRO-3: every parameter partitioned on its own across the data-parallel ranks, each rank's
fp32 flat buffer holding its chunks back to back (the arithmetic is :mod:`.partitions`)."""

from collections import OrderedDict
from typing import List, Sequence

from ...errors import LayoutError
from ...formats.torch_files import TensorRef
from ...plan import Piece, StridedPieces, TensorPlan, narrow_pieces
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
    numels = [numel(merged[n]) for n in names]
    flat_numel = lengths.pop()
    try:
        offsets = partitions.zero3_offsets(numels, dp, flat_numel)
    except ValueError as e:
        raise LayoutError(f"{ranks[0].path}: {e}; the model-states and optimizer files come from different "
                          "saves or are corrupt") from None
    single = all(len(f) == 1 and f[0].is_contiguous() for f in flats)
    if single:
        # One contiguous flat buffer per rank (what DeepSpeed writes): a parameter sits at the same element
        # offset of every rank's buffer, so its pieces are (the rank files, that offset, the partition size):
        # one StridedPieces per tensor, its pieces made when read (O(tensors) memory at 1,024 ranks, not
        # tensors x ranks). zero3_offsets has proven every partition lies inside the buffer.
        paths = tuple(f[0].path for f in flats)
        bases = tuple(f[0].byte_range(0, 0)[0] for f in flats)
        for name, n, (local, chunk) in zip(names, numels, offsets):
            pieces = StridedPieces(paths, bases, local, max(chunk, 1), 0, n, "F32")
            tensors[name] = TensorPlan(name, merged[name], "F32", [pieces], kind="master")  # type: ignore[list-item]
        return
    frags = partitions.zero3_fragments(numels, dp, flat_numel)
    for name, fr in zip(names, frags):
        segmented: List[Piece] = []
        for r, local, count in fr:
            segmented.extend(segmented_pieces(flats[r], local, count))
        tensors[name] = TensorPlan(name, merged[name], "F32", [segmented], kind="master")


def segmented_pieces(segments: Sequence[TensorRef], start: int, count: int) -> List[Piece]:
    """Pieces for ``count`` elements from ``start`` of the concatenation of ``segments``
    (:func:`~...plan.narrow_pieces` over the segments laid end to end)."""
    try:
        return narrow_pieces([tensor_pieces(seg, 0, seg.numel) for seg in segments], start, count)
    except ValueError:
        raise LayoutError(f"{segments[0].path}: flat buffer shorter than the recorded shapes need") from None


def plan_zero3_frozen(model_files, dp, tensors, first=None):
    """The frozen parameters' fragments (one per rank file's ``frozen_param_fragments``); ``first``: rank
    0's model-states file already read (the source's plan has it: reading its pickle again was a third of
    a 45,395-tensor plan)."""
    first = load(model_files[0]) if first is None else first
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
