"""A real tensor-parallel Llama under a custom TP ``mpu`` (seed 001's setup): nothing records the
merge rules. tp=2 (data parallel 1), ZeRO-1 or -2.

The split is the one HF's ``base_model_tp_plan`` describes — q/k/v/gate/up on dim 0, o/down on
dim 1 — plus a vocabulary-parallel embedding and lm_head (dim 0); norms are replicated. The
Megatron-style collectives (identity forward / all-reduce backward and the reverse) keep the
replicated parameters identical on every rank.

``torchrun --nproc_per_node 2 ds_tp_train.py OUT --stage 1|2`` writes ``OUT/ckpt``, ``OUT/config``
and ``OUT/reference/master.safetensors`` (the full fp32 masters, gathered here along the dims
this script split them on — the ground truth, independent of the exporter's rules).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from ds_parallel_train import GridMPU  # noqa: E402

TP_VOCAB = 1002  # vocabulary-parallel layers need rows divisible by tp


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.size:(ctx.rank + 1) * ctx.size].contiguous(), None


class ColumnParallel(torch.nn.Module):
    def __init__(self, linear, group, rank, tp, gather=False):
        super().__init__()
        n = linear.weight.shape[0] // tp
        self.weight = torch.nn.Parameter(linear.weight.detach()[rank * n:(rank + 1) * n].clone())
        self.group, self.gather = group, gather

    def forward(self, x):
        y = F.linear(_CopyToTP.apply(x, self.group), self.weight)
        return _GatherLastDim.apply(y, self.group) if self.gather else y


class RowParallel(torch.nn.Module):
    def __init__(self, linear, group, rank, tp):
        super().__init__()
        n = linear.weight.shape[1] // tp
        self.weight = torch.nn.Parameter(linear.weight.detach()[:, rank * n:(rank + 1) * n].clone())
        self.group = group

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(torch.nn.Module):
    def __init__(self, emb, group, rank, tp):
        super().__init__()
        n = emb.weight.shape[0] // tp
        self.start, self.end = rank * n, (rank + 1) * n
        self.weight = torch.nn.Parameter(emb.weight.detach()[self.start:self.end].clone())
        self.group = group

    def forward(self, ids):
        mask = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out, self.group)


# name suffix -> split dim, for gathering the reference (the ground truth of this script)
SPLITS = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1,
          "embed_tokens": 0, "lm_head": 0}


def _mark_split(module):
    # DeepSpeed counts a parameter once in the global grad norm (clipping is on by default)
    # unless it is marked model parallel: every slice then contributes, as in Megatron.
    module.weight.tensor_model_parallel = True
    return module


def make_tp_llama(config, mpu):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # identical on every rank, then split
    g, r, tp = mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.q_proj, a.k_proj, a.v_proj = (_mark_split(ColumnParallel(x, g, r, tp)) for x in (a.q_proj, a.k_proj, a.v_proj))
        a.o_proj = _mark_split(RowParallel(a.o_proj, g, r, tp))
        m.gate_proj = _mark_split(ColumnParallel(m.gate_proj, g, r, tp))
        m.up_proj = _mark_split(ColumnParallel(m.up_proj, g, r, tp))
        m.down_proj = _mark_split(RowParallel(m.down_proj, g, r, tp))
    model.model.embed_tokens = _mark_split(VocabParallelEmbedding(model.model.embed_tokens, g, r, tp))
    model.lm_head = _mark_split(ColumnParallel(model.lm_head, g, r, tp, gather=True))
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    mpu = GridMPU(dist.get_world_size())
    config = common.tiny_llama_config(vocab_size=TP_VOCAB)
    model = make_tp_llama(config, mpu)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                 "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu)
    losses = []
    for step in range(args.steps):
        ids = common.fixed_batch(step, rank=0, vocab_size=TP_VOCAB)  # one data-parallel rank: same batch
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}")

    g = mpu.get_model_parallel_group()
    masters = {}
    for name, param in engine.module.named_parameters():
        local = safe_get_full_fp32_param(param).detach().cpu().contiguous()
        dim = next((d for k, d in SPLITS.items() if f"{k}." in name), None)
        if dim is None:
            masters[name] = local.clone()
            continue
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(g))]
        dist.all_gather(parts, local, group=g)
        masters[name] = torch.cat(parts, dim=dim).contiguous()
    if dist.get_rank() == 0:
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(masters, str(ref / "master.safetensors"))
        config.save_pretrained(args.out / "config")
        common.write_json(ref / "run.json", {"stage": args.stage, "tp": dist.get_world_size(), "losses": losses})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
