"""ZeRO partition arithmetic on plain numbers (no files, no tensors): unit-tested on synthetic metadata.

ZeRO-1/2 flatten each parameter group and cut the flat buffer into equal partitions, one per
data-parallel rank, in rank order; parameters lie back to back in the order recorded in
``param_shapes``. DeepSpeed saves each partition without the group's alignment padding, which
only the last rank carries (``group_paddings``). From 0.19, ``zero_optimization.parameter_alignment``
may also pad after each parameter inside the flat buffer; the file then records those gaps
(``param_alignment_paddings``, zeros when the option is off). Files without that key (every
release before 0.19) have none: parameters lie back to back.

ZeRO-3 partitions every parameter on its own: rank ``r`` holds elements
``[r*ceil(n/dp), (r+1)*ceil(n/dp))`` of each parameter, and its flat fp32 buffer holds those
chunks back to back in ``param_shapes`` order. The last rank's chunk is zero-padded.
"""

from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["Fragment", "zero12_fragments", "zero3_fragments", "zero3_offsets", "ceil_div", "round_robin_order"]

# (rank, element offset inside that rank's flat partition, element count)
Fragment = Tuple[int, int, int]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def zero12_fragments(numels: Sequence[int], partition_numels: Sequence[int], paddings: Sequence[int],
                     param_paddings: Optional[Sequence[int]] = None) -> List[List[Fragment]]:
    """Where each parameter of one ZeRO-1/2 group lives.

    ``partition_numels[r]`` is the saved (unpadded) length of rank ``r``'s partition and
    ``paddings[r]`` the padding DeepSpeed removed from it; every rank's padded length must be
    the same. ``param_paddings[i]``: zeros recorded after parameter ``i`` in the flat buffer
    (``param_alignment_paddings``; ``None`` when the file records none). Raises ``ValueError``
    when the recorded numbers do not fit together.
    """
    gaps = list(param_paddings) if param_paddings is not None else [0] * len(numels)
    if len(gaps) != len(numels) or any(not isinstance(g, int) or g < 0 for g in gaps):
        raise ValueError(f"param_alignment_paddings {gaps!r} do not fit the {len(numels)} recorded parameters")
    dp = len(partition_numels)
    sizes = {p + pad for p, pad in zip(partition_numels, paddings)}
    if len(sizes) != 1:
        raise ValueError(f"partitions of unequal padded size {sorted(sizes)}")
    size = sizes.pop()
    total = sum(numels) + sum(gaps)
    available = sum(partition_numels)
    if total != available:
        raise ValueError(f"recorded shapes hold {total} elements but the {dp} partitions hold {available}")
    out: List[List[Fragment]] = []
    offset = 0
    for n, gap in zip(numels, gaps):
        frags = []
        start, end = offset, offset + n
        while start < end:
            rank = start // size
            local = start - rank * size
            count = min(end, (rank + 1) * size) - start
            frags.append((rank, local, count))
            start += count
        out.append(frags)
        offset = end + gap
    return out


def round_robin_order(count: int, partitions: int) -> List[int]:
    """The flat order ZeRO-1/2's ``round_robin_gradients`` gives a group of ``count`` parameters
    over ``partitions`` ranks: ``order[k]`` is the index, in the group's own (module) order, of the
    ``k``-th parameter of the flat buffer. DeepSpeed's ``_round_robin_reorder`` deals the parameters
    out like cards (parameter ``i`` to pile ``i % partitions``) and lays the piles end to end.
    ``param_shapes`` is recorded in this flat order; ``param_slice_mappings`` (DeepSpeed 0.19.8
    and before, without ``parameter_alignment`` padding) at offsets counted in the module order,
    as if nothing were reordered: they address the wrong elements, the flat order is the truth."""
    return [i for pile in range(min(partitions, count)) for i in range(pile, count, partitions)]


def zero3_offsets(numels: Sequence[int], dp: int, flat_numel: int) -> List[Tuple[int, int]]:
    """``(element offset, elements per rank)`` of each parameter under ZeRO-3, the same in every one of
    the ``dp`` ranks' flat buffers of ``flat_numel`` elements: :func:`zero3_fragments` without listing
    one fragment per rank (O(parameters), what a 1,024-rank plan keeps). Raises ``ValueError`` when
    the recorded shapes do not fill the buffers exactly."""
    needed = sum(ceil_div(n, dp) for n in numels)
    if needed != flat_numel:
        raise ValueError(f"recorded shapes need {needed} elements per rank but each rank's flat buffer "
                         f"holds {flat_numel}")
    out: List[Tuple[int, int]] = []
    local = 0
    for n in numels:
        chunk = ceil_div(n, dp)
        out.append((local, chunk))
        local += chunk
    return out


def zero3_fragments(numels: Sequence[int], dp: int, flat_numel: int) -> List[List[Fragment]]:
    """Where each parameter lives under ZeRO-3 given ``dp`` ranks whose flat buffers hold ``flat_numel``."""
    out: List[List[Fragment]] = []
    for n, (local, chunk) in zip(numels, zero3_offsets(numels, dp, flat_numel)):
        # Only the first ceil(n / chunk) ranks hold elements of a parameter smaller than dp (a
        # layernorm at 1,024 ranks): walking those, not all dp, keeps this O(pieces).
        frags = [(rank, local, chunk) for rank in range(ceil_div(n, chunk) - 1)] if n else []
        if n:
            last = ceil_div(n, chunk) - 1
            frags.append((last, local, n - last * chunk))
        out.append(frags)
    return out


def check_slice_mappings(names: Sequence[str], frags: List[List[Fragment]], rank: int,
                         recorded: Dict[str, Tuple[int, int]]) -> List[str]:
    """Compare ZeRO-1/2 ``param_slice_mappings`` (name -> (numel, start)) of ``rank`` with the
    computed fragments; return the names that disagree (empty when the placement is proven)."""
    expected = {}
    for name, fr in zip(names, frags):
        for r, local, count in fr:
            if r == rank:
                expected[name] = (count, local)
    bad = [n for n in set(expected) | set(recorded) if expected.get(n) != tuple(recorded.get(n, ()))]
    return sorted(bad)
