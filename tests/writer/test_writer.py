"""The one writer (``orchestrator.write``, which consumes an ``ExportPlan``) and its commit
strategies, directly.

Fast tests on synthetic plans (tensors produced on request: ``LivePiece``; or byte ranges of a
file) for the paths an engine run never takes (``renameat2`` missing, a held lock, a commit interrupted halfway, ``copy_file_range`` failing or absent), and
one real ``torchrun`` (gloo, 2 ranks) save whose tensors are read by collectives, failing in
the middle of a shard on one rank: no deadlock, nothing partial, the same error on every rank.
"""

import errno
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hf_ckpt_integrations import commit, orchestrator, writer
from hf_ckpt_integrations.commit import MergeIntoCheckpoint, SiblingSwap
from hf_ckpt_integrations.formats import file_ranges
from hf_ckpt_integrations.errors import CheckpointError, DestinationError
from hf_ckpt_integrations.orchestrator import write
from hf_ckpt_integrations.plan import ExportPlan, LivePiece, Piece, TensorPlan
from helpers import REPO, leftovers, load_safetensors



def _produced(name, shape, chunks):
    """An fp32 tensor of ``shape`` whose bytes ``chunks()`` yields when the writer asks."""
    numel = int(np.prod(shape))
    return TensorPlan(name, tuple(shape), "F32", [[LivePiece(lambda lo, hi, writer, dtype: chunks(), 0, numel, "F32")]],
                      kind="live", out_dtype="F32")


def _plan(tensors):
    return ExportPlan("test", "synthetic", None, list(tensors))


def _tensors(n=4, rows=8, cols=16, seed=0):
    out, arrays = [], {}
    for k in range(n):
        a = (np.arange(rows * cols, dtype=np.float32) + 1000 * k + seed).reshape(rows, cols)
        arrays[f"w.{k}"] = a
        out.append(_produced(f"w.{k}", a.shape, lambda a=a: iter((memoryview(a.tobytes()),))))
    return _plan(out), arrays


def _state(directory):
    out = {}
    for p in sorted(Path(directory).glob("*.safetensors")):
        out.update({k: v.numpy() for k, v in load_safetensors(p).items()})
    return out


def _assert_state(directory, arrays):
    got = _state(directory)
    assert sorted(got) == sorted(arrays)
    for k, a in arrays.items():
        assert np.array_equal(got[k], a), k


# ------------------------------------------------------------------ SiblingSwap


@pytest.mark.parametrize("overwrite", [False, True])
def test_sibling_swap_without_renameat2_falls_back_to_plain_renames(tmp_path, monkeypatch, overwrite):
    """Where renameat2 (or its flag) is missing the swap is two renames; the result is the same."""
    calls = []
    monkeypatch.setattr(commit, "_renameat2", lambda *a: calls.append(a) or False)
    dst = tmp_path / "out"
    if overwrite:
        old, _ = _tensors(seed=7)
        write(old, SiblingSwap(dst), max_shard_size=600)
        assert calls  # the fallback ran for the first export too
    tensors, arrays = _tensors()
    write(tensors, SiblingSwap(dst, overwrite=overwrite), max_shard_size=600)
    _assert_state(dst, arrays)
    assert (dst / writer.INDEX_NAME).exists()
    assert leftovers(tmp_path) == []


def test_sibling_swap_refuses_while_the_lock_is_held(tmp_path):
    dst = tmp_path / "out"
    lock = tmp_path / ".out.hfckpt-lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"4242\n")
        tensors, _ = _tensors()
        with pytest.raises(DestinationError, match=r"another export into it is running \(pid 4242 holds"):
            write(tensors, SiblingSwap(dst))
    finally:
        os.close(fd)
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == [lock.name]
    write(tensors, SiblingSwap(dst))  # the holder is gone: the next writer takes the lock
    assert dst.is_dir() and leftovers(tmp_path) == []


def test_a_failing_shard_leaves_nothing_and_keeps_the_previous_export(tmp_path):
    dst = tmp_path / "out"
    old, old_arrays = _tensors(seed=3)
    write(old, SiblingSwap(dst), max_shard_size=600)
    tensors, _ = _tensors()

    def broken():
        yield memoryview(b"\0" * 8)
        raise OSError(errno.ENOSPC, "No space left on device")

    tensors.tensors[2] = _produced("w.2", (8, 16), broken)
    with pytest.raises(DestinationError, match="no space left while writing"):
        write(tensors, SiblingSwap(dst, overwrite=True), max_shard_size=600)
    _assert_state(dst, old_arrays)
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------ MergeIntoCheckpoint


def _checkpoint_dir(tmp_path):
    """A checkpoint directory holding an earlier sharded save and files that are not weights."""
    d = tmp_path / "checkpoint-4"
    old, old_arrays = _tensors(n=6, seed=5)
    write(old, MergeIntoCheckpoint(d), max_shard_size=600)
    assert len(list(d.glob("model-*.safetensors"))) == 6
    (d / "trainer_state.json").write_text("{}")
    (d / "global_step4").mkdir()
    (d / "global_step4" / "optim.pt").write_bytes(b"optimizer")
    return d, old_arrays


def test_merge_replaces_the_previous_weight_set_and_keeps_other_files(tmp_path):
    d, _ = _checkpoint_dir(tmp_path)
    tensors, arrays = _tensors(n=2)
    report = write(tensors, MergeIntoCheckpoint(d), max_shard_size="5GB")
    assert report["files"] == ["model.safetensors"]
    assert sorted(p.name for p in d.iterdir()) == ["global_step4", "model.safetensors", "trainer_state.json"]
    assert (d / "global_step4" / "optim.pt").read_bytes() == b"optimizer"
    _assert_state(d, arrays)
    assert leftovers(tmp_path) == []


def test_merge_interrupted_mid_move_is_finished_by_the_next_writer(tmp_path, monkeypatch):
    """A crash after the journal, in the middle of moving the new set in: the directory holds no
    index naming a file of the other set, and the next writer into it rolls the commit forward."""
    d, _ = _checkpoint_dir(tmp_path)
    tensors, arrays = _tensors(n=4, seed=9)
    real_replace, moved = os.replace, []

    def crash_after_two(src, dst):
        if str(src).startswith(str(d / commit.STAGING_NAME)) and not str(src).endswith(".tmp"):
            if len(moved) == 2:
                raise KeyboardInterrupt("power loss")
            moved.append(dst)
        return real_replace(src, dst)

    monkeypatch.setattr(commit.os, "replace", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        write(tensors, MergeIntoCheckpoint(d), max_shard_size=600)
    monkeypatch.setattr(commit.os, "replace", real_replace)
    assert not (d / writer.INDEX_NAME).exists()  # the old index went first; the new one is not in yet
    assert (d / commit.STAGING_NAME / ".hfckpt-commit.json").exists()

    strategy = MergeIntoCheckpoint(d)
    strategy._lock.acquire()
    try:
        assert strategy.recover()
    finally:
        strategy._lock.release()
    _assert_state(d, arrays)  # the new set, complete; the previous save's extra shards removed
    index = json.loads((d / writer.INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(arrays)
    assert sorted(p.name for p in d.glob("model-*")) == sorted(set(index["weight_map"].values()))
    assert not (d / commit.STAGING_NAME).exists()


def test_merge_unfinished_staging_is_removed_and_the_lock_refuses_a_second_writer(tmp_path):
    d, old_arrays = _checkpoint_dir(tmp_path)
    crashed = MergeIntoCheckpoint(d)
    crashed.begin()
    (d / commit.STAGING_NAME / "model-00001-of-00002.safetensors").write_bytes(b"partial")  # no journal
    crashed._release()  # the writer stops here, as in a crash: its marked staging directory stays
    first = MergeIntoCheckpoint(d)
    first.begin()
    try:
        assert os.listdir(first.path) == []  # the unfinished staging directory was cleared
        tensors, _ = _tensors()
        with pytest.raises(DestinationError, match="another export into it is running"):
            write(tensors, MergeIntoCheckpoint(d))
    finally:
        first.abort()
    _assert_state(d, old_arrays)
    assert not (d / commit.STAGING_NAME).exists() and leftovers(tmp_path) == []


# ------------------------------------------------------------------ the copy itself


@pytest.mark.parametrize("how", ["exdev", "absent"])
def test_pread_fallback_when_copy_file_range_fails_or_is_missing(tmp_path, monkeypatch, how):
    """FileRange chunks are copied by the kernel; where copy_file_range fails (EXDEV: another
    file system) or does not exist, the same bytes come through pread in bounded blocks."""
    src = tmp_path / "src.bin"
    payload = np.random.default_rng(0).integers(0, 2**32, size=5000, dtype=np.uint32).tobytes()
    src.write_bytes(b"HEAD" + payload)
    pieces = [Piece(str(src), 4, 1500, "F32"), Piece(str(src), 4 + 6000, 3500, "F32")]  # two byte ranges
    t = TensorPlan("x", (5000,), "F32", [pieces], out_dtype="F32")
    calls = []
    if how == "exdev":
        def refuse(*a):
            calls.append(a)
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    else:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    reads = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: reads.append(len(bufs[0])) or real_preadv(fd, bufs, off))
    monkeypatch.setattr(file_ranges, "BLOCK", 4096)  # several blocks per range
    write(_plan([t]), SiblingSwap(tmp_path / "out"))
    got = load_safetensors(tmp_path / "out" / "model.safetensors")["x"].numpy().tobytes()
    assert got == payload
    assert max(reads) <= 4096 and sum(reads) == len(payload)
    assert (1 <= len(calls) <= len(pieces)) if how == "exdev" else not calls  # not retried within a range


def test_copy_file_range_real_errors_are_not_swallowed(tmp_path, monkeypatch):
    src = tmp_path / "src.bin"
    src.write_bytes(b"\0" * 64)

    def eio(*a):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "copy_file_range", eio)
    t = TensorPlan("x", (16,), "F32", [[Piece(str(src), 0, 16, "F32")]], out_dtype="F32")
    with pytest.raises(CheckpointError, match="Input/output error"):
        write(_plan([t]), SiblingSwap(tmp_path / "out"))
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ assignment


def test_shards_are_assigned_once_and_sources_receive_the_assignment(tmp_path, monkeypatch):
    plan, arrays = _tensors(n=5)
    seen, reads = [], []
    real_assign = orchestrator.assign
    monkeypatch.setattr(orchestrator, "assign", lambda *a, **k: seen.append(real_assign(*a, **k)) or seen[-1])
    for t in plan.tensors:  # each read learns the rank that writes its tensor, and the output dtype
        (piece,), = t.parts
        read = piece.read
        t.parts = [[LivePiece(lambda lo, hi, w, d, name=t.name, read=read: reads.append((name, w, d)) or
                              read(lo, hi, w, d), piece.lo, piece.hi, piece.dtype)]]
    report = write(plan, SiblingSwap(tmp_path / "out"), max_shard_size=600)
    (a,) = seen
    assert [f for f, _ in a.shards] == report["shard_files"] and a.ranks == [0] * 5
    assert all(a.writer_of(n) == 0 for n in arrays)
    assert sorted(reads) == [(n, 0, "F32") for n in sorted(arrays)]
    assert real_assign(writer.plan_tensors(plan, None, None), 600, 3).ranks == [0, 1, 2, 0, 1]
    _assert_state(tmp_path / "out", arrays)


# ------------------------------------------------------------------ a collective save, in real processes


@pytest.mark.engine
def test_collective_save_failing_mid_shard_on_one_rank(tmp_path):
    """Rank 1's disk fills up (RLIMIT_FSIZE: a real EFBIG) in the middle of its first shard, in the
    middle of a tensor whose chunks are broadcasts: rank 1 keeps up the collectives, nobody hangs,
    both ranks raise the same WriteError naming rank 1, and the checkpoint directory keeps its
    previous weights untouched."""
    d, old_arrays = _checkpoint_dir(tmp_path)
    before = {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}
    script = REPO / "tests" / "scripts" / "collective_save.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(d), str(tmp_path / "seen"), "--max-shard-size", "150KB", "--fsize-limit-on-rank", "1:100000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / "seen" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for s in seen:
        assert s["raised"] and s["type"] == "WriteError", s
        assert list(s["failures"]) == ["1"], s
        assert s["failures"]["1"].startswith("writing model-00002-of-00004.safetensors: File too large"), s
    assert seen[0]["message"] == seen[1]["message"]
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before
    assert not (d / commit.STAGING_NAME).exists() and leftovers(tmp_path) == []
    _assert_state(d, old_arrays)


@pytest.mark.engine
def test_collective_save_writes_what_every_rank_contributed(tmp_path):
    d = tmp_path / "ckpt"
    script = REPO / "tests" / "scripts" / "collective_save.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(d), str(tmp_path / "seen")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / "seen" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert not seen[0]["raised"] and not seen[1]["raised"], seen
    assert [s["report"]["written_here"] for s in seen] == [
        ["model-00001-of-00004.safetensors", "model-00003-of-00004.safetensors"],
        ["model-00002-of-00004.safetensors", "model-00004-of-00004.safetensors"]]
    _assert_state(d, {f"layers.{k}.weight": (np.arange(64 * 256, dtype=np.float32) + 1000 * k).reshape(64, 256)
                      for k in range(8)})


@pytest.mark.engine
def test_zero3_partitions_go_point_to_point_to_the_writing_rank(tmp_path):
    """3 ranks (gloo), a 10-element parameter in partitions of 4, 4, 2: for every writing rank and
    element range, the writer gets exactly the range's bytes; each other rank sends only its
    overlap with the range, only to the writer; nothing is broadcast (traffic ÷ world size)."""
    script = REPO / "tests" / "scripts" / "zero3_p2p.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", str(script),
           str(tmp_path / "seen")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranges = [(0, 10), (3, 9), (4, 8), (9, 10)]
    for rank in range(3):
        seen = json.loads((tmp_path / "seen" / f"rank{rank}.json").read_text())
        assert seen["got"] == {f"{rank}:{lo}:{hi}": True for lo, hi in ranges}
        mine = (4 * rank, min(4 * rank + 4, 10))
        expected = [[w, 4 * (min(hi, mine[1]) - max(lo, mine[0]))] for w in range(3) if w != rank
                    for lo, hi in ranges if min(hi, mine[1]) > max(lo, mine[0])]
        assert seen["sends"] == expected, rank
