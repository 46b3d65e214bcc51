"""FSDP2's default layout, planned without keeping any rank's shards: a tensor ``Shard(0)`` over a 1-D
mesh of every rank (rank ``r`` at coordinate ``r``) holds ``torch.chunk`` rows ``[r*k, (r+1)*k)`` in
rank ``r``'s file, so its pieces are (the rank files, each rank's byte offset, ``k`` rows): one
:class:`~...boxes.StridedPieces` per tensor, as ZeRO-3's. The byte offsets differ between rank files
only where an earlier tensor's shard had another size (the uneven and empty shards shift what follows
in the zip), so each rank keeps only the tensors where its offset (relative to rank 0's) changes, and
one tuple of offsets is shared by every tensor between two changes.

Why: the general placement (:func:`~.placement.local_indices`, a ``Chunk`` and ``Piece`` per rank per
tensor) kept ~44 MB per rank file of a 45,395-tensor model (~45 GB at 1,024 ranks) and spent most of
its per-file time there. The pieces are the ones the general placement gives (same files, offsets,
counts), so exports are byte-identical.

A tensor placed so at rank 0 and otherwise at a later rank (another mesh, a misplaced or odd-sized
shard, a file in another key order) raises :class:`Irregular`: the source plans again the general
way, which places (or refuses, naming the file) what it finds.
"""

import math
from typing import Dict, List, Sequence, Tuple

from ...boxes import SIZES, StridedPieces
from ...formats.torch_files import TensorRef
from ...plan import TensorPlan
from .placement import chunk_range

__all__ = ["Irregular", "RowShards"]

_SHARD0 = [("shard", 0, 0)]


class Irregular(Exception):
    """A tensor is not in the same row layout in every rank file: plan it the general way."""


class RowShards:
    """The ``Shard(0)``-over-every-rank tensors of a save, taken rank file by rank file (rank 0 first)."""

    def __init__(self, files: Sequence[str]) -> None:
        self.paths = tuple(files)
        self.world = len(files)
        # name -> (shape, dtype, rank 0's byte offset, index): in rank 0's order
        self.first: Dict[str, Tuple[Tuple[int, ...], str, int, int]] = {}
        # rank -> [(index, byte offset - rank 0's)] where that difference changes (0 before the first)
        self.shifts: List[List[Tuple[int, int]]] = [[] for _ in files]
        self._last = [(-1, 0)] * self.world  # rank -> (last index taken, current shift)

    def _fits(self, shape: Tuple[int, ...], local: TensorRef, mesh_shape: Tuple[int, ...], coord: Tuple[int, ...],
              placed: List[Tuple[str, int, int]], rank: int) -> bool:
        if mesh_shape != (self.world,) or coord != (rank,) or placed != _SHARD0 or not shape or 0 in shape \
                or local.path != self.paths[rank] or not local.is_contiguous():
            return False
        a, b = chunk_range(shape[0], self.world, rank)
        return local.shape == (b - a,) + tuple(shape[1:])

    def take(self, name: str, shape: Tuple[int, ...], local: TensorRef, mesh_shape: Tuple[int, ...],
             coord: Tuple[int, ...], placed: List[Tuple[str, int, int]], rank: int) -> bool:
        """Whether this rank's DTensor ``name`` is taken here (else: the general way); :class:`Irregular`
        for a tensor taken at rank 0 that this rank holds otherwise."""
        if rank == 0:
            if not self._fits(shape, local, mesh_shape, coord, placed, rank):
                return False
            self.first[name] = (shape, local.dtype, local.byte_range()[0], len(self.first))
            return True
        rec = self.first.get(name)
        if rec is None:
            return False
        last, shift = self._last[rank]
        if rec[3] <= last or (rec[0], rec[1]) != (shape, local.dtype) or \
                not self._fits(shape, local, mesh_shape, coord, placed, rank):
            raise Irregular(name)
        if local.numel:  # an empty shard (past the rows) is never read: its offset does not matter
            now = local.byte_range()[0] - rec[2]
            if now != shift:
                self.shifts[rank].append((rec[3], now))
                shift = now
        self._last[rank] = (rec[3], shift)
        return True

    def tensors(self) -> Dict[str, TensorPlan]:
        """One :class:`TensorPlan` per tensor taken, its pieces a :class:`StridedPieces` over the rank files."""
        changes: Dict[int, List[Tuple[int, int]]] = {}
        for rank, runs in enumerate(self.shifts):
            for index, shift in runs:
                changes.setdefault(index, []).append((rank, shift))
        shifts = [0] * self.world
        out: Dict[str, TensorPlan] = {}
        bases: Tuple[int, ...] = ()
        base0 = -1
        for name, (shape, dtype, offset, index) in self.first.items():
            size = SIZES[dtype]
            local, rest = divmod(offset, size)  # rank r's rows start at bases[r] + size * local
            if index in changes:
                for rank, shift in changes[index]:
                    shifts[rank] = shift
                base0 = -1
            if rest != base0:
                bases, base0 = tuple(rest + s for s in shifts), rest
            numel = math.prod(shape)
            rows = -(-shape[0] // self.world)
            pieces = StridedPieces(self.paths, bases, local, rows * (numel // shape[0]), 0, numel, dtype)
            out[name] = TensorPlan(name, shape, dtype, [pieces], kind="module")  # type: ignore[list-item]
        return out
