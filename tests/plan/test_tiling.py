"""``plan.check_tiling`` decides exactly (against a brute-force count of every element) and in
time linear in the number of chunks, whatever their layout: a small ``.metadata`` can record tens
of thousands of chunks sharing rows. Synthetic metadata only (milliseconds)."""

import math
import random
import signal
from contextlib import contextmanager

import numpy as np
import pytest

from hf_ckpt_integrations.plan import Chunk, Piece, check_tiling


def _box(offsets, sizes):
    return Chunk((Piece("f", 0, math.prod(sizes), "F32"),), tuple(offsets), tuple(sizes))


def _expected(shape, chunks):
    """The brute-force answer: None (tiles), "overlap" (some element held twice: named first) or
    "a gap"."""
    count = np.zeros(shape, dtype=np.int64)
    for c in chunks:
        count[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
    if (count == 1).all():
        return None
    return "overlap" if (count > 1).any() else "a gap"


def _random_layout(rng, shape):
    """A random grid tiling of ``shape``, then with probability 1/2 one chunk dropped, duplicated,
    moved or resized (sizes kept in bounds)."""
    axes = []
    for d in shape:
        cuts = sorted(rng.sample(range(1, d), rng.randint(0, d - 1))) if d > 1 else []
        edges = [0, *cuts, d]
        axes.append(list(zip(edges[:-1], edges[1:])))
    boxes = [((), ())]
    for ax in axes:
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in ax]
    chunks = [_box(o, s) for o, s in boxes]
    if rng.random() < 0.5:
        k = rng.randrange(len(chunks))
        how = rng.choice(["drop", "twice", "move", "resize"])
        if how == "drop":
            del chunks[k]
        elif how == "twice":
            chunks.append(chunks[k])
        else:
            c = chunks[k]
            if how == "move":
                sizes = c.sizes
                offsets = tuple(rng.randint(0, d - s) for d, s in zip(shape, sizes))
            else:
                offsets = c.offsets
                sizes = tuple(rng.randint(1, d - o) for d, o in zip(shape, offsets))
            chunks[k] = _box(offsets, sizes)
    rng.shuffle(chunks)
    return chunks


def test_decision_matches_a_count_of_every_element():
    """1,000 random 1-D to 4-D layouts, half of them broken: accepted exactly when every element is
    held once, refused naming a gap or an overlap as the count says."""
    rng = random.Random(0)
    seen = {None: 0, "a gap": 0, "overlap": 0}
    for _ in range(1000):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        chunks = _random_layout(rng, shape)
        want = _expected(shape, chunks)
        seen[want] += 1
        if want is None:
            check_tiling(shape, chunks)
        else:
            with pytest.raises(ValueError, match=want):
                check_tiling(shape, chunks)
    assert min(seen.values()) > 50, seen  # every outcome exercised


def test_overlap_not_beside_each_other_in_offset_order():
    """A chunk overlaps one that is not its neighbour in offset order, and the element counts agree:
    a check of neighbours only would accept it."""
    chunks = [_box((0, 0), (2, 2)), _box((0, 2), (1, 1)), _box((1, 0), (1, 1))]
    with pytest.raises(ValueError, match="chunks 0 and 2 overlap"):
        check_tiling((2, 3), chunks)


@contextmanager
def _hang_bound(seconds):
    """Fail (not wait) when the check does not finish: a bound for a hang, far above the
    milliseconds it takes, not a timing assertion."""
    def stop(signum, frame):
        raise AssertionError(f"check_tiling still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("broken", [None, "twice", "widened"])
def test_thirty_thousand_one_element_chunks_in_one_row(broken):
    """What a 0.9 MB ``.metadata`` can record: 30,000 one-element chunks of one row. Checked in a
    fraction of a second (a pairwise sweep never finished); refused as quickly when one chunk is
    there twice or one is widened over its neighbour."""
    n = 30_000
    chunks = [_box((0, i), (1, 1)) for i in range(n)]
    if broken == "twice":
        chunks.append(chunks[n // 2])
    elif broken == "widened":
        chunks[n // 2] = _box((0, n // 2), (1, 2))
    with _hang_bound(60):
        if broken is None:
            check_tiling((1, n), chunks)
        else:
            with pytest.raises(ValueError, match="overlap"):
                check_tiling((1, n), chunks)

