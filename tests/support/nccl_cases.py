"""Save-time reads of a ZeRO-3-partitioned model, run by ``world`` CPU processes, with or without
NCCL's device rules (:mod:`tests.support.nccl_rules`) — test support only.

The model is a plain ``nn.Module`` whose parameters carry what DeepSpeed ZeRO-3 attaches
(``ds_id``, ``ds_shape``, ``ds_numel``, ``ds_status``, ``ds_process_group``, ``ds_tensor``: this rank's
partition of the flat parameter, the last one padded), and a persistent buffer: the same
attributes :mod:`hf_ckpt_integrations.sources.live` reads from a real engine, so the save path
(``live_tensors`` + ``write_distributed``, what ``accelerator.save_model`` runs) is exercised
without training. Each rank writes ``result-<rank>.json`` (outcome, error text, device byte counts).

Cases: ``gloo`` (CPU tensors, plain gloo: the reference bytes); ``device`` (partitions on this
rank's fake device, ``set_device`` called as Accelerate/DeepSpeed do); ``offload`` (partitions in
CPU memory: ``offload_param: {device: cpu}``); ``bare`` (like ``device``, but no ``set_device``);
``oom`` (``device``, and rank 1 runs out of device memory at its first partition-sized allocation).
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


def run(case, rank, world, out_dir, init_file):
    os.environ["LOCAL_RANK"] = str(rank)
    result = {"rank": rank, "case": case}
    try:
        if case != "gloo":
            sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
            from tests.support import nccl_rules

            nccl_rules.install(world)
            if case != "bare":
                torch.hfdev.set_device(rank)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        where = "cpu" if case in ("gloo", "offload") else f"hfdev:{rank}"
        module = build(rank, world, where)
        from hf_ckpt_integrations.integrations._dist import write_distributed
        from hf_ckpt_integrations.sources.live import live_tensors, reads_are_collective

        if case != "gloo":
            nccl_rules.reset_stats()
            if case == "oom" and rank == 1:
                nccl_rules.fail_next_alloc(8)
        plan = live_tensors(module)
        # One tensor a shard: the shards, and so the writers, are spread over the ranks.
        report = write_distributed(plan, os.path.join(out_dir, "save"), max_shard_size=64,
                                   collective=reads_are_collective(module), what="save")
        result.update(outcome="ok", written_here=report["written_here"])
    except Exception as e:  # the test reads what each rank saw
        result.update(outcome="raised", error=f"{type(e).__name__}: {e}")
    finally:
        if case != "gloo" and "nccl_rules" in sys.modules.get("tests.support", object()).__dict__:
            from tests.support import nccl_rules

            result.update(d2h=nccl_rules.STATS["d2h"], peak=nccl_rules.STATS["peak"])
        with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
            json.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
