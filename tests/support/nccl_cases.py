"""Save-time reads of a ZeRO-3-partitioned model, run by ``world`` CPU processes, with or without
NCCL's device rules (:mod:`tests.support.nccl_rules`) — test support only.

The model is a plain ``nn.Module`` whose parameters carry what DeepSpeed ZeRO-3 attaches
(``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_status``, ``ds_process_group``, ``ds_tensor``: this rank's
partition of the flat parameter, the last one padded), and a persistent buffer: the same
attributes :mod:`hf_ckpt_integrations.sources.live` reads from a real engine, so the save path
(``live_tensors`` + ``write_distributed``, what ``accelerator.save_model`` runs) is exercised
without training. Each rank writes ``result-<rank>.json`` (outcome, error text, device byte counts).

Cases (:data:`CASES`): ``gloo`` (CPU tensors, no rules: the reference bytes); ``device`` (partitions
on this rank's fake device, ``set_device`` called as Accelerate/DeepSpeed do); ``offload``
(partitions in CPU memory: ``offload_param: {device: cpu}``); ``bare`` (like ``device``, without
``set_device``); ``oom`` (rank 1 runs out of device memory at its first allocation while staging);
``broadcast``/``broadcast-offload``: every parameter read through the broadcast path;
``fsdp2-*``: the same tensors as FSDP2 DTensors (on gloo; under the rules with the shards on the
device, or in CPU memory as ``CPUOffloadPolicy`` leaves them);
``*-loose``: bare point-to-point allowed, to see the device rule alone; ``device-counted``: nothing
refused, bytes counted (what each rank copies to the host, even on code that breaks the rules). ``memory``: per-rank device
bytes at world 8 on torch's fake process group (:func:`memory`).

``python tests/support/nccl_cases.py CASE[,CASE...] RANK WORLD OUT_DIR`` (one process per rank), or
``python tests/support/nccl_cases.py memory OUT_DIR``.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

SHAPES = {"embed.weight": (10, 6), "layer.weight": (7, 5), "layer.bias": (7,), "head.weight": (3, 10)}


def full_tensors(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}


def build(rank, world, where):
    """The module as rank ``rank`` holds it; ``where``: ``"cpu"`` or a device for the partitions."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    module = torch.nn.Module()
    for i, (name, full) in enumerate(full_tensors().items()):
        owner_name, _, attr = name.rpartition(".")
        owner = getattr(module, owner_name, None)
        if owner is None:
            owner = torch.nn.Module()
            setattr(module, owner_name, owner)
        p = torch.nn.Parameter(torch.empty(0, dtype=full.dtype), requires_grad=False)
        n = -(-full.numel() // world)
        flat = torch.cat([full.reshape(-1), torch.zeros(n * world - full.numel(), dtype=full.dtype)])
        part = flat[rank * n:(rank + 1) * n].clone()
        p.ds_tensor = part if where == "cpu" else part.to(where)
        p.ds_id, p.ds_shape, p.ds_numel = i, tuple(full.shape), full.numel()
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        p.ds_process_group = dist.group.WORLD
        setattr(owner, attr, p)
    steps = torch.arange(4, dtype=torch.int64)
    module.register_buffer("steps", steps if where == "cpu" else steps.to(where))
    return module


def build_fsdp2(rank: int, world: int) -> torch.nn.Module:
    """The same tensors as FSDP2 holds them after training on gloo: DTensor parameters, each
    ``Shard(0)`` over a CPU mesh of the world (``torch.chunk``'s split: uneven, a rank may hold
    nothing). :func:`~tests.support.nccl_rules.save_under_rules` moves them to a fake-device mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh("cpu", list(range(world)))
    module = torch.nn.Module()
    for name, full in full_tensors().items():
        owner_name, _, attr = name.rpartition(".")
        owner = getattr(module, owner_name, None)
        if owner is None:
            owner = torch.nn.Module()
            setattr(module, owner_name, owner)
        chunks = torch.chunk(full, world, dim=0)
        local = chunks[rank].clone() if rank < len(chunks) else full[:0].clone()
        t = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
        setattr(owner, attr, torch.nn.Parameter(t, requires_grad=False))
    module.register_buffer("steps", torch.arange(4, dtype=torch.int64))
    return module


# case -> (partitions where, rules on, unbatched allowed, set_device called, rank that runs out of
# memory, refusals on)
CASES = {
    "gloo": ("cpu", False, False, True, None, True),
    "device": ("device", True, False, True, None, True),
    "device-loose": ("device", True, True, True, None, True),
    "device-counted": ("device", True, True, True, None, False),
    "offload": ("cpu", True, False, True, None, True),
    "offload-loose": ("cpu", True, True, True, None, True),
    "bare": ("device", True, False, False, None, True),
    "oom": ("device", True, False, True, 1, True),
    "broadcast": ("device", True, False, True, None, True),
    "broadcast-offload": ("cpu", True, False, True, None, True),
    # FSDP2 (DTensor parameters, :func:`build_fsdp2`): on a CPU mesh on gloo; on a fake-device mesh
    # with the shards on the device; with the shards in CPU memory (``CPUOffloadPolicy``).
    "fsdp2-gloo": ("cpu", False, False, True, None, True),
    "fsdp2-device": ("device", True, False, True, None, True),
    "fsdp2-offload": ("cpu", True, False, True, None, True),
}


def broadcast_reads(module, rank, world):
    """Each parameter read through the broadcast path (AutoTP's, or a writer outside the ZeRO group),
    written by rank ``i % world``: whether the writer got the parameter's bytes, and what the others got."""
    from hf_ckpt_integrations.sources.live import _partitions, _Reads

    reads, fulls, ok = _Reads(), full_tensors(), []
    for i, (name, p) in enumerate(module.named_parameters()):
        writer = i % world
        got = b"".join(bytes(c) for c in _partitions(p, None, 0, p.ds_numel, writer, reads.traffic))
        want = fulls[name].reshape(-1).view(torch.uint8).numpy().tobytes() if rank == writer else b""
        ok.append(got == want)
    return all(ok)


def run_case(case, rank, world, out_dir):
    from tests.support import nccl_rules

    where, on, loose, set_device, oom, refuse = CASES[case]
    nccl_rules.RULES.update(on=on, unbatched_ok=loose, refuse=refuse)
    torch.hfdev.set_device(rank if set_device else 0)
    result = {"rank": rank, "case": case}
    try:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'init-' + case)}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        module = None if case.startswith("fsdp2") else build(rank, world, "cpu" if where == "cpu" else f"hfdev:{rank}")
        from hf_ckpt_integrations.integrations._dist import write_distributed
        from hf_ckpt_integrations.sources.live import live_tensors, reads_are_collective

        if case.startswith("fsdp2"):
            nccl_rules.RULES["on"] = False  # built as training left it; the rules for the save only
            result.update(_fsdp2_save(build_fsdp2(rank, world), os.path.join(out_dir, case), on, where))
            return
        nccl_rules.reset_stats()
        if oom == rank:
            nccl_rules.fail_next_alloc(8)
        if case.startswith("broadcast"):
            result.update(outcome="ok" if broadcast_reads(module, rank, world) else "wrong bytes")
            return
        plan = live_tensors(module)
        # One tensor a shard: the shards, and so the writers, are spread over the ranks.
        report = write_distributed(plan, os.path.join(out_dir, case), max_shard_size=64,
                                   collective=reads_are_collective(module), what="save")
        result.update(outcome="ok", written_here=report["written_here"])
    except Exception as e:  # the test reads what each rank saw
        result.update(outcome="raised", error=f"{type(e).__name__}: {e}")
    finally:
        result.update(d2h=nccl_rules.STATS["d2h"], peak=nccl_rules.STATS["peak"])
        with open(os.path.join(out_dir, f"result-{case}-{rank}.json"), "w") as f:
            json.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def _fsdp2_save(module: torch.nn.Module, dst: str, rules: bool, where: str) -> dict:
    """Save ``module`` (FSDP2) as ``accelerator.save_model`` does; under the rules when ``rules``."""
    from tests.support import nccl_rules
    from hf_ckpt_integrations.integrations._dist import write_distributed
    from hf_ckpt_integrations.sources.live import live_tensors, reads_are_collective

    def save():
        report = write_distributed(live_tensors(module), dst, max_shard_size=64,
                                   collective=reads_are_collective(module), what="save")
        return {"outcome": "ok", "written_here": report["written_here"]}

    if not rules:
        return save()
    with nccl_rules.save_under_rules(module, where) as stats:
        out = save()
    return {**out, "gathers": stats["gathers"]}


def memory(out_dir, world=8, numel=8 * 1024):
    """Per-rank device bytes of reading one ``numel``-element bf16 parameter written by rank 0, each
    rank of ``world`` simulated in turn on torch's fake process group (no data moves)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.support import nccl_rules
    from hf_ckpt_integrations.sources.live import live_tensors

    SHAPES.clear()
    SHAPES["big.weight"] = (numel // 64, 64)
    out = {}
    for rank in range(world):
        os.environ["LOCAL_RANK"] = str(rank)
        torch.hfdev.set_device(rank)
        out[rank] = {}
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            module = build(rank, world, f"hfdev:{rank}")
            (t,) = [t for t in live_tensors(module).tensors if t.name == "big.weight"]
            piece = t.parts[0][0]
            nccl_rules.reset_stats()
            base = nccl_rules.STATS["live"]
            got = sum(len(c) for c in piece.read(piece.lo, piece.hi, 0, t.out_dtype))
            out[rank] = {"extra_peak": nccl_rules.STATS["peak"] - base, "d2h": nccl_rules.STATS["d2h"], "bytes": got,
                         "partition": module.big.weight.ds_tensor.numel() * 2}
        except Exception as e:
            out[rank] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        finally:
            dist.destroy_process_group()
    for dim in (0, 1):
        for rank in range(world):
            out[f"tp{dim}-{rank}"] = _tp_memory(rank, world, dim)
    with open(os.path.join(out_dir, "memory.json"), "w") as f:
        json.dump(out, f)


def _tp_memory(rank, world, dim, rows=256, cols=128):
    """Device bytes of gathering one bf16 ``(rows, cols)`` tensor split over ``world`` TP ranks
    along ``dim`` to rank 0 (the ColossalAI hook's read, :func:`~hf_ckpt_integrations.sources.colossalai.live_plan`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.support import nccl_rules
    from hf_ckpt_integrations.sources.colossalai import TensorInfo, live_plan

    os.environ["LOCAL_RANK"] = str(rank)
    torch.hfdev.set_device(rank)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        local_shape = (rows // world, cols) if dim == 0 else (rows, cols // world)
        module = torch.nn.Module()
        module.register_buffer("w", torch.zeros(local_shape, dtype=torch.bfloat16).to(f"hfdev:{rank}"))
        info = TensorInfo("w", "BF16", (rows, cols), holders={r: local_shape for r in range(world)},
                          groups=[tuple(range(world))], shard_dim=dim)
        (t,) = live_plan([info], module).tensors
        piece = t.parts[0][0]
        nccl_rules.reset_stats()
        base = nccl_rules.STATS["live"]
        got = sum(len(c) for c in piece.read(piece.lo, piece.hi, 0, t.out_dtype))
        return {"extra_peak": nccl_rules.STATS["peak"] - base, "d2h": nccl_rules.STATS["d2h"], "bytes": got,
                "full": rows * cols * 2, "piece": rows * cols * 2 // world}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        dist.destroy_process_group()


def main(argv):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.support import nccl_rules

    mode, out_dir = argv[0], argv[-1]
    if mode == "memory":
        nccl_rules.install(8)
        return memory(out_dir)
    rank, world = int(argv[1]), int(argv[2])
    os.environ["LOCAL_RANK"] = str(rank)
    nccl_rules.install(world)
    for case in mode.split(","):
        run_case(case, rank, world, out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
