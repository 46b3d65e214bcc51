"""Where a rank's shard of a DTensor lies in the global tensor, as torch computes it (plain
numbers), and the byte pieces of a box of a contiguous local tensor."""

from typing import List, Sequence, Tuple

from ...formats.torch_files import TensorRef
from ...plan import Chunk, Piece, select_box


# ---- placement arithmetic (plain numbers) ----------------------------------------------------

def chunk_range(size: int, n: int, i: int) -> Tuple[int, int]:
    """``[start, end)`` of chunk ``i`` of ``torch.chunk(range(size), n)`` (empty past the end)."""
    full = -(-size // n) if n else 0
    start = min(size, full * i)
    return start, min(size, start + full)


def local_indices(shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                  placements: Sequence[Tuple[str, int, int]]) -> List[Sequence[int]]:
    """For each tensor dim, the global indices the shard at mesh coordinate ``coord`` holds, in order,
    as torch's ``_compute_local_shape_and_global_offset`` places them: mesh dims left to right,
    ``("shard", dim, 0)`` a ``torch.chunk`` of what is left along ``dim``, ``("strided", dim,
    split_factor)`` a chunk of each of ``split_factor`` chunks, ``("replicate", -1, 0)`` nothing.
    A dim only ever ``Shard``-ed stays a ``range`` (slicing one is O(1)): listing every index of every
    dim cost O(rows) per tensor per rank, quadratic in the world size when the rows grow with it."""
    idx: List[Sequence[int]] = [range(s) for s in shape]
    for mesh_dim, (kind, dim, factor) in enumerate(placements):
        if kind == "replicate":
            continue
        cur, n, r = idx[dim], mesh_shape[mesh_dim], coord[mesh_dim]
        if kind == "shard":
            a, b = chunk_range(len(cur), n, r)
            idx[dim] = cur[a:b]
        else:
            keep: List[int] = []
            for j in range(factor):
                a, b = chunk_range(len(cur), factor, j)
                piece = cur[a:b]
                c, d = chunk_range(len(piece), n, r)
                keep.extend(piece[c:d])
            idx[dim] = keep
    return idx


def index_runs(indices: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Maximal runs of consecutive global indices: ``(local start, global start, length)``."""
    if type(indices) is range and indices.step == 1:
        return [(0, indices.start, len(indices))] if len(indices) else []
    out: List[Tuple[int, int, int]] = []
    for k, g in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((k, g, 1))
    return out


def box_pieces(ref: TensorRef, lo: Sequence[int], hi: Sequence[int]) -> List[Piece]:
    """The elements of box ``[lo, hi)`` of the (contiguous) local tensor ``ref``, row-major, as pieces:
    one per row of the dims the box cuts, the dims it covers whole merged into each
    (:func:`~...plan.select_box` of the tensor as one chunk)."""
    if not ref.numel:
        return []
    whole = Chunk((Piece(ref.path, ref.byte_range()[0], ref.numel, ref.dtype),), (0,) * len(ref.shape), ref.shape)
    return [p for c in select_box(ref.shape, [whole], lo, hi) for p in c.pieces]
