"""Rank-parallel export in real processes (torchrun, 2 ranks, gloo on CPU): the same bytes as a
1-process export, and a failure on one rank leaves nothing behind."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_ckpt_integrations import export_checkpoint
from helpers import REPO

pytestmark = pytest.mark.engine

LAUNCHER = REPO / "tests" / "scripts" / "parallel_export.py"
SHARD = "100KB"  # the tiny matrix model (~0.6 MB in fp32) then spans several shards


def torchrun_export(src, dst, *args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(LAUNCHER), str(src), str(dst), *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def leftovers(parent: Path):
    return [p.name for p in parent.iterdir() if ".hfckpt-tmp-" in p.name]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_ranks_write_the_bytes_of_one_process(dtype, engine_ckpt, tmp_path):
    case = engine_ckpt("z3-fp32")
    src, config = case / "ckpt", case / "config"
    one = tmp_path / "one"
    export_checkpoint(src, one, dtype=dtype, max_shard_size=SHARD, config=str(config))
    proc = torchrun_export(src, tmp_path / "par", "--config", config, "--dtype", dtype, "--max-shard-size", SHARD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in one.iterdir())
    assert sum(n.endswith(".safetensors") for n in names) >= 4, names
    assert sorted(p.name for p in (tmp_path / "par").iterdir()) == names
    for n in names:
        assert (tmp_path / "par" / n).read_bytes() == (one / n).read_bytes(), n
    assert leftovers(tmp_path) == []


def test_a_failing_rank_leaves_no_output(engine_ckpt, tmp_path):
    case = engine_ckpt("z3-fp32")
    # Rank 1 gets a real EFBIG from the kernel on its first shard (RLIMIT_FSIZE, as on a full
    # quota); rank 0 writes its shards fine and must still roll everything back.
    proc = torchrun_export(case / "ckpt", tmp_path / "out", "--config", case / "config", "--max-shard-size", SHARD,
                           "--fsize-limit-on-rank", "1:4096")
    assert proc.returncode != 0
    assert "rank 1: writing model-00002-of-" in proc.stderr, proc.stderr[-3000:]
    assert "File too large" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []
