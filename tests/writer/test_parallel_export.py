"""Rank-parallel export in real processes (torchrun, or one process per rank started by hand): the
same bytes as a 1-process export without importing torch, a failure on one rank leaves nothing
behind, a rank that never arrives or dies mid-write ends the export with an error instead of a
hang. The rendezvous itself (:class:`~hf_ckpt_integrations.filecomm.FileComm`) is also driven
from threads of this process: its collectives, a stale session of an earlier run, a rendezvous
directory others can write."""

import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hf_ckpt_integrations import export_checkpoint
from hf_ckpt_integrations.comm import WriteError
from hf_ckpt_integrations.errors import DestinationError
from hf_ckpt_integrations.filecomm import FileComm, rendezvous_dir
from helpers import REPO

LAUNCHER = REPO / "tests" / "scripts" / "parallel_export.py"
SHARD = "100KB"  # the tiny matrix model (~0.6 MB in fp32) then spans several shards
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
JOB = {"MASTER_ADDR": "", "MASTER_PORT": "", "TORCHELASTIC_RUN_ID": "", "TORCHELASTIC_RESTART_COUNT": ""}


def torchrun_export(src, dst, *args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(LAUNCHER), str(src), str(dst), *map(str, args)]
    env = {**os.environ, **ENV}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def ranks_by_hand(src, dst, *args, ranks=(0, 1), world=2, **env):
    """One launcher process per rank in ``ranks`` (``RANK``/``WORLD_SIZE`` only, no launcher of torch's)."""
    procs = [subprocess.Popen([sys.executable, str(LAUNCHER), str(src), str(dst), *map(str, args)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **ENV, **JOB, "RANK": str(r), "WORLD_SIZE": str(world), **env})
             for r in ranks]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append((p.returncode, stdout, stderr))
    return out


def leftovers(parent: Path):
    return [p.name for p in parent.iterdir() if ".hfckpt-tmp-" in p.name or ".hfckpt-rdzv-" in p.name]


@pytest.mark.engine
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_two_ranks_write_the_bytes_of_one_process(dtype, engine_ckpt, tmp_path):
    case = engine_ckpt("z3-fp32")
    src, config = case / "ckpt", case / "config"
    one = tmp_path / "one"
    export_checkpoint(src, one, dtype=dtype, max_shard_size=SHARD, config=str(config))  # fills the layout cache
    proc = torchrun_export(src, tmp_path / "par", "--config", config, "--dtype", dtype, "--max-shard-size", SHARD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in one.iterdir())
    assert sum(n.endswith(".safetensors") for n in names) >= 4, names
    assert sorted(p.name for p in (tmp_path / "par").iterdir()) == names
    for n in names:
        assert (tmp_path / "par" / n).read_bytes() == (one / n).read_bytes(), n
    assert leftovers(tmp_path) == []
    # The ranks met through files: neither imported torch (only torchrun itself did).
    assert "rank 0: torch imported: no" in proc.stdout and "rank 1: torch imported: no" in proc.stdout, proc.stdout


@pytest.mark.engine
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


@pytest.mark.engine
def test_a_rank_that_never_arrives_ends_the_export_with_a_timeout(engine_ckpt, tmp_path):
    case = engine_ckpt("z3-fp32")
    [(rc, out, err)] = ranks_by_hand(case / "ckpt", tmp_path / "out", "--config", case / "config",
                                     "--max-shard-size", SHARD, ranks=(0,), HFCKPT_PARALLEL_TIMEOUT="2")
    assert rc == 2, err[-3000:]
    assert "rank 1: never arrived within 2 s (HFCKPT_PARALLEL_TIMEOUT)" in err, err[-3000:]
    assert err.count("error:") == 1
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


@pytest.mark.engine
def test_a_rank_that_dies_mid_write_ends_the_export_and_leaves_nothing(engine_ckpt, tmp_path):
    case = engine_ckpt("z3-fp32")
    # Rank 1 is killed by the kernel (SIGXFSZ) on its first shard: no message, no done file; only
    # its heartbeat stops. Started by hand: torchrun would end rank 0 itself.
    (rc0, _, err0), (rc1, _, _) = ranks_by_hand(case / "ckpt", tmp_path / "out", "--config", case / "config",
                                                "--max-shard-size", SHARD, "--die-on-rank", "1:4096",
                                                HFCKPT_PARALLEL_STALE="2")
    assert rc1 < 0  # killed by the signal
    assert rc0 == 2, err0[-3000:]
    assert "rank 1: no sign of life for 2 s (HFCKPT_PARALLEL_STALE)" in err0, err0[-3000:]
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


# -- the rendezvous, from threads of this process ------------------------------------------------


def run_ranks(world, body, dst, wait=60, **kw):
    """``body(comm)`` on ``world`` ranks (threads), each inside its own FileComm; returns each rank's
    result or exception (None: still running after ``wait`` seconds)."""
    results = [None] * world

    def rank(r):
        try:
            with FileComm(str(dst), r, world, what="test", **kw) as comm:
                results[r] = body(comm)
        except BaseException as e:  # noqa: B902 - the test inspects it
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait)
    return results


def test_collectives_give_every_rank_the_same_answer(tmp_path, monkeypatch):
    for k, v in JOB.items():
        monkeypatch.setenv(k, v)

    def body(comm):
        got = [comm.broadcast({"staging": "x", "rank": comm.rank}), comm.all_gather(comm.rank * 10)]
        comm.barrier()
        try:
            comm.all_ok("disk full" if comm.rank == 2 else None, "writing")
        except WriteError as e:
            got.append(e.failures)
        return got

    results = run_ranks(3, body, tmp_path / "out")
    assert results == [[{"staging": "x", "rank": 0}, [0, 10, 20], {2: "disk full"}]] * 3
    assert leftovers(tmp_path) == []


def test_a_rank_failing_outside_a_collective_releases_the_others_at_once(tmp_path, monkeypatch):
    """Rank 0 raises before its broadcast while rank 1 waits for it: its done file says why, rank 1
    raises instead of waiting for a heartbeat to stop (rank 0 itself waits for rank 1's done)."""
    for k, v in JOB.items():
        monkeypatch.setenv(k, v)

    def body(comm):
        if comm.rank == 0:
            raise ValueError("the plan was refused")
        return comm.broadcast(None)

    results = run_ranks(2, body, tmp_path / "out", wait=20)
    assert isinstance(results[0], ValueError)
    assert isinstance(results[1], WriteError), results
    assert results[1].failures == {0: "left the export before this step: ValueError: the plan was refused"}
    assert leftovers(tmp_path) == []


def test_a_session_left_by_an_earlier_run_is_not_joined(tmp_path, monkeypatch):
    for k, v in JOB.items():
        monkeypatch.setenv(k, v)
    root = Path(rendezvous_dir(str(tmp_path / "out"), 2))
    # An earlier run crashed after its rank 0 welcomed rank 1 and broadcast a staging directory.
    stale = root / "0123abcd"
    stale.mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (root / "current").write_text("0123abcd")
    (stale / "welcome").write_bytes(pickle.dumps({"nonces": {0: "0123abcd", 1: "feedbeef"}}))
    (stale / "1.b").write_bytes(pickle.dumps("the old run's staging"))
    (stale / "alive-0").write_text("0123abcd 7")
    results = run_ranks(2, lambda comm: comm.broadcast("new" if comm.rank == 0 else None), tmp_path / "out")
    assert results == ["new", "new"]
    assert not root.exists()


def test_a_rendezvous_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    for k, v in JOB.items():
        monkeypatch.setenv(k, v)
    root = Path(rendezvous_dir(str(tmp_path / "out"), 2))
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(DestinationError, match="closed to others"):
        with FileComm(str(tmp_path / "out"), 0, 2, what="test", timeout=5):
            pass
    assert root.is_dir()  # not ours: left as it is
