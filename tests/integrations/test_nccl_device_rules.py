"""Save-time reads obey NCCL's device rules, checked on CPU with a fake device (tests/support/nccl_rules.py).

Three CPU processes save a ZeRO-3-partitioned model (tests/support/nccl_cases.py: the attributes
DeepSpeed attaches, read by the same ``live_tensors`` + ``write_distributed`` that
``accelerator.save_model`` runs) once per case: on plain gloo (the reference bytes), and under the
rules — partitions on the device, offloaded to the CPU, a script that never calls ``set_device``, a
rank out of device memory; and the same tensors as FSDP2 DTensors, on gloo and under the rules with
the shards on the device or in CPU memory (``CPUOffloadPolicy``). A fourth process measures each rank's device bytes at world 8 on torch's
fake process group. One launch for the whole module (about a minute on two cores).
"""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.support.nccl_cases import SHAPES
from tests.support.procs import wait_or_stop
from helpers import REPO

ROOT = str(REPO)
WORLD = 3
CASES = ["gloo", "device", "device-loose", "device-counted", "offload", "offload-loose", "bare", "oom", "broadcast",
         "broadcast-offload", "fsdp2-gloo", "fsdp2-device", "fsdp2-offload"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("nccl"))
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "tests", "support", "nccl_cases.py")
    procs = [subprocess.Popen([sys.executable, script, ",".join(CASES), str(r), str(WORLD), out], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=open(os.path.join(out, f"log-{r}"), "w"))
             for r in range(WORLD)]
    procs.append(subprocess.Popen([sys.executable, script, "memory", out], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=open(os.path.join(out, "log-memory"), "w")))
    for p in procs:
        wait_or_stop(p, 600)  # a hang (broken code) ends here, before any outer time limit
    results = {}
    for case in CASES:
        for r in range(WORLD):
            path = os.path.join(out, f"result-{case}-{r}.json")
            results[case, r] = json.load(open(path)) if os.path.exists(path) else {"outcome": "missing"}
    mem_path = os.path.join(out, "memory.json")
    memory = json.load(open(mem_path)) if os.path.exists(mem_path) else {}
    return out, results, memory


def _files(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


def _saved_like_gloo(runs, case):
    out, results, _ = runs
    for r in range(WORLD):
        assert results[case, r]["outcome"] == "ok", results[case, r].get("error", "")[:1500]
    reference = _files(os.path.join(out, "gloo"))
    assert reference and _files(os.path.join(out, case)) == reference


def test_the_reference_saves_on_plain_gloo(runs):
    _, results, _ = runs
    assert [results["gloo", r]["outcome"] for r in range(WORLD)] == ["ok"] * WORLD


def test_partitions_on_the_device_are_received_into_a_device_buffer(runs):
    """The writer's receive buffer is on its device (was ``torch.empty(b - a)`` on the CPU: the
    writer's receive raised, the senders waited for ever). Bare point-to-point allowed: this rule alone."""
    _saved_like_gloo(runs, "device-loose")


def test_point_to_point_is_batched(runs):
    """Every send and receive goes through ``batch_isend_irecv`` (a bare one is refused here)."""
    _saved_like_gloo(runs, "device")


def test_offloaded_partitions_are_staged_on_the_device(runs):
    """``offload_param: {device: cpu}``: partitions in CPU memory are copied to the device before they travel."""
    _saved_like_gloo(runs, "offload-loose")
    _saved_like_gloo(runs, "offload")


@pytest.mark.parametrize("case", ["broadcast", "broadcast-offload"])
def test_broadcast_reads_obey_the_rules(runs, case):
    """The broadcast path (AutoTP, a writer outside the ZeRO group): partitions on the device or
    offloaded, every rank's buffers on its device; the writer gets the bytes, the others copy nothing
    to the host."""
    _, results, _ = runs
    for r in range(WORLD):
        res = results[case, r]
        assert res["outcome"] == "ok", res.get("error", res["outcome"])[:1500]
    for r in range(WORLD):  # bf16: 2 bytes an element, only for the parameters this rank writes
        mine = sum(2 * math.prod(shape) for i, shape in enumerate(SHAPES.values()) if i % WORLD == r)
        assert results[case, r]["d2h"] == mine, (r, results[case, r])


def test_a_script_without_set_device_keeps_objects_off_device_zero(runs):
    """No ``set_device``: pickled objects travel on a gloo side group, tensors on device LOCAL_RANK."""
    _saved_like_gloo(runs, "bare")


def test_out_of_memory_on_one_rank_is_the_same_error_on_every_rank(runs):
    out, results, _ = runs
    errors = [results["oom", r].get("error", "") for r in range(WORLD)]
    assert [results["oom", r]["outcome"] for r in range(WORLD)] == ["raised"] * WORLD, errors
    assert len(set(errors)) == 1 and "OutOfMemoryError" in errors[0] and "rank(s) [1]" in errors[0], errors
    assert not os.path.isdir(os.path.join(out, "oom")) or not _files(os.path.join(out, "oom"))


def test_non_writing_ranks_move_nothing_to_the_host(runs):
    """Each rank copies to the host exactly the bytes of the tensors it writes (was: every tensor)."""
    from safetensors import safe_open

    out, results, _ = runs
    for r in range(WORLD):
        res = results["device-counted", r]  # nothing refused: only the host copies are looked at
        assert res["outcome"] == "ok", res.get("error", "")[:1500]
        mine = 0
        for name in res["written_here"]:
            with safe_open(os.path.join(out, "device-counted", name), "pt") as f:
                mine += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        assert res["d2h"] == mine, (r, res)


def test_device_memory_per_rank_at_world_8(runs):
    """Reading one parameter written by rank 0, world 8 (fake process group): the writer holds two
    partition buffers (and the 4-byte agreement flag), every other rank nothing beyond its partition
    and the flag, and only the writer copies to the host."""
    _, _, memory = runs
    zero3 = {k: m for k, m in memory.items() if k.isdigit()}
    assert len(zero3) == 8, memory
    for rank, m in zero3.items():
        assert "error" not in m, m["error"][:1500]
        if rank == "0":
            assert m["bytes"] == m["d2h"] == 8 * m["partition"]
            assert m["extra_peak"] <= 2 * m["partition"] + 64, m
        else:
            assert m["bytes"] == m["d2h"] == 0 and m["extra_peak"] <= 64, (rank, m)


@pytest.mark.parametrize("dim", [0, 1])
def test_tp_gather_holds_one_tensor_on_the_writer(runs, dim):
    """The ColossalAI hook's gather of a tensor split over 8 TP ranks along ``dim``, to rank 0: the
    writer holds the gathered tensor (plus one piece buffer when the split is not along dim 0), never
    the pieces and their concatenation side by side (was 1.875x the tensor); the others nothing new."""
    _, _, memory = runs
    for rank in range(8):
        m = memory[f"tp{dim}-{rank}"]
        assert "error" not in m, m["error"][:1500]
        if rank == 0:
            assert m["bytes"] == m["d2h"] == m["full"]
            assert m["extra_peak"] <= m["full"] + (m["piece"] if dim else 0) + 64, m
        else:
            assert m["bytes"] == m["d2h"] == 0 and m["extra_peak"] <= 64, (rank, m)


def _host_bytes_written(out, case, written_here, skip=("steps",)):
    """Bytes of the tensors in the files this rank wrote, except ``skip`` (plain CPU buffers read in place)."""
    from safetensors import safe_open

    total = 0
    for name in written_here:
        with safe_open(os.path.join(out, case, name), "pt") as f:
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys() if k not in skip)
    return total


@pytest.mark.parametrize("case", ["fsdp2-gloo", "fsdp2-device"])
def test_fsdp2_dtensors_save_like_gloo(runs, case):
    """FSDP2 DTensors (uneven ``Shard(0)``, a rank holding nothing) on gloo, and under the rules on a
    fake-device mesh with the shards on the device: the same bytes as the ZeRO-3 reference."""
    _saved_like_gloo(runs, case)


def test_cpu_offloaded_fsdp2_shards_are_moved_to_the_mesh_device(runs):
    """``CPUOffloadPolicy``: the local shards are in CPU memory while the mesh is the device's; each
    is moved to this rank's device before ``full_tensor()`` (its all-gather refuses a CPU tensor), as
    torch DCP does. (``fully_shard`` itself cannot run on the fake device: it sets each parameter's
    ``.data`` to the device copy, and torch refuses ``set_data`` between a plain tensor and a Python
    wrapper subclass; so the shards are built as ``fully_shard`` leaves them, tests/support/nccl_cases.py.)"""
    _saved_like_gloo(runs, "fsdp2-offload")


@pytest.mark.parametrize("case", ["fsdp2-device", "fsdp2-offload"])
def test_fsdp2_each_tensor_gathered_once_and_only_the_writer_copies_to_the_host(runs, case):
    """One all-gather per DTensor on every rank; each rank copies to the host exactly the bytes of
    the DTensors it writes (the others gather, as the collective needs, and drop)."""
    out, results, _ = runs
    for r in range(WORLD):
        res = results[case, r]
        assert res["outcome"] == "ok", res.get("error", "")[:1500]
        assert res["gathers"] == len(SHAPES), res
        assert res["d2h"] == _host_bytes_written(out, case, res["written_here"]), (r, res)
