"""A real DeepSpeed ``PipelineModule`` run laid out as GPT-NeoX lays out its model: 2 pipeline stages
x TP 2 (or x DP 2), ZeRO-1 (or none, fp32), fp32 or bf16, parallel or sequential residual.

The layers and their parameter names are GPT-NeoX's (``EmbeddingPipe.word_embeddings``, a
parameterless ``_pre_transformer_block`` function, ``ParallelTransformerLayerPipe``'s
``input_layernorm`` / ``attention.query_key_value`` / ``attention.dense`` /
``post_attention_layernorm`` / ``mlp.dense_h_to_4h`` / ``mlp.dense_4h_to_h``, a parameterless
``_post_transformer_block``, ``NormPipe.norm``, ``ParallelLinearPipe.final_linear``), split by hand
as GPT-NeoX's ``mpu`` layers split them: vocabulary-parallel embedding (dim 0), column-parallel
QKV / h_to_4h / final_linear (dim 0, biases too), row-parallel dense / 4h_to_h (weights dim 1).
Row-parallel biases: with the parallel residual every TP rank adds its own bias before the
all-reduce (GPT-NeoX's ``gpt_j_residual``), so the model's bias is their sum; with the sequential
residual the bias is added once after the all-reduce. The math of each layer is HF
``GPTNeoXLayer``'s (its rotary embedding functions are used).

``torchrun --nproc_per_node 4 ds_pipe_train.py OUT --tp 2|1 --dtype fp32|bf16 --residual parallel|sequential``
writes ``OUT/ckpt`` (the save, with the client state GPT-NeoX saves: :func:`neox_client_state`), ``OUT/config`` (a GPTNeoX config.json), and ``OUT/reference/``:
``master-stage{S}.safetensors`` (the fp32 masters, gathered here over TP along the dims this
script split them on, under HF names; row-parallel biases summed in rank order with the parallel
residual — the ground truth, independent of the exporter), ``module-stage{S}.safetensors`` (the
same for the engine's module weights) and ``logits.safetensors`` (the pipeline's own output on
the probe ``common.fixed_batch(99)``). Under ZeRO-1 in fp32 it also writes ``states-stage{S}.safetensors``: per
parameter under its ``PipelineModule`` name (``"{layer}.{name}"``, what a universal checkpoint
calls it) ``fp32/…``, ``exp_avg/…``, ``exp_avg_sq/…`` as DeepSpeed's ``safe_get_full_*`` give them
right after the save, concatenated over TP on the split dims (whole tensors: rank 0's copy, checked
equal on every TP rank). Then it trains ``--steps-after-save`` more steps on the batches a resumed run
would see and records their losses and the optimizer step at save in ``reference/run.json``.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from ds_tp_train import _CopyToTP, _GatherLastDim, _ReduceFromTP  # noqa: E402

VOCAB = 1002  # vocabulary-parallel layers need rows divisible by tp
LAYERS = 2
STAGES = 2


def hf_config(residual):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, max_position_embeddings=128, use_parallel_residual=residual == "parallel",
                         tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)


class Grid:
    """What the layers need of the topology: the TP group, rank and size."""
    group = None
    rank = 0
    size = 1


def _split(t, dim):
    n = t.shape[dim] // Grid.size
    return t.narrow(dim, Grid.rank * n, n).clone()


def _param(t, split_dim=None):
    p = torch.nn.Parameter(_split(t, split_dim) if split_dim is not None and Grid.size > 1 else t.clone())
    if split_dim is not None and Grid.size > 1:
        p.tensor_model_parallel = True  # counted once per slice in the global grad norm
    return p


class ColumnParallelLinear(torch.nn.Module):
    def __init__(self, full, bias=True, gather=False):
        super().__init__()
        self.weight = _param(full.weight.detach(), 0)
        self.bias = _param(full.bias.detach(), 0) if bias else None
        self.gather = gather

    def forward(self, x):
        x = _CopyToTP.apply(x, Grid.group) if Grid.size > 1 else x
        y = F.linear(x, self.weight, self.bias)
        return _GatherLastDim.apply(y, Grid.group) if self.gather and Grid.size > 1 else y


class RowParallelLinear(torch.nn.Module):
    """``bias_before_reduce``: each rank adds its bias before the all-reduce (parallel residual)."""

    def __init__(self, full, bias_before_reduce):
        super().__init__()
        self.weight = _param(full.weight.detach(), 1)
        self.bias = _param(full.bias.detach())  # every TP rank holds the whole bias
        self.before = bias_before_reduce

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias if self.before else None)
        y = _ReduceFromTP.apply(y, Grid.group) if Grid.size > 1 else y
        return y if self.before else y + self.bias


class EmbeddingPipe(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        torch.manual_seed(100)
        full = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings = torch.nn.Module()
        self.word_embeddings.weight = _param(full.weight.detach(), 0)
        self.rows = self.word_embeddings.weight.shape[0]

    def forward(self, ids):
        w = self.word_embeddings.weight
        if Grid.size == 1:
            return F.embedding(ids, w)
        start = Grid.rank * self.rows
        mask = (ids < start) | (ids >= start + self.rows)
        out = F.embedding((ids - start).masked_fill(mask, 0), w).masked_fill(mask.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out, Grid.group)


class ParallelTransformerLayerPipe(torch.nn.Module):
    def __init__(self, config, index):
        super().__init__()
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXLayer, GPTNeoXRotaryEmbedding

        torch.manual_seed(200 + index)
        full = GPTNeoXLayer(config, index)
        for lin in (full.attention.query_key_value, full.attention.dense, full.mlp.dense_h_to_4h, full.mlp.dense_4h_to_h):
            torch.nn.init.normal_(lin.bias, std=0.02)  # non-zero biases: a wrong bias rule shows in the logits
        self.parallel = config.use_parallel_residual
        self.heads = config.num_attention_heads // Grid.size
        self.head_size = config.hidden_size // config.num_attention_heads
        self.input_layernorm = full.input_layernorm
        self.post_attention_layernorm = full.post_attention_layernorm
        self.attention = torch.nn.Module()
        self.attention.query_key_value = ColumnParallelLinear(full.attention.query_key_value)
        self.attention.dense = RowParallelLinear(full.attention.dense, self.parallel)
        self.mlp = torch.nn.Module()
        self.mlp.dense_h_to_4h = ColumnParallelLinear(full.mlp.dense_h_to_4h)
        self.mlp.dense_4h_to_h = RowParallelLinear(full.mlp.dense_4h_to_h, self.parallel)
        self._rotary = [GPTNeoXRotaryEmbedding(config)]  # a list: no parameters or buffers of its own

    def _attn(self, x):
        from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

        b, s, _ = x.shape
        qkv = self.attention.query_key_value(x).view(b, s, self.heads, 3 * self.head_size).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        cos, sin = self._rotary[0](x, pos)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        mask = torch.full((s, s), float("-inf"), dtype=q.dtype).triu(1)
        w = torch.softmax(q @ k.transpose(-1, -2) * self.head_size ** -0.5 + mask, dim=-1, dtype=torch.float32)
        out = (w.to(v.dtype) @ v).transpose(1, 2).reshape(b, s, -1)
        return self.attention.dense(out)

    def _mlp(self, x):
        return self.mlp.dense_4h_to_h(F.gelu(self.mlp.dense_h_to_4h(x)))

    def forward(self, h):
        if self.parallel:  # GPT-NeoX's gpt_j_residual: one all-reduce of attention + mlp, biases per rank
            return h + self._attn(self.input_layernorm(h)) + self._mlp(self.post_attention_layernorm(h))
        a = self._attn(self.input_layernorm(h)) + h
        return self._mlp(self.post_attention_layernorm(a)) + a


class NormPipe(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        torch.manual_seed(300)
        self.norm = torch.nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        torch.nn.init.normal_(self.norm.bias, std=0.02)

    def forward(self, h):
        return self.norm(h)


class ParallelLinearPipe(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        torch.manual_seed(400)
        full = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.final_linear = ColumnParallelLinear(full, bias=False, gather=True)

    def forward(self, h):
        return self.final_linear(h)


def _pre_transformer_block(x):
    return x


def _post_transformer_block(x):
    return x


# HF name of a native layer-local name, and how TP split it (None: every rank holds it whole)
def hf_names(config):
    n = config.num_hidden_layers
    out = {(0, "word_embeddings.weight"): ("gpt_neox.embed_in.weight", 0),
           (n + 3, "norm.weight"): ("gpt_neox.final_layer_norm.weight", None),
           (n + 3, "norm.bias"): ("gpt_neox.final_layer_norm.bias", None),
           (n + 4, "final_linear.weight"): ("embed_out.weight", 0)}
    for i in range(n):
        for inner, dim in (("input_layernorm.weight", None), ("input_layernorm.bias", None),
                           ("post_attention_layernorm.weight", None), ("post_attention_layernorm.bias", None),
                           ("attention.query_key_value.weight", 0), ("attention.query_key_value.bias", 0),
                           ("attention.dense.weight", 1), ("attention.dense.bias", "rowbias"),
                           ("mlp.dense_h_to_4h.weight", 0), ("mlp.dense_h_to_4h.bias", 0),
                           ("mlp.dense_4h_to_h.weight", 1), ("mlp.dense_4h_to_h.bias", "rowbias")):
            out[(i + 2, inner)] = (f"gpt_neox.layers.{i}.{inner}", dim)
    return out


def neox_client_state(iteration, config, tp):
    """The client state GPT-NeoX's ``save_ds_checkpoint`` (megatron/checkpointing.py) passes to every
    ``save_checkpoint``: the iteration, a dict of args, and the RNG states (python's tuple, numpy's
    ``get_state()`` with its uint32 array, torch's ByteTensor; on CPU torch's state stands in for the
    CUDA one and for the model-parallel tracker's). The reader must take all of it as inert data."""
    import random

    import numpy as np

    return {"iteration": iteration,
            "args": {"num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                     "num_attention_heads": config.num_attention_heads,
                     "max_position_embeddings": config.max_position_embeddings,
                     "make_vocab_size_divisible_by": 2, "padded_vocab_size": config.vocab_size,
                     "tokenizer_type": "HFTokenizer", "model_parallel_size": tp},
            "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()}}


def full_states(engine, names):
    """``({"fp32/NAME": …, "exp_avg/NAME": …, "exp_avg_sq/NAME": …}, steps)``: every parameter's
    state under its module name as DeepSpeed's ``safe_get_full_*`` give it, concatenated over TP on
    the dims this script split it on (whole tensors: rank 0's copy, checked equal on every TP
    rank), and the optimizer steps. Collective over the TP group."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    states = {}
    for name, param in engine.module.named_parameters():
        idx, inner = name.split(".", 1)
        dim = names[(int(idx), inner)][1]
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            full = safe_get_full_fp32_param(param) if state == "fp32" else safe_get_full_optimizer_state(param, state)
            full = full.detach().float().contiguous()
            if Grid.size > 1:
                parts = [torch.empty_like(full) for _ in range(Grid.size)]
                dist.all_gather(parts, full, group=Grid.group)
                if dim in (0, 1):
                    full = torch.cat(parts, dim=dim)
                else:
                    assert all(torch.equal(x, parts[0]) for x in parts), f"{state} of {name} differs over TP"
            states[f"{state}/{name}"] = full.contiguous()
    steps = sorted({float(v["step"]) for v in engine.optimizer.optimizer.state.values() if "step" in v})
    return states, steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--residual", default="parallel", choices=["parallel", "sequential"])
    p.add_argument("--zero", type=int, default=1, choices=[0, 1])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--steps-after-save", type=int, default=2)
    args = p.parse_args()

    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file

    # gloo does every collective here; DeepSpeed's optional shared-memory comm op would be JIT-compiled
    # first (minutes of C++ on a CI core, behind a lock shared by every run on the machine).
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    dp = world // (STAGES * args.tp)
    topo = PipeModelDataParallelTopology(num_pp=STAGES, num_mp=args.tp, num_dp=dp) if args.tp > 1 else None
    if topo is None:
        from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
        topo = PipeDataParallelTopology(num_pp=STAGES, num_dp=dp)
    me = topo.get_coord(dist.get_rank())
    Grid.size, Grid.rank = args.tp, getattr(me, "model", 0)
    for ranks in (topo.get_axis_comm_lists("model") if args.tp > 1 else []):
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            Grid.group = g
    config = hf_config(args.residual)
    specs = [LayerSpec(EmbeddingPipe, config), _pre_transformer_block,
             *(LayerSpec(ParallelTransformerLayerPipe, config, i) for i in range(LAYERS)),
             _post_transformer_block, LayerSpec(NormPipe, config), LayerSpec(ParallelLinearPipe, config)]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))

    # Stage 0: embedding, pre-block, layer 2; stage 1: layer 3, post-block, norm, final_linear.
    model = PipelineModule(layers=specs, loss_fn=loss_fn, topology=topo, partition_method="parameters")
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                 "zero_optimization": {"stage": args.zero}, "steps_per_print": 10**9,
                 "bf16": {"enabled": args.dtype == "bf16"}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[q for q in model.parameters()], config=ds_config)
    dp_rank = me.data
    for step in range(args.steps):
        ids = common.fixed_batch(step, rank=dp_rank, vocab_size=VOCAB)
        engine.train_batch(iter([(ids, ids)]))
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}",
                           client_state=neox_client_state(args.steps, config, args.tp))

    # The pipeline's activation buffers keep the training batch's shape: probe with one of that shape.
    probe = common.fixed_batch(99, rank=0, vocab_size=VOCAB)
    _, logits = engine.eval_batch(iter([(probe, probe)]), return_logits=True)

    names = hf_names(config)
    masters, module = {}, {}
    for name, param in engine.module.named_parameters():
        idx, inner = name.split(".", 1)
        hf, dim = names[(int(idx), inner)]
        master = safe_get_full_fp32_param(param)  # None without ZeRO in fp32: the weights are the masters
        for store, local in ((masters, param if master is None else master), (module, param)):
            local = local.detach().float().clone()  # a copy: the steps after the save update the module in place
            if Grid.size > 1 and dim is not None:
                parts = [torch.empty_like(local) for _ in range(Grid.size)]
                dist.all_gather(parts, local, group=Grid.group)
                if dim == "rowbias":
                    local = parts[0] if args.residual == "sequential" else sum(parts[1:], parts[0].clone())
                else:
                    local = torch.cat(parts, dim=dim)
            store[hf] = local.contiguous()
    states, steps = {}, []
    if args.zero == 1 and args.dtype == "fp32":  # the states a universal checkpoint must carry, by module name
        states, steps = full_states(engine, names)
    losses = []
    for step in range(args.steps, args.steps + args.steps_after_save):  # what a resumed run must compute
        ids = common.fixed_batch(step, rank=dp_rank, vocab_size=VOCAB)
        losses.append(float(engine.train_batch(iter([(ids, ids)]))))
    if dp_rank == 0 and Grid.rank == 0:
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(masters, str(ref / f"master-stage{me.pipe}.safetensors"))
        save_file(module, str(ref / f"module-stage{me.pipe}.safetensors"))
        if states:
            save_file(states, str(ref / f"states-stage{me.pipe}.safetensors"))
        if me.pipe == STAGES - 1:
            save_file({"logits": logits.float().contiguous()}, str(ref / "logits.safetensors"))
        if me.pipe == 0:
            config.save_pretrained(args.out / "config")
            common.write_json(ref / "run.json", {"tp": args.tp, "dp": dp, "pp": STAGES, "dtype": args.dtype, "zero": args.zero,
                                                 "residual": args.residual, "steps": steps,
                                                 "losses_after_save": losses})
    common.finish()


if __name__ == "__main__":
    main()
