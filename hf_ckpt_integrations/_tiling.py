"""Whether N-D chunks exactly tile a tensor, from metadata alone (:func:`check_tiling`).

Pure arithmetic, linear in the number of chunks; the data types are :mod:`.plan`'s
(:class:`~.plan.Chunk`), which re-exports :func:`check_tiling`.
"""

import math
from typing import Dict, List, Sequence, Tuple

from .boxes import pieces_numel

__all__ = ["check_tiling"]


def check_tiling(shape: Sequence[int], chunks: Sequence) -> None:
    """Raise ``ValueError`` saying what is wrong unless ``chunks`` exactly tile a tensor of
    ``shape``: each in bounds with as many dims as ``shape``, its pieces holding exactly its
    elements, no two overlapping, and together covering every element (no gap).

    Pure arithmetic on the metadata, linear in the number of chunks (``2**D`` corners each, for the
    ``D`` dims along which some chunk is split): see :func:`_corner_balance` for why the test is
    exact. Only a refusal searches for the pair to name (bounded)."""
    shape = tuple(shape)
    total = 0
    boxes = []
    for i, c in enumerate(chunks):
        if len(c.offsets) != len(shape) or len(c.sizes) != len(shape):
            raise ValueError(f"chunk {i}: {len(c.offsets)}-D offsets / {len(c.sizes)}-D sizes for a "
                             f"{len(shape)}-D tensor")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape)):
            raise ValueError(f"chunk {i}: offsets {list(c.offsets)} sizes {list(c.sizes)} fall outside the "
                             f"shape {list(shape)}")
        held = pieces_numel(c.pieces)
        if held != c.numel:
            raise ValueError(f"chunk {i}: its pieces hold {held} elements, its sizes {list(c.sizes)} need "
                             f"{c.numel}")
        if c.numel:
            boxes.append((tuple(c.offsets), tuple(o + s for o, s in zip(c.offsets, c.sizes)), i))
            total += c.numel
    if not shape:  # a scalar: one chunk of one element
        boxes = [((), (), i) for i, c in enumerate(chunks) if c.pieces and c.numel]
        total = len(boxes)
    need = math.prod(shape)
    if total == need and _corner_balance(shape, boxes):
        return
    i, j = _overlapping_pair(shape, boxes)
    if i is not None:
        raise ValueError(f"chunks {min(i, j)} and {max(i, j)} overlap")
    if total >= need:
        # Not a tiling although in bounds and as many elements as the shape: some element is held
        # twice (disjoint in-bounds chunks hold at most the shape's elements, exactly only when they
        # tile), but the bounded search did not reach the pair.
        raise ValueError(f"chunks overlap: they hold {total} elements for the {need} of shape {list(shape)}")
    raise ValueError(f"the chunks cover {total} of the {need} elements of shape {list(shape)} (a gap)")


_MAX_SPLIT_DIMS = 16  # 2**16 corners per chunk; a real layout splits a tensor along a few dims
_PAIR_BUDGET = 200_000  # pairs compared while looking for two overlapping chunks to name


def _corner_balance(shape, boxes) -> bool:
    """Whether the in-bounds ``boxes`` (``(lo, hi, index)``) cover every element of ``shape`` exactly once.

    Why this is exact: give each box ``[lo, hi)`` the signed measure ``m`` putting ``(-1)**k`` on
    each of its ``2**D`` corners, ``k`` = the number of coordinates taken from ``hi``. Summing ``m``
    over the corners ``<= x`` (coordinate-wise) gives ``prod_d ([lo_d <= x_d] - [hi_d <= x_d])``,
    which is 1 when ``x`` lies in the box and 0 elsewhere: the box's indicator is the prefix sum of
    its measure. Prefix sums are linear and one-to-one (differences undo them), so the number of
    boxes holding each element equals 1 on the shape and 0 outside exactly when the boxes' measures
    add up to the shape's own. Dims that no box splits carry the same factor in every measure and
    are left out. One dict entry per distinct corner: O(N * 2**D) for N boxes.
    """
    dims = [d for d in range(len(shape)) if any(lo[d] != 0 or hi[d] != shape[d] for lo, hi, _ in boxes)]
    if len(dims) > _MAX_SPLIT_DIMS:
        raise ValueError(f"the chunks split a tensor of shape {list(shape)} along {len(dims)} dims; at most "
                         f"{_MAX_SPLIT_DIMS} are read")
    balance: Dict[Tuple[int, ...], int] = {}
    full = ((0,) * len(shape), tuple(shape), None)
    for lo, hi, i in [*boxes, full]:
        sign = 1 if i is not None else -1  # the boxes' measures minus the shape's
        corners: List[Tuple[Tuple[int, ...], int]] = [((), sign)]
        for d in dims:
            corners = [(c + (lo[d],), s) for c, s in corners] + [(c + (hi[d],), -s) for c, s in corners]
        for c, s in corners:
            left = balance.get(c, 0) + s
            if left:
                balance[c] = left
            else:
                del balance[c]
    return not balance


def _overlapping_pair(shape, boxes):
    """Two chunk indices whose boxes share an element, for the refusal message: the same box twice,
    else a sweep along dim 0 comparing at most :data:`_PAIR_BUDGET` pairs. ``(None, None)`` when
    that finds none (the refusal stands; it just cannot name the pair)."""
    seen: Dict = {}
    for lo, hi, i in boxes:
        j = seen.setdefault((lo, hi), i)
        if j != i:
            return j, i
    if not shape:
        return (boxes[0][2], boxes[1][2]) if len(boxes) > 1 else (None, None)
    ordered = sorted(boxes)
    budget = _PAIR_BUDGET
    for k, (lo, hi, i) in enumerate(ordered):
        for lo2, hi2, j in ordered[k + 1:]:
            if lo2[0] >= hi[0]:
                break  # sorted by the first offset: no later box reaches back into this one's rows
            if all(a < d and c < b for a, b, c, d in zip(lo, hi, lo2, hi2)):
                return i, j
            budget -= 1
            if not budget:
                return None, None
    return None, None
