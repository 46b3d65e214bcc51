"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``) with expert parallelism under ZeRO-1/2.

A tiny ``nn.Module``: a dense layer, two MoE layers of 4 experts each over ``--ep-size`` expert-parallel
ranks, a dense head. Launched as ``torchrun --nproc_per_node 4 ds_moe_train.py OUT --stage S
[--dtype fp32|bf16] [--ep-size 2] [--data-before-expert]``. The experts' optimizer group is partitioned over the expert
data-parallel group (world / ep_size ranks), the dense groups over all ranks. Writes ``OUT/ckpt/``
(``engine.save_checkpoint``: ``layer_L_expert_E_mp_rank_00_model_states.pt`` per expert) and in
``OUT/reference/``:

- ``master.safetensors``: every parameter's fp32 master from ``safe_get_full_fp32_param``; experts
  gathered from every expert-parallel rank and named by their global id as DeepSpeed's expert
  files name them (``...deepspeed_experts.{ep_rank * local + i}...``);
- ``module.safetensors``: the same names, module weights in the training dtype;
- ``run.json``: the run's layout.
"""
import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

NUM_EXPERTS = 4
LOCAL = ".deepspeed_moe.experts.deepspeed_experts."


class Net(torch.nn.Module):
    def __init__(self, ep_size):
        super().__init__()
        from deepspeed.moe.layer import MoE

        def expert():
            return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 16))

        self.inp = torch.nn.Linear(8, 16)
        self.moe1 = MoE(hidden_size=16, expert=expert(), num_experts=NUM_EXPERTS, ep_size=ep_size, k=1)
        self.mid = torch.nn.Linear(16, 16)
        self.moe2 = MoE(hidden_size=16, expert=expert(), num_experts=NUM_EXPERTS, ep_size=ep_size, k=1)
        self.out = torch.nn.Linear(16, 5)

    def forward(self, x):
        h, aux1, _ = self.moe1(self.inp(x))
        h, aux2, _ = self.moe2(torch.relu(self.mid(h)))
        return self.out(h).float().pow(2).mean() + 0.01 * (aux1 + aux2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--ep-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    # DeepSpeed's other rank order: expert-data-parallel groups of adjacent ranks ("D + E").
    p.add_argument("--data-before-expert", action="store_true")
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups, safe_get_full_fp32_param
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net(args.ep_size)
    # Experts differ between expert-parallel ranks (each rank seeds its own local experts).
    with torch.no_grad():
        g = torch.Generator().manual_seed(100 + rank)
        for n, q in model.named_parameters():
            if "deepspeed_experts" in n:
                q.copy_(torch.randn(q.shape, generator=g) * 0.2)
    groups_ = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense"})
    ds_config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "steps_per_print": 10**9,
        "use_data_before_expert_parallelism": args.data_before_expert,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups_, config=ds_config)
    dtype = next(engine.module.parameters()).dtype
    for step in range(args.steps):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)
        engine.backward(engine(x))
        engine.step()
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}")

    group_name = engine.module.moe1.expert_group_name
    ep_rank = groups._get_expert_parallel_rank(group_name)
    local_count = NUM_EXPERTS // args.ep_size

    def global_name(n):
        m = re.match(rf"(.*{re.escape(LOCAL)})(\d+)(\..*)", n)
        return f"{m.group(1)}{ep_rank * local_count + int(m.group(2))}{m.group(3)}" if m else n

    masters, module = {}, {}
    for n, q in engine.module.named_parameters():
        masters[global_name(n)] = safe_get_full_fp32_param(q).detach().cpu().clone().contiguous()
        module[global_name(n)] = q.detach().cpu().clone().contiguous()
    everyone = [None] * world
    dist.all_gather_object(everyone, (masters, module, ep_rank, groups._get_expert_data_parallel_rank(group_name)))
    if rank == 0:
        all_masters, all_module, layout = {}, {}, {}
        for r, (m, mod, e, edp) in enumerate(everyone):
            for n in m:
                if n in all_masters:  # dense weights (every rank) and experts (every expert-dp rank) agree
                    assert torch.equal(all_masters[n], m[n]) and torch.equal(all_module[n], mod[n]), n
            all_masters.update(m)
            all_module.update(mod)
            layout[r] = {"ep_rank": e, "expert_dp_rank": edp}
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(all_masters, str(ref / "master.safetensors"))
        save_file(all_module, str(ref / "module.safetensors"))
        common.write_json(ref / "run.json", {"stage": args.stage, "dtype": args.dtype, "ep_size": args.ep_size,
                                            "data_before_expert": args.data_before_expert,
                                            "world_size": world, "ranks": layout, "num_experts": NUM_EXPERTS})
    common.finish()


if __name__ == "__main__":
    main()
