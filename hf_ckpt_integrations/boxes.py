"""Pieces and chunks (the byte ranges and N-D blocks a plan is made of) and the one box-selection
helper on them (:func:`select_box`): which pieces hold a box of a tensor tiled by chunks, from
metadata alone. :mod:`.plan` re-exports every name here; nothing here reads a file.
"""

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union, overload

from .formats.dtypes import SIZES

__all__ = ["Piece", "Chunk", "StridedPieces", "narrow_pieces", "box_runs", "select_box", "range_as_box",
           "row_major_pieces", "parts_as_chunks", "pieces_numel", "pieces_dtypes", "pieces_paths", "groups_paths", "as_pieces"]


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

    pieces: Sequence[Piece]  # a tuple, or a :class:`StridedPieces` (ZeRO-3: computed on demand)
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


class StridedPieces(Sequence[Piece]):
    """The pieces of elements ``[start, stop)`` of a tensor cut across ranks in runs of ``chunk``
    elements (ZeRO-3: every parameter at the same element offset ``local`` of every rank's flat
    buffer), computed on demand: element ``e`` lies on rank ``e // chunk``, at byte
    ``bases[r] + size * (local + e % chunk)`` of ``paths[r]``. It behaves as the list of those
    :class:`Piece` s (``len``, indexing, iteration, ``==`` with a list or tuple of them) while holding
    O(1) of its own: ``paths``/``bases`` (one entry per rank) are shared by every tensor of a plan.
    A 1,024-rank plan of 45,395 tensors is 45,395 of these, not 46M pieces.
    :func:`narrow_pieces` of it is another one (O(1)); the helpers :func:`pieces_numel`,
    :func:`pieces_dtypes` and :func:`pieces_paths` answer without producing a piece."""

    __slots__ = ("paths", "bases", "local", "chunk", "start", "stop", "dtype")

    def __init__(self, paths: Sequence[str], bases: Sequence[int], local: int, chunk: int, start: int, stop: int,
                 dtype: str) -> None:
        if chunk < 1 or not 0 <= start <= stop or (stop > start and -(-stop // chunk) > len(paths)) or \
                len(paths) != len(bases):
            raise ValueError(f"elements [{start}, {stop}) in runs of {chunk} do not fit {len(paths)} ranks")
        self.paths, self.bases, self.local, self.chunk = paths, bases, local, chunk
        self.start, self.stop, self.dtype = start, stop, dtype

    def __len__(self) -> int:
        return 0 if self.stop <= self.start else (self.stop - 1) // self.chunk - self.start // self.chunk + 1

    def _piece(self, i: int) -> Piece:
        c = self.chunk
        r = self.start // c + i
        lo, hi = max(self.start, r * c), min(self.stop, (r + 1) * c)
        return Piece(self.paths[r], self.bases[r] + SIZES[self.dtype] * (self.local + lo - r * c), hi - lo, self.dtype)

    @overload
    def __getitem__(self, i: int) -> Piece: ...

    @overload
    def __getitem__(self, i: slice) -> List[Piece]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[Piece, List[Piece]]:
        n = len(self)
        if isinstance(i, slice):
            return [self._piece(k) for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("piece index out of range")
        return self._piece(i)

    def __iter__(self) -> Iterator[Piece]:
        for i in range(len(self)):
            yield self._piece(i)

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, StridedPieces) and other.paths is self.paths and other.bases is self.bases and \
                (other.local, other.chunk, other.start, other.stop, other.dtype) == \
                (self.local, self.chunk, self.start, self.stop, self.dtype):
            return True
        if isinstance(other, (StridedPieces, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:  # equal to the tuple of its pieces, so hashed as that tuple
        return hash(tuple(self))

    def __repr__(self) -> str:
        return (f"StridedPieces({len(self)} pieces: elements [{self.start}, {self.stop}) in runs of {self.chunk} "
                f"at element {self.local} of {len(self.paths)} rank files, {self.dtype})")

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def narrow(self, start: int, count: int) -> "StridedPieces":
        """Elements ``[start, start + count)`` of these (as :func:`narrow_pieces`); ``ValueError`` past the end."""
        if start < 0 or count < 0 or start + count > self.numel:
            raise ValueError(f"element range past the end of the tensor "
                             f"({max(0, start + count - self.numel)} elements missing)")
        a = self.start + start
        return StridedPieces(self.paths, self.bases, self.local, self.chunk, a, a + count, self.dtype)

    def rank_paths(self) -> Sequence[str]:
        """The files these pieces are in, one per piece, in order (without making the pieces)."""
        if not len(self):
            return ()
        first = self.start // self.chunk
        return self.paths[first:first + len(self)]


def as_pieces(pieces: Sequence[Piece]) -> Sequence[Piece]:
    """``pieces`` as a :class:`Chunk` holds them: a :class:`StridedPieces` as it is, anything else a tuple."""
    return pieces if isinstance(pieces, StridedPieces) else tuple(pieces)


def pieces_numel(pieces: Iterable[Piece]) -> int:
    """The elements ``pieces`` hold (a :class:`StridedPieces` without making its pieces)."""
    if isinstance(pieces, StridedPieces):
        return pieces.numel
    return sum(p.numel for p in pieces)


def pieces_dtypes(pieces: Iterable[Any]) -> Set[str]:
    """The dtypes of ``pieces`` (a :class:`StridedPieces` without making its pieces)."""
    if isinstance(pieces, StridedPieces):
        return {pieces.dtype} if len(pieces) else set()
    return {p.dtype for p in pieces}


def pieces_paths(pieces: Iterable[Piece]) -> Iterable[str]:
    """The file of each of ``pieces`` (a :class:`StridedPieces` without making its pieces)."""
    if isinstance(pieces, StridedPieces):
        return pieces.rank_paths()
    return (p.path for p in pieces)


def groups_paths(groups: Iterable[Iterable[Any]]) -> Iterator[str]:
    """The file of every piece of ``groups`` (lists of pieces), for checks that want each file once:
    a :class:`StridedPieces` group yields its plan's rank files (every one, once per plan: they are
    shared by all its tensors) instead of one path per piece; other groups one path per piece."""
    seen: Set[int] = set()
    for group in groups:
        if isinstance(group, StridedPieces):
            if id(group.paths) not in seen:
                seen.add(id(group.paths))
                yield from group.paths
            continue
        for p in group:
            yield p.path


def narrow_pieces(pieces: Sequence[Piece], start: int, count: int) -> List[Piece]:
    """Elements ``[start, start + count)`` of the flat tensor ``pieces`` lay end to end, as pieces
    (of a :class:`StridedPieces`, another one: O(1), its pieces still made on demand).
    Raises ``ValueError`` for a range past the end."""
    if isinstance(pieces, StridedPieces):
        return pieces.narrow(start, count)  # type: ignore[return-value]  # behaves as the list
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
        held = pieces_numel(c.pieces)
        if held != c.numel:
            raise ValueError(f"a chunk at {list(c.offsets)} of sizes {list(c.sizes)} holds {held} elements")
        local_lo = tuple(p - o for p, o in zip(a, c.offsets))
        local_hi = tuple(q - o for q, o in zip(b, c.offsets))
        runs = list(box_runs(c.sizes, local_lo, local_hi))
        if isinstance(c.pieces, StridedPieces) and len(runs) == 1:  # one run of a ZeRO-3 tensor: still on demand
            pieces: Sequence[Piece] = c.pieces.narrow(*runs[0])
        else:
            flat = _Flat(c.pieces)
            pieces = tuple(q for start, n in runs for q in flat.take(start, n))
        out.append(Chunk(pieces, tuple(p - x for p, x in zip(a, lo)), tuple(q - p for p, q in zip(a, b))))
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
    if len(chunks) == 1 and isinstance(chunks[0].pieces, StridedPieces) and tuple(chunks[0].sizes) == shape:
        return chunks[0].pieces  # type: ignore[return-value]  # the whole tensor, still made on demand
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
        return [Chunk(as_pieces(parts[0]), (0,) * len(shape), tuple(shape))]
    out, at = [], 0
    for pieces, s in zip(parts, shapes):
        s = tuple(s)
        offsets = tuple(at if d == cat_dim else 0 for d in range(len(s)))
        out.append(Chunk(as_pieces(pieces), offsets, s))
        at += s[cat_dim] if cat_dim is not None and s else 0
    return out
