"""ZeRO-2 with ``round_robin_gradients``: a tiny ``nn.Module`` of parameters of distinct sizes, so
DeepSpeed's round-robin reordering of each flat group moves them.

Launched as ``torchrun --nproc_per_node N ds_round_robin.py OUT [--dtype bf16|fp32]``. Writes
``OUT/ckpt/`` (``engine.save_checkpoint``) and in ``OUT/reference/``:

- ``master.safetensors``: every parameter's fp32 master as the engine holds it: the all-gathered
  fp32 partitions of its flat group, cut at the offsets the engine placed the parameter at
  (``round_robin_bit16_offsets``, the offsets its module weights are views at);
- ``safe_get.safetensors``: what ``deepspeed.utils.safe_get_full_fp32_param`` returns (recorded to
  show where DeepSpeed's own accessor reads under round-robin);
- ``module.safetensors``: the module weights in the training dtype;
- ``run.json``: which parameters the run checked, and whether the two fp32 views agree.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

# Distinct sizes: any reordering of the flat group moves every parameter after the first.
SIZES = [(7, 5), (3,), (11, 4), (6,), (5, 9), (2, 3), (13,)]


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s) * 0.1) for s in SIZES)

    def forward(self, x):
        # Every parameter gets a gradient: a sum of squares weighted by x.
        return sum((p.float() ** 2).sum() * x.float().mean() * (i + 1) for i, p in enumerate(self.ws))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Stack()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2, "round_robin_gradients": True},
        "bf16": {"enabled": args.dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for step in range(args.steps):
        x = torch.full((1, 4), 1.0 + step + rank)
        engine.backward(engine(x.to(next(engine.module.parameters()).dtype)))
        engine.step()
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}")

    opt = engine.optimizer
    names = {q: n for n, q in engine.module.named_parameters()}
    layout, safe_get = {}, {}
    for i, group in enumerate(opt.round_robin_bit16_groups):
        part = opt.single_partition_of_fp32_groups[i].detach()
        gathered = [torch.empty_like(part) for _ in range(world)]
        dist.all_gather(gathered, part)
        flat = torch.cat(gathered)
        for param, offset in zip(group, opt.round_robin_bit16_offsets[i]):
            layout[names[param]] = flat[offset:offset + param.numel()].view(param.shape).clone()
    for n, q in engine.module.named_parameters():
        safe_get[n] = safe_get_full_fp32_param(q).detach().cpu().clone().contiguous()
    module = {n: q.detach().cpu().clone().contiguous() for n, q in engine.module.named_parameters()}
    order = [names[q] for q in opt.round_robin_bit16_groups[0]]
    if rank == 0:
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(layout, str(ref / "master.safetensors"))
        save_file(safe_get, str(ref / "safe_get.safetensors"))
        save_file(module, str(ref / "module.safetensors"))
        common.write_json(ref / "run.json", {
            "world_size": world, "dtype": args.dtype, "flat_order": order,
            "module_is_master_cast": all(torch.equal(layout[n].to(module[n].dtype), module[n]) for n in module),
            "safe_get_equals_master": [n for n in module if torch.equal(layout[n], safe_get[n])]})
    common.finish()


if __name__ == "__main__":
    main()
