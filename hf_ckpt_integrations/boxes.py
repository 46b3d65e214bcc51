"""Pieces and chunks (the byte ranges and N-D blocks a plan is made of) and the one box-selection
helper on them (:func:`select_box`): which pieces hold a box of a tensor tiled by chunks, from
metadata alone. :mod:`.plan` re-exports every name here; nothing here reads a file.
"""

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

from .formats.dtypes import SIZES

__all__ = ["Piece", "Chunk", "narrow_pieces", "box_runs", "select_box", "range_as_box", "row_major_pieces",
           "parts_as_chunks"]


@dataclass(frozen=True)
class Piece:
    """``numel`` consecutive elements of dtype ``dtype`` at byte ``offset`` of ``path``."""

    path: str
    offset: int
    numel: int
    dtype: str


@dataclass(frozen=True)
class Chunk:
    """A block of an output tensor, as torch DCP's ``ChunkStorageMetadata`` places one: ``pieces``
    laid end to end are its elements in row-major order, and it lands in the global tensor at
    N-D ``offsets`` with extent ``sizes``. A ZeRO partition is one chunk covering the whole tensor;
    a tensor-parallel slice a chunk offset along the split dim; an FSDP x TP shard a chunk offset
    along two dims — all the same to :func:`~.plan.check_tiling` and :func:`~.assemble.assemble_chunks`."""

    pieces: Tuple[Piece, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def narrow_pieces(pieces: Sequence[Piece], start: int, count: int) -> List[Piece]:
    """Elements ``[start, start + count)`` of the flat tensor ``pieces`` lay end to end, as pieces.
    Raises ``ValueError`` for a range past the end."""
    return _Flat(pieces).take(start, count)


class _Flat:
    """``pieces`` laid end to end, indexed by element (a bisect per range: a chunk cut into many
    runs costs ``runs x log(pieces)``, not ``runs x pieces``)."""

    def __init__(self, pieces: Sequence[Piece]):
        self.pieces = list(pieces)
        self.starts: List[int] = []
        at = 0
        for p in self.pieces:
            self.starts.append(at)
            at += p.numel
        self.numel = at

    def take(self, start: int, count: int) -> List[Piece]:
        if count == 0:
            return []
        if start < 0 or count < 0 or start + count > self.numel:
            raise ValueError(f"element range past the end of the tensor "
                             f"({max(0, start + count - self.numel)} elements missing)")
        out: List[Piece] = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while count > 0:
            p, at = self.pieces[i], start - self.starts[i]
            take = min(count, p.numel - at)
            if take > 0:
                out.append(Piece(p.path, p.offset + at * SIZES[p.dtype], take, p.dtype))
                count -= take
                start += take
            i += 1
        return out


def box_runs(shape: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> Iterator[Tuple[int, int]]:
    """The elements of box ``[lo, hi)`` of a row-major tensor of ``shape``, in row-major order, as
    maximal runs ``(flat start, count)``: one per row of the dims the box cuts, the trailing dims it
    covers whole merged into each run. Nothing for an empty box; a 0-d tensor is one run of 1."""
    shape = tuple(shape)
    if any(b <= a for a, b in zip(lo, hi)):
        return
    k = len(shape)
    while k > 0 and lo[k - 1] == 0 and hi[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        yield 0, math.prod(shape)
        return
    inner = math.prod(shape[k:])
    run = (hi[k - 1] - lo[k - 1]) * inner
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for outer in itertools.product(*(range(lo[d], hi[d]) for d in range(k - 1))):
        yield sum(i * strides[d] for d, i in enumerate(outer)) + lo[k - 1] * inner, run


def select_box(shape: Sequence[int], chunks: Sequence[Chunk], lo: Sequence[int], hi: Sequence[int]) -> List[Chunk]:
    """The sub-box ``[lo, hi)`` of a tensor of ``shape`` tiled by ``chunks``, as chunks tiling a tensor of
    shape ``hi - lo``: per chunk that meets the box, the part inside it, its pieces narrowed to the byte
    ranges of those elements (row-major runs, :func:`box_runs`), offsets relative to ``lo``. Metadata
    only: nothing is read, and a part of a tensor costs the reads of that part alone. Raises
    ``ValueError`` for a box outside ``shape`` or a chunk whose pieces do not hold its elements."""
    shape, lo, hi = tuple(shape), tuple(lo), tuple(hi)
    if len(lo) != len(shape) or len(hi) != len(shape) or any(
            not 0 <= a <= b <= d for a, b, d in zip(lo, hi, shape)):
        raise ValueError(f"box {list(lo)}..{list(hi)} is not inside the shape {list(shape)}")
    out = []
    for c in chunks:
        a = tuple(max(x, o) for x, o in zip(lo, c.offsets))
        b = tuple(min(y, o + s) for y, o, s in zip(hi, c.offsets, c.sizes))
        if any(q <= p for p, q in zip(a, b)):
            continue
        flat = _Flat(c.pieces)
        if flat.numel != c.numel:
            raise ValueError(f"a chunk at {list(c.offsets)} of sizes {list(c.sizes)} holds {flat.numel} elements")
        local_lo = tuple(p - o for p, o in zip(a, c.offsets))
        local_hi = tuple(q - o for q, o in zip(b, c.offsets))
        pieces = [q for start, n in box_runs(c.sizes, local_lo, local_hi) for q in flat.take(start, n)]
        out.append(Chunk(tuple(pieces), tuple(p - x for p, x in zip(a, lo)), tuple(q - p for p, q in zip(a, b))))
    return out


def range_as_box(shape: Sequence[int], start: int, count: int) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Flat elements ``[start, start + count)`` of a row-major tensor of ``shape`` as the box ``(lo, hi)``
    they are, or None when they are not one box (or none): a box fixes every dim before some dim ``d``,
    takes a run of ``d`` and every dim after it whole (a split along the leading dims is one)."""
    shape = tuple(shape)
    if count <= 0 or start < 0 or start + count > math.prod(shape):
        return None
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1:])
        if start % inner or count % inner:
            continue
        first, n = start // inner, count // inner
        if first // shape[d] != (first + n - 1) // shape[d]:  # crosses an index of a dim before d
            continue
        lo = list(_unravel(start, shape))
        hi = [i + 1 for i in lo[:d]] + [lo[d] + n] + list(shape[d + 1:])
        return tuple(lo), tuple(hi)
    return ((), ()) if not shape and start == 0 and count == 1 else None


def _unravel(flat: int, shape: Sequence[int]) -> Tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(flat % d if d else 0)
        flat = flat // d if d else 0
    return tuple(reversed(out))


def row_major_pieces(shape: Sequence[int], chunks: Sequence[Chunk]) -> Optional[List[Piece]]:
    """The byte-copy fast path: when the (tiling) ``chunks`` are whole-row slices along dim 0 (every
    other dim at full extent), their pieces laid end to end in offset order are the tensor's bytes;
    return them. None when some chunk is not (the tensor is then assembled)."""
    shape = tuple(shape)
    if not shape:
        return [p for c in chunks for p in c.pieces]
    out: List[Piece] = []
    for c in sorted(chunks, key=lambda c: c.offsets[0]):
        if any(o != 0 or s != d for o, s, d in zip(c.offsets[1:], c.sizes[1:], shape[1:])):
            return None
        out.extend(c.pieces)
    return out


def parts_as_chunks(shape: Sequence[int], parts: Sequence[Sequence[Piece]],
                    part_shapes: Optional[Sequence[Sequence[int]]] = None,
                    cat_dim: Optional[int] = None) -> List[Chunk]:
    """Tensor-parallel slices (``parts`` of ``part_shapes``, concatenated along ``cat_dim``) as chunks:
    slice ``i`` at offset ``sum(sizes of slices before i)`` along ``cat_dim``, 0 elsewhere."""
    shapes = list(part_shapes) if part_shapes is not None else [tuple(shape)]
    if len(parts) == 1 and part_shapes is None:
        return [Chunk(tuple(parts[0]), (0,) * len(shape), tuple(shape))]
    out, at = [], 0
    for pieces, s in zip(parts, shapes):
        s = tuple(s)
        offsets = tuple(at if d == cat_dim else 0 for d in range(len(s)))
        out.append(Chunk(tuple(pieces), offsets, s))
        at += s[cat_dim] if cat_dim is not None and s else 0
    return out
