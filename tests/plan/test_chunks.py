"""N-D chunk placement (``plan.Chunk``): the tiling check on synthetic metadata (milliseconds), the
byte-copy fast path, and N-D assembly against numpy's own slicing, bitwise."""

import math
import random

import numpy as np
import pytest

from hf_ckpt_integrations.assemble import assemble_chunks, iter_bytes
from hf_ckpt_integrations.plan import (Chunk, ExportPlan, Piece, TensorPlan, check_plan, check_tiling,
                                       parts_as_chunks, row_major_pieces)
from hf_ckpt_integrations.mapped_files import MappedFiles


def _chunk(offsets, sizes, path="f", start=0):
    return Chunk((Piece(path, start, math.prod(sizes), "F32"),), tuple(offsets), tuple(sizes))


def _grid(shape, splits):
    """Chunks of a regular grid: ``splits[d]`` blocks along dim d (the last one takes the remainder)."""
    axes = []
    for d, n in zip(shape, splits):
        step = -(-d // n)
        axes.append([(o, min(step, d - o)) for o in range(0, d, step)])
    out = [((), ())]
    for ax in axes:
        out = [(o + (a,), s + (b,)) for o, s in out for a, b in ax]
    return [_chunk(o, s) for o, s in out]


@pytest.mark.parametrize("shape,splits", [((8, 6), (2, 3)), ((7, 5), (3, 2)), ((4, 6, 10), (2, 1, 5)),
                                          ((10,), (4,)), ((5, 4), (1, 1))])
def test_grids_tile(shape, splits):
    """FSDP x TP style 2-D (and 3-D) grids, uneven last blocks included, tile their shape."""
    check_tiling(shape, _grid(shape, splits))


def test_gap_overlap_and_out_of_bounds_are_named():
    shape = (8, 6)
    chunks = _grid(shape, (2, 3))
    with pytest.raises(ValueError, match="a gap"):
        check_tiling(shape, chunks[:-1])
    with pytest.raises(ValueError, match="overlap"):
        check_tiling(shape, chunks[:-1] + [_chunk((3, 3), (2, 2))])  # covers 4 = the missing 4 elements, but overlaps
    with pytest.raises(ValueError, match="outside the shape"):
        check_tiling(shape, chunks[:-1] + [_chunk((4, 4), (4, 3))])
    with pytest.raises(ValueError, match="pieces hold"):
        check_tiling((2, 2), [Chunk((Piece("f", 0, 3, "F32"),), (0, 0), (2, 2))])
    with pytest.raises(ValueError, match="3-D tensor"):
        check_tiling((2, 2, 2), [_chunk((0, 0), (2, 2))])
    # An overlap that keeps the element count right (one chunk twice, another missing) is still caught.
    with pytest.raises(ValueError, match="overlap"):
        check_tiling(shape, chunks[:-1] + [chunks[0]])


def test_many_chunks_check_in_milliseconds():
    """A 64 x 64 grid (4096 chunks), shuffled: the sweep stays near N log N (no timing assertion:
    an O(N^2) check of every pair would still pass, slowly). What it must do at this size is decide:
    the whole grid tiles, the grid less one chunk has a gap, one chunk twice overlaps."""
    chunks = _grid((640, 640), (64, 64))
    random.Random(0).shuffle(chunks)
    check_tiling((640, 640), chunks)
    with pytest.raises(ValueError, match="a gap"):
        check_tiling((640, 640), chunks[:2000] + chunks[2001:])
    with pytest.raises(ValueError, match="overlap"):
        check_tiling((640, 640), chunks[:2000] + chunks[2001:] + [chunks[0]])


def test_tp_parts_are_chunks_along_the_cat_dim():
    parts = [[Piece("a", 0, 12, "F32")], [Piece("b", 0, 12, "F32")]]
    chunks = parts_as_chunks((4, 6), parts, [(4, 3), (4, 3)], cat_dim=1)
    assert [(c.offsets, c.sizes) for c in chunks] == [((0, 0), (4, 3)), ((0, 3), (4, 3))]
    check_tiling((4, 6), chunks)
    assert row_major_pieces((4, 6), chunks) is None  # column slices: assembled, not copied
    rows = parts_as_chunks((8, 3), parts, [(4, 3), (4, 3)], cat_dim=0)
    assert row_major_pieces((8, 3), rows[::-1]) == [parts[0][0], parts[1][0]]  # in offset order


def test_check_plan_refuses_slices_that_do_not_tile():
    """TP slices that disagree off the cat dim used to reach torch.cat at write time; now the plan is refused."""
    from hf_ckpt_integrations.errors import LayoutError

    t = TensorPlan("w", (4, 7), "F32", [[Piece("a", 0, 12, "F32")], [Piece("b", 0, 16, "F32")]], cat_dim=1,
                   part_shapes=[(4, 3), (4, 4)])
    plan = ExportPlan("x", "src", None, [t])
    check_plan(plan)
    t.part_shapes = [(4, 3), (5, 4)]
    t.parts[1] = [Piece("b", 0, 20, "F32")]
    with pytest.raises(LayoutError, match="do not tile"):
        check_plan(plan)


@pytest.mark.parametrize("dtype,np_dtype", [("F32", np.float32), ("BF16", np.uint16), ("I64", np.int64)])
def test_nd_chunks_assemble_bitwise(tmp_path, dtype, np_dtype):
    """Blocks of a 3-D tensor stored in two files, in shuffled order: assembled bytes == the tensor's,
    for the writer's stream (iter_bytes) and any dtype (bf16 as its bits)."""
    rng = np.random.default_rng(0)
    shape = (4, 6, 5)
    full = rng.integers(0, 2**15, size=shape).astype(np_dtype)
    grid = _grid(shape, (2, 3, 2))
    random.Random(1).shuffle(grid)
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    blobs = [bytearray(b"junk"), bytearray()]
    chunks = []
    for i, c in enumerate(grid):
        box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
        raw = np.ascontiguousarray(full[box]).tobytes()
        blob = blobs[i % 2]
        chunks.append(Chunk((Piece(str(files[i % 2]), len(blob), c.numel, dtype),), c.offsets, c.sizes))
        blob += raw
    for f, b in zip(files, blobs):
        f.write_bytes(bytes(b))
    t = TensorPlan.from_chunks("w", shape, dtype, chunks)
    check_plan(ExportPlan("x", "src", None, [t]))
    assert not t.is_byte_copy
    decided = dtype
    t.out_dtype = decided
    with MappedFiles() as mf:
        assert bytes(assemble_chunks(shape, chunks, mf)) == full.tobytes()
        assert b"".join(bytes(c) for c in iter_bytes(t, decided, mf)) == full.tobytes()


def test_row_slices_keep_the_byte_copy_path(tmp_path):
    """Chunks that are whole rows along dim 0 are copied as file ranges (no assembly)."""
    from hf_ckpt_integrations.assemble import FileRange

    f = tmp_path / "w.bin"
    data = np.arange(24, dtype=np.float32)
    f.write_bytes(data[12:].tobytes() + data[:12].tobytes())
    chunks = [Chunk((Piece(str(f), 48, 12, "F32"),), (0, 0), (2, 6)),
              Chunk((Piece(str(f), 0, 12, "F32"),), (2, 0), (2, 6))]
    t = TensorPlan.from_chunks("w", (4, 6), "F32", chunks)
    assert t.is_byte_copy
    with MappedFiles() as mf:
        got = list(iter_bytes(t, "F32", mf, ranges=True))
    assert all(isinstance(r, FileRange) for r in got) and [r.offset for r in got] == [48, 0]


def test_inspect_json_shows_chunks_and_the_decided_dtype():
    from hf_ckpt_integrations.plan import decide_dtypes

    t = TensorPlan("w", (4, 6), "F32", [[Piece("a", 0, 12, "F32")], [Piece("b", 0, 12, "F32")]], cat_dim=1,
                   part_shapes=[(4, 3), (4, 3)])
    plan = decide_dtypes(ExportPlan("x", "src", None, [t], dtypes={"master": "F32"}), "bf16")
    (row,) = plan.summary()["tensors"]
    assert row["chunks"] == [{"offsets": [0, 0], "sizes": [4, 3], "pieces": 1},
                             {"offsets": [0, 3], "sizes": [4, 3], "pieces": 1}]
    assert row["out_dtype"] == "BF16" and plan.summary()["out_dtype"] == "BF16"
