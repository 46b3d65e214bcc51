"""The one box-selection helper of the plan (:func:`~hf_ckpt_integrations.plan.select_box` and the flat
range it is built on): metadata only, checked against numpy slicing of an ``arange`` in milliseconds."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_ckpt_integrations.plan import (Chunk, Piece, TensorPlan, box_runs, narrow_pieces, range_as_box,
                                       select_box)


def _read(pieces, disk):
    """The element ids ``pieces`` point at (``disk``: path -> array of ids, 4 bytes an element)."""
    return np.concatenate([disk[p.path][p.offset // 4:p.offset // 4 + p.numel] for p in pieces] or [np.empty(0, int)])


@st.composite
def _tiled(draw):
    """A shape, chunks tiling it (a grid of cuts per dim), each chunk's elements stored in a random file at a
    random offset and cut into random pieces; and a box inside the shape."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    ids = np.arange(math.prod(shape)).reshape(shape)
    cuts = [sorted(set(draw(st.lists(st.integers(1, max(1, d - 1)), max_size=2))) | {0, d}) if d > 1 else [0, d]
            for d in shape]
    disk, chunks = {}, []
    grid = np.array(np.meshgrid(*[range(len(c) - 1) for c in cuts], indexing="ij")).reshape(ndim, -1).T \
        if ndim else np.zeros((1, 0), int)
    for k, cell in enumerate(grid):
        lo = tuple(cuts[d][i] for d, i in enumerate(cell))
        hi = tuple(cuts[d][i + 1] for d, i in enumerate(cell))
        values = ids[tuple(slice(a, b) for a, b in zip(lo, hi))].reshape(-1)
        pad = draw(st.integers(0, 3))
        path = f"f{k % 2}-{k}"
        disk[path] = np.concatenate([np.full(pad, -1), values])
        bounds = sorted(set(draw(st.lists(st.integers(0, len(values)), max_size=3))) | {0, len(values)})
        pieces = tuple(Piece(path, 4 * (pad + a), b - a, "F32") for a, b in zip(bounds, bounds[1:]))
        chunks.append(Chunk(pieces, lo, tuple(b - a for a, b in zip(lo, hi))))
    lo = tuple(draw(st.integers(0, d - 1)) for d in shape)
    hi = tuple(draw(st.integers(a + 1, d)) for a, d in zip(lo, shape))
    return shape, ids, disk, chunks, lo, hi


@settings(max_examples=300, deadline=None)
@given(_tiled())
def test_select_box_equals_numpy_slicing(case):
    shape, ids, disk, chunks, lo, hi = case
    want = ids[tuple(slice(a, b) for a, b in zip(lo, hi))]
    out = np.full(want.shape, -2)
    picked = select_box(shape, chunks, lo, hi)
    for c in picked:
        assert all(o >= 0 and o + s <= w for o, s, w in zip(c.offsets, c.sizes, want.shape))
        out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = _read(c.pieces, disk).reshape(c.sizes)
    assert np.array_equal(out, want)
    # Only the box is read: every element selected once, none outside it.
    assert sum(p.numel for c in picked for p in c.pieces) == want.size


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=4), st.data())
def test_box_runs_are_the_row_major_elements_of_the_box(shape, data):
    lo = [data.draw(st.integers(0, d - 1)) for d in shape]
    hi = [data.draw(st.integers(a + 1, d)) for a, d in zip(lo, shape)]
    ids = np.arange(math.prod(shape)).reshape(shape)
    got = [i for start, n in box_runs(shape, lo, hi) for i in range(start, start + n)]
    assert got == ids[tuple(slice(a, b) for a, b in zip(lo, hi))].reshape(-1).tolist()


def test_range_as_box_is_exactly_the_ranges_that_are_boxes():
    assert range_as_box((), 0, 1) == ((), ())
    for shape in [(5,), (3, 4), (2, 3, 4), (2, 1, 3)]:
        ids = np.arange(math.prod(shape)).reshape(shape)
        n = ids.size
        for start in range(n):
            for count in range(1, n - start + 1):
                idx = np.array(np.unravel_index(np.arange(start, start + count), shape)).reshape(len(shape), -1)
                span = [(int(r.min()), int(r.max()) + 1) for r in idx]
                is_box = math.prod(b - a for a, b in span) == count
                box = range_as_box(shape, start, count)
                assert (box is not None) == is_box, (shape, start, count)
                if box is not None:
                    assert box == (tuple(a for a, _ in span), tuple(b for _, b in span))


def test_narrow_pieces_crosses_pieces_and_refuses_past_the_end():
    pieces = [Piece("a", 0, 3, "F32"), Piece("b", 100, 5, "F32")]
    assert narrow_pieces(pieces, 2, 3) == [Piece("a", 8, 1, "F32"), Piece("b", 100, 2, "F32")]
    assert narrow_pieces(pieces, 3, 5) == [Piece("b", 100, 5, "F32")]
    assert narrow_pieces(pieces, 8, 0) == []
    with pytest.raises(ValueError):
        narrow_pieces(pieces, 6, 3)


def test_select_box_refuses_a_box_outside_the_shape():
    with pytest.raises(ValueError, match="not inside"):
        select_box((2, 2), [Chunk((Piece("a", 0, 4, "F32"),), (0, 0), (2, 2))], (0, 1), (2, 3))


def test_narrowed_layer_of_a_stacked_tp_tensor_reads_that_layer_alone():
    """A stacked ``[L, 6, 4]`` tensor in two TP slices along dim 1: layer ``i`` is ``L`` times smaller than the
    tensor, and its plan holds only that layer's bytes (before: the whole tensor assembled, per layer)."""
    L = 5
    left = [Piece("tp0", 0, L * 3 * 4, "F32")]
    right = [Piece("tp1", 0, L * 3 * 4, "F32")]
    stacked = TensorPlan("qkv", (L, 6, 4), "F32", [left, right], cat_dim=1, part_shapes=[(L, 3, 4)] * 2)
    for i in range(L):
        layer = stacked.narrowed(f"layers.{i}.qkv", (6, 4), i * 24)
        assert layer.elem_range is None and layer.chunks is not None
        assert [(c.offsets, c.sizes, c.pieces) for c in layer.chunks] == [
            ((0, 0), (3, 4), (Piece("tp0", i * 48, 12, "F32"),)), ((3, 0), (3, 4), (Piece("tp1", i * 48, 12, "F32"),))]


def test_narrowed_keeps_padding_rows_out_and_narrows_replicas_and_sums():
    # Vocabulary padding: rows [0, 3) of a [4, 2] tensor in two TP slices; rows 1..3 of the kept tensor.
    t = TensorPlan("emb", (3, 2), "F32", [[Piece("a", 0, 4, "F32")], [Piece("b", 0, 4, "F32")]], cat_dim=0,
                   part_shapes=[(2, 2), (2, 2)], keep_rows=3)
    rows = t.narrowed("tail", (2, 2), 2)
    assert rows.flat_pieces() == [Piece("a", 8, 2, "F32"), Piece("b", 0, 2, "F32")]
    # Replicas of a single part narrow with it.
    r = TensorPlan("w", (2, 2), "F32", [[Piece("a", 0, 4, "F32")]], keep_rows=2, replicas=[[Piece("c", 0, 4, "F32")]])
    half = r.narrowed("w1", (2,), 2)
    assert half.flat_pieces() == [Piece("a", 8, 2, "F32")] and half.replicas == [[Piece("c", 8, 2, "F32")]]
    # A row-parallel sum: every addend narrowed, still summed.
    s = TensorPlan("b", (4,), "F32", [[Piece("a", 0, 4, "F32")], [Piece("b", 0, 4, "F32")]], reduce="sum",
                   part_shapes=[(4,), (4,)])
    tail = s.narrowed("b1", (2,), 2)
    assert tail.reduce == "sum" and tail.parts == [[Piece("a", 8, 2, "F32")], [Piece("b", 8, 2, "F32")]]
