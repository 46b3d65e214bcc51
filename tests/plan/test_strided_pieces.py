"""StridedPieces (issue 39): a ZeRO-3 tensor's pieces computed on demand behave exactly as the list
of Pieces the partition arithmetic lists (zero3_fragments), for every use a plan makes of them."""

from typing import List

import pytest

from hf_ckpt_integrations.boxes import (Chunk, Piece, StridedPieces, narrow_pieces, parts_as_chunks, pieces_dtypes,
                                        pieces_numel, pieces_paths, row_major_pieces, select_box)
from hf_ckpt_integrations.sources.deepspeed.partitions import zero3_fragments, zero3_offsets

DP = 7
PATHS = tuple(f"/ckpt/zero_pp_rank_{r}_optim_states.pt" for r in range(DP))
BASES = tuple(1000 + 64 * r for r in range(DP))


def listed(n: int, local: int, chunk: int) -> List[Piece]:
    """The pieces as the plan listed them before (one Piece per fragment)."""
    frags = zero3_fragments([n], DP, chunk)[0] if local == 0 else None
    assert frags is not None
    return [Piece(PATHS[r], BASES[r] + 4 * (local + off), count, "F32") for r, off, count in frags]


@pytest.mark.parametrize("n", [1, 3, 6, 7, 8, 13, 48, 49, 50])
def test_behaves_as_the_listed_pieces(n: int) -> None:
    chunk = -(-n // DP)
    want = listed(n, 0, chunk)
    got = StridedPieces(PATHS, BASES, 0, chunk, 0, n, "F32")
    assert len(got) == len(want) and list(got) == want and got == want and got == tuple(want)
    assert [got[i] for i in range(-len(want), len(want))] == want + want
    assert got[1:3] == want[1:3]
    assert pieces_numel(got) == n and pieces_dtypes(got) == {"F32"} and list(pieces_paths(got)) == [p.path for p in want]
    assert hash(got) == hash(tuple(want))
    for start in range(n):
        for count in range(n - start + 1):
            assert list(narrow_pieces(got, start, count)) == narrow_pieces(want, start, count)
    with pytest.raises(ValueError):
        narrow_pieces(got, n, 1)
    with pytest.raises(IndexError):
        got[len(want)]


def test_zero3_offsets_match_the_fragments() -> None:
    numels = [5, 1, 0, 49, 13]
    flat = sum(-(-n // DP) for n in numels)
    frags = zero3_fragments(numels, DP, flat)
    for n, (local, chunk), fr in zip(numels, zero3_offsets(numels, DP, flat), frags):
        got = StridedPieces(PATHS, BASES, local, max(chunk, 1), 0, n, "F32")
        assert list(got) == [Piece(PATHS[r], BASES[r] + 4 * off, count, "F32") for r, off, count in fr]
    with pytest.raises(ValueError):
        zero3_offsets(numels, DP, flat + 1)


def test_chunks_and_boxes_stay_on_demand() -> None:
    shape = (7, 5)
    pieces = StridedPieces(PATHS, BASES, 3, 5, 0, 35, "F32")
    (chunk,) = parts_as_chunks(shape, [pieces])
    assert chunk.pieces is pieces  # not expanded into a tuple
    assert row_major_pieces(shape, [chunk]) is pieces
    plain = Chunk(tuple(pieces), (0, 0), shape)
    for lo, hi in [((2, 0), (5, 5)), ((0, 1), (7, 3)), ((6, 4), (7, 5))]:
        (a,), (b,) = select_box(shape, [chunk], lo, hi), select_box(shape, [plain], lo, hi)
        assert list(a.pieces) == list(b.pieces) and a.offsets == b.offsets and a.sizes == b.sizes
    (rows,) = select_box(shape, [chunk], (2, 0), (5, 5))
    assert isinstance(rows.pieces, StridedPieces)  # one run: still computed on demand
