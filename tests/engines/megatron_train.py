"""Real Megatron-Core (0.16.1) saves of a tiny Llama-like GPTModel on CPU with gloo (issue 37).

One torchrun launch of 4 ranks walks a matrix of layouts; for each it re-initialises
``parallel_state`` (``destroy_model_parallel`` then ``initialize_model_parallel``), builds the model
with the local layer spec (RMSNorm, SwiGLU, RoPE, GQA; the ``gpt`` variant: LayerNorm, linear biases,
learned positions, GELU, MHA), takes one optimizer step and saves it twice:

- ``OUT/<layout>/torch_dist/``: what Megatron-LM's ``--ckpt-format torch_dist`` writes
  (``latest_checkpointed_iteration.txt``, ``iter_0000001/`` holding ``dist_checkpointing.save``'s
  ``.metadata``, ``__R_N.distcp``, ``common.pt``, ``metadata.json``);
- ``OUT/<layout>/legacy/``: Megatron-LM's ``--ckpt-format torch`` layout
  (``iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt``: ``model``, ``args`` an ``argparse.Namespace``,
  ``iteration``, ``checkpoint_version``);

``OUT/<layout>/{torch_dist,legacy}-distopt/`` for the ``DISTOPT`` layouts (Megatron's DistributedOptimizer),
``VPP_LAYOUTS`` (interleaved: ``model0``, ``model1``), plus ``OUT/<layout>/reference/logits.pt``: Megatron's own fp32 logits on ``common.probe_input()``
(vocabulary padding cut off), the ground truth the export is checked against.

Stand-ins Megatron-Core needs on a CPU-only machine (test support, never shipped): the RNG tracker is
the inference one (``fork`` a no-op; dropout is 0), ``torch.cuda.current_device``/``synchronize`` are
no-ops, the causal mask is given explicitly, and the pipeline's activations and gradients travel by
hand (``dist.send``/``recv`` between the two stages) instead of Megatron's schedules.
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

torch.cuda.current_device = lambda: "cpu"  # stand-ins: Megatron moves buffers to "the current device"
torch.cuda.synchronize = lambda *a, **k: None

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 without Transformer Engine never defines it: the router
    moe_utils.te_general_gemm = None  # then takes its torch path

VOCAB = common.VOCAB_SIZE  # 1001: padded to 1008 at TP 1 and 1024 at TP 2 (divisible by 16 x TP)
DIVISIBLE_BY = 16
ITERATION = 1
# name -> (tp, pp, variant); data parallel = 4 / (tp * pp).
LAYOUTS = {
    "tp2": (2, 1, "llama"),
    "pp2": (1, 2, "llama"),
    "tp2pp2": (2, 2, "llama"),
    "dp4": (1, 1, "llama"),
    "tp2-tied": (2, 1, "llama-tied"),
    "tp2-qwen2": (2, 1, "qwen2"),  # q/k/v biases (add_qkv_bias): HF Qwen2
    "tp2-gpt": (2, 1, "gpt"),  # LayerNorm, linear biases, learned positions, GELU, MHA, tied: HF GPTBigCode
    "gpt-mqa": (1, 1, "gpt-mqa"),  # the same with one query group (MQA; TP must divide the groups): multi_query
}
# MoE layouts (Mixtral-like: 4 experts, top-2, SequentialMLP): name -> expert-parallel size.
MOE_LAYOUTS = {"tp2ep2-mixtral": 2, "tp2ep2-qwen2moe": 2}
LAYOUTS["tp2ep2-mixtral"] = (2, 1, "mixtral")  # TP 2 x EP 2 (experts TP-split too), DP 2
# Qwen2-MoE: q/k/v biases, a shared expert (64) with a sigmoid gate, softmax before top-k (no renormalising)
LAYOUTS["tp2ep2-qwen2moe"] = (2, 1, "qwen2moe")
NUM_EXPERTS, TOPK, SHARED = 4, 2, 64


def padded_vocab(tp):
    multiple = DIVISIBLE_BY * tp
    return -(-VOCAB // multiple) * multiple


def transformer_config(tp, pp, qkv_bias=False):
    return TransformerConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=qkv_bias, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        init_method_std=0.02, pipeline_dtype=torch.float32)


def gpt_transformer_config(tp, pp, groups=4):
    """A GPT-2-like block (issue 37, gpt37): LayerNorm with bias, biases on every linear, erf GELU, MHA."""
    return TransformerConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=groups,
        kv_channels=16, normalization="LayerNorm", layernorm_epsilon=1e-5, gated_linear_unit=False,
        activation_func=F.gelu, add_bias_linear=True, add_qkv_bias=True, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        init_method_std=0.02, pipeline_dtype=torch.float32)


def build_gpt(tp, pp, groups=4):
    cfg = gpt_transformer_config(tp, pp, groups)
    torch.manual_seed(1234)
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="LayerNorm"),
        vocab_size=padded_vocab(tp), max_sequence_length=128,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False, share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    return cfg, model


def gpt_args(args, groups=None):
    """``saved_args`` for the GPT variant: what Megatron-LM's arguments.py records for a GPT-2-like run."""
    for k, v in dict(group_query_attention=groups is not None, num_query_groups=groups or 1,
                     position_embedding_type="learned_absolute",
                     use_rotary_position_embeddings=False, normalization="LayerNorm", swiglu=False,
                     add_bias_linear=True, add_qkv_bias=True, untie_embeddings_and_output_weights=False).items():
        setattr(args, k, v)
    return args


def build(tp, pp, tied, qkv_bias=False):
    cfg = transformer_config(tp, pp, qkv_bias)
    torch.manual_seed(1234)  # the same full model whatever the layout (CPU init splits a master weight)
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab(tp), max_sequence_length=128,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False, share_embeddings_and_output_weights=tied, position_embedding_type="rope",
        rotary_base=10000)
    return cfg, model


def causal_mask(seq):
    # Megatron's convention: True where attention is masked out.
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def forward(model, ids):
    """The model's output on ``ids`` across the pipeline (activations sent by hand); the loss/logits on
    the last stage, the first stage's output elsewhere (for its backward)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    if pp == 1:
        return model(ids, pos, causal_mask(s)), None
    stage = parallel_state.get_pipeline_model_parallel_rank()
    prev, nxt = parallel_state.get_pipeline_model_parallel_prev_rank(), parallel_state.get_pipeline_model_parallel_next_rank()
    if stage == 0:
        model.set_input_tensor(None)
        out = model(ids, pos, causal_mask(s))
        dist.send(out.detach().contiguous(), nxt)
        return None, out
    hidden = torch.empty(s, b, model.config.hidden_size)
    dist.recv(hidden, prev)
    hidden.requires_grad_(True)
    model.set_input_tensor(hidden)
    return model(ids, pos, causal_mask(s)), hidden


def train_step(model, opt):
    """One optimizer step on this data-parallel rank's batch (gradients averaged over DP by hand)."""
    dp_rank = parallel_state.get_data_parallel_rank()
    ids = common.fixed_batch(0, vocab_size=VOCAB, rank=dp_rank)
    logits, aux = forward(model, ids)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if logits is not None:
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        loss.backward()
        if pp > 1:
            dist.send(aux.grad.contiguous(), parallel_state.get_pipeline_model_parallel_prev_rank())
    else:
        grad = torch.empty_like(aux)
        dist.recv(grad, parallel_state.get_pipeline_model_parallel_next_rank())
        aux.backward(grad)
    if model.share_embeddings_and_output_weights and pp > 1:
        raise SystemExit("tied embeddings across pipeline stages are not exercised here")
    group = parallel_state.get_data_parallel_group()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
        p.grad /= parallel_state.get_data_parallel_world_size()
    opt.step()
    opt.zero_grad()


def reference_logits(model, out):
    ids = common.probe_input(VOCAB)
    with torch.no_grad():
        logits, _ = forward(model, ids)
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": ids, "logits": logits[..., :VOCAB].float().contiguous()}, out / "logits.pt")


def saved_args(tp, pp, tied, cfg):
    """What Megatron-LM's arguments.py holds for such a run (the fields a converter reads)."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, group_query_attention=True,
        num_query_groups=cfg.num_query_groups, kv_channels=cfg.kv_channels, max_position_embeddings=128,
        seq_length=16, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        use_rotary_position_embeddings=True, normalization="RMSNorm", norm_epsilon=cfg.layernorm_epsilon,
        swiglu=True, add_bias_linear=False, add_qkv_bias=cfg.add_qkv_bias, untie_embeddings_and_output_weights=not tied,
        padded_vocab_size=padded_vocab(tp), vocab_size=VOCAB, make_vocab_size_divisible_by=DIVISIBLE_BY,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=1,
        data_parallel_size=parallel_state.get_data_parallel_world_size(), num_experts=None,
        params_dtype=torch.float32, fp16=False, bf16=False, ckpt_format=None, use_distributed_optimizer=False,
        iteration=ITERATION, consumed_train_samples=8, tokenizer_type="NullTokenizer")


def save_torch_dist(model, root, args):
    ckpt = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # Megatron-LM's generate_state_dict: the model's sharded state beside plain objects (common.pt).
    sd = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
    dist_checkpointing.save(sd, str(ckpt), sharded_strategy=("torch_dist", 1))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()


def save_legacy(model, root, args):
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    if parallel_state.get_data_parallel_rank() == 0:  # Megatron-LM: one writer per model-parallel rank
        d = root / f"iter_{ITERATION:07d}" / name
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(), "rng_state": [{"random_rng_state": None}],
                    "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": ITERATION}}, d / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


# Layouts also saved with Megatron's distributed optimizer (gpt37): name -> torch_dist's sharding type.
DISTOPT = {"dp4": "dp_reshardable", "tp2": "fully_reshardable"}


class _CpuAsCuda:
    """Stand-ins while the distributed optimizer is built and saved (test support): it accepts only
    ``torch.cuda.*Tensor`` params (``model_param.type()``; on CPU the same tensors answer ``torch.*Tensor``),
    and makes a few scalars with ``device='cuda'`` (made on the CPU here; ``.cuda()`` is a no-op)."""

    def __enter__(self):
        self.orig = (torch.Tensor.type, torch.Tensor.cuda, torch.tensor, torch.zeros)
        type_, _, tensor, zeros = self.orig

        def cuda_type(t, *a, **k):
            name = type_(t, *a, **k)
            return name.replace("torch.", "torch.cuda.", 1) if not a and not k and "cuda" not in name else name

        def on_cpu(make):
            def made(*a, **k):
                if str(k.get("device")) == "cuda":
                    k["device"] = "cpu"
                return make(*a, **k)
            return made
        torch.Tensor.type, torch.Tensor.cuda = cuda_type, lambda t, *a, **k: t
        torch.tensor, torch.zeros = on_cpu(tensor), on_cpu(zeros)

    def __exit__(self, *exc):
        torch.Tensor.type, torch.Tensor.cuda, torch.tensor, torch.zeros = self.orig


def distributed_optimizer(model, cfg):
    """The trained model under Megatron's DDP (its contiguous param buffer: the values are kept) and
    Megatron's DistributedOptimizer (each DP rank owns a shard of the fp32 params' Adam state), its state
    initialised by Megatron's own zero-gradient step (gloo has no reduce-scatter, so training under it is
    not run here; lr 0 and weight decay 0 keep the weights bit-identical to the plain save)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.0, weight_decay=0.0, bf16=False,
                                                 fp16=False, params_dtype=torch.float32,
                                                 use_distributed_optimizer=True), [ddp])
    for one in getattr(opt, "chained_optimizers", [opt]):
        one._init_optimizer_states_with_dummy_values()
    return ddp, opt


def save_distopt(model, cfg, base, args, sharding):
    """``base/torch_dist-distopt`` and ``base/legacy-distopt``: the same model saved as Megatron-LM does with
    ``--use-distributed-optimizer`` (torch_dist: the optimizer's sharded state under ``optimizer.``, of
    ``sharding`` type; legacy: ``distrib_optim.pt`` beside each ``model_optim_rng.pt``, which holds the
    optimizer's ``state_dict()``)."""
    ddp, opt = distributed_optimizer(model, cfg)
    args = argparse.Namespace(**{**vars(args), "use_distributed_optimizer": True})
    root = base / "torch_dist-distopt"
    ckpt = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    model_sd = ddp.module.sharded_state_dict()  # Megatron-LM saves the unwrapped model (unwrap_model)
    sd = {"model": model_sd, "args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
          "optimizer": opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": sharding})}
    dist_checkpointing.save(sd, str(ckpt), sharded_strategy=("torch_dist", 1))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    root = base / "legacy-distopt"
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    d = root / f"iter_{ITERATION:07d}" / (f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}")
    if parallel_state.get_data_parallel_rank() == 0:
        d.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    opt.save_parameter_state(str(d / "distrib_optim.pt"))  # gathers every DP rank's shard on DP rank 0
    if parallel_state.get_data_parallel_rank() == 0:
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": ddp.module.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict(),
                    "rng_state": [{"random_rng_state": None}],
                    "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": ITERATION}}, d / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


# Virtual pipeline (interleaved) layouts (gpt37): name -> (tp, pp, vpp). Each pipeline rank holds vpp model
# chunks; chunk v of stage p holds layers v*L/vpp + p*L/(vpp*pp) ... (megatron's get_transformer_layer_offset).
VPP_LAYOUTS = {"pp2-vpp2": (1, 2, 2)}


def vpp_forward(chunks, ids):
    """The interleaved model's logits on ``ids`` (last stage's last chunk) or None: chunk v of every stage in
    stage order, then chunk v + 1 (activations sent by hand around the pipeline ring)."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    prev, nxt = parallel_state.get_pipeline_model_parallel_prev_rank(), parallel_state.get_pipeline_model_parallel_next_rank()
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    out = None
    for v, chunk in enumerate(chunks):
        if stage == 0 and v == 0:
            chunk.set_input_tensor(None)
        else:
            hidden = torch.empty(s, b, chunk.config.hidden_size)
            dist.recv(hidden, prev)
            chunk.set_input_tensor(hidden)
        out = chunk(ids, pos, causal_mask(s))
        if not (stage == pp - 1 and v == len(chunks) - 1):
            dist.send(out.contiguous(), nxt)
            out = None
    return out


def run_vpp_layout(name, out):
    """An untrained interleaved Llama (its random layers differ, so Megatron's logits prove the layer order),
    saved as Megatron-LM does: ``model0``, ``model1``, ... in both formats."""
    tp, pp, vpp = VPP_LAYOUTS[name]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    cfg = transformer_config(tp, pp)
    cfg.virtual_pipeline_model_parallel_size = vpp
    chunks = []
    for v in range(vpp):
        torch.manual_seed(1234 + 10 * v + parallel_state.get_pipeline_model_parallel_rank())
        chunks.append(GPTModel(
            config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=padded_vocab(tp), max_sequence_length=128,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v),
            parallel_output=False, share_embeddings_and_output_weights=False, position_embedding_type="rope",
            rotary_base=10000, vp_stage=v))
    base = out / name
    ids = common.probe_input(VOCAB)
    with torch.no_grad():
        logits = vpp_forward(chunks, ids)
    if logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and parallel_state.get_data_parallel_rank() == 0:
        (base / "reference").mkdir(parents=True, exist_ok=True)
        torch.save({"input_ids": ids, "logits": logits[..., :VOCAB].float().contiguous()}, base / "reference" / "logits.pt")
    args = saved_args(tp, pp, False, cfg)
    args.virtual_pipeline_model_parallel_size = vpp
    args.num_layers_per_virtual_pipeline_stage = cfg.num_layers // (pp * vpp)
    root = base / "torch_dist"
    ckpt = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = {f"model{v}": c.sharded_state_dict() for v, c in enumerate(chunks)}
    sd.update({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION})
    dist_checkpointing.save(sd, str(ckpt), sharded_strategy=("torch_dist", 1))
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    root = base / "legacy"
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if parallel_state.get_data_parallel_rank() == 0:
        d = root / f"iter_{ITERATION:07d}" / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        d.mkdir(parents=True, exist_ok=True)
        obj = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION}
        obj.update({f"model{v}": c.state_dict_for_save_checkpoint() for v, c in enumerate(chunks)})
        torch.save(obj, d / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    parallel_state.destroy_model_parallel()


def run_layout(name, out):
    if name in MOE_LAYOUTS:
        return run_moe_layout(name, out)
    tp, pp, variant = LAYOUTS[name]
    tied = variant.endswith("-tied")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if variant.startswith("gpt"):
        cfg, model = build_gpt(tp, pp, 1 if variant == "gpt-mqa" else 4)
    else:
        cfg, model = build(tp, pp, tied, qkv_bias=variant == "qwen2")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, opt)
    base = out / name
    reference_logits(model, base / "reference")
    args = saved_args(tp, pp, tied, cfg)
    if variant.startswith("gpt"):
        args = gpt_args(args, 1 if variant == "gpt-mqa" else None)
    save_torch_dist(model, base / "torch_dist", args)
    save_legacy(model, base / "legacy", args)
    if name in DISTOPT:
        with _CpuAsCuda():
            save_distopt(model, cfg, base, args, DISTOPT[name])
    parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------- MoE (Mixtral-like), expert parallelism


def moe_config(tp, pp, ep, variant="mixtral"):
    """The dense config plus 4 experts, top-2 routing (softmax over the top-k logits, as Mixtral's
    softmax -> top-k -> renormalise), dropless, SequentialMLP (grouped GEMM needs TE/grouped_gemm), the
    allgather dispatcher (alltoall's needs CUDA streams), no load-balancing loss."""
    qwen = variant == "qwen2moe"
    cfg = transformer_config(tp, pp, qkv_bias=qwen)
    for key, value in dict(moe_shared_expert_intermediate_size=SHARED if qwen else None, moe_shared_expert_gate=qwen,
                           moe_router_pre_softmax=qwen,num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_grouped_gemm=False,
                           moe_ffn_hidden_size=cfg.ffn_hidden_size, moe_token_dispatcher_type="allgather",
                           moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                           expert_model_parallel_size=ep).items():
        setattr(cfg, key, value)
    cfg.__post_init__()
    return cfg


def build_moe(tp, pp, ep, variant="mixtral"):
    cfg = moe_config(tp, pp, ep, variant)
    torch.manual_seed(1234)
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(
        config=cfg, transformer_layer_spec=spec, vocab_size=padded_vocab(tp), max_sequence_length=128,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False, share_embeddings_and_output_weights=False, position_embedding_type="rope",
        rotary_base=10000)
    # Each EP rank initialised its local experts from the same seed: make them differ (expert e's weights
    # scaled by 1 + e/8, by global index) so that a mix-up of experts changes the logits.
    first = parallel_state.get_expert_model_parallel_rank() * (NUM_EXPERTS // ep)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".local_experts." in n:
                local = int(n.split(".local_experts.")[1].split(".")[0])
                p.mul_(1 + (first + local) / 8)
    return cfg, model


def moe_train_step(model, opt):
    """One optimizer step: dense gradients averaged over DP, the experts' over the expert-DP group.
    Stand-in: MoELayer refuses to train with TP > 1 unless sequence parallelism is on, which needs TE or
    Apex norms (torch's refuse it); the step's forward runs with ``training`` off instead: dropout is 0
    and there is no load-balancing loss, so it computes the same thing."""
    model.eval()
    dp_rank = parallel_state.get_data_parallel_rank()
    ids = common.fixed_batch(0, vocab_size=VOCAB, rank=dp_rank)
    logits, _ = forward(model, ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    dense, expert = parallel_state.get_data_parallel_group(), parallel_state.get_expert_data_parallel_group()
    for n, p in model.named_parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        group = expert if ".local_experts." in n else dense
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size(group)
    opt.step()
    opt.zero_grad()


def moe_saved_args(tp, pp, ep, cfg):
    args = saved_args(tp, pp, False, cfg)
    args.num_experts = NUM_EXPERTS
    args.moe_router_topk = TOPK
    args.expert_model_parallel_size = ep
    args.expert_tensor_parallel_size = tp
    args.moe_grouped_gemm = False
    args.moe_ffn_hidden_size = cfg.moe_ffn_hidden_size
    args.moe_router_pre_softmax = cfg.moe_router_pre_softmax
    args.moe_router_score_function = "softmax"
    args.moe_router_load_balancing_type = "none"
    args.moe_token_dispatcher_type = "allgather"
    args.moe_shared_expert_intermediate_size = cfg.moe_shared_expert_intermediate_size
    args.moe_shared_expert_gate = cfg.moe_shared_expert_gate
    args.moe_layer_freq = 1
    return args


def save_legacy_moe(model, root, args):
    """Megatron-LM's get_checkpoint_name with expert parallelism: ``mp_rank_TT[_PPP]_EEE``, written by
    the ranks of expert-data-parallel rank 0 (each file: the dense weights + that EP rank's experts,
    numbered locally)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    name += f"_{ep_rank:03d}"
    if parallel_state.get_expert_data_parallel_rank() == 0:
        d = root / f"iter_{ITERATION:07d}" / name
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(), "rng_state": [{"random_rng_state": None}],
                    "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": ITERATION}}, d / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def run_moe_layout(name, out):
    tp, pp, variant = LAYOUTS[name]
    ep = MOE_LAYOUTS[name]
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    cfg, model = build_moe(tp, pp, ep, variant)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    moe_train_step(model, opt)
    base = out / name
    reference_logits(model, base / "reference")
    args = moe_saved_args(tp, pp, ep, cfg)
    save_torch_dist(model, base / "torch_dist", args)
    save_legacy_moe(model, base / "legacy", args)
    parallel_state.destroy_model_parallel()


def main():
    out = Path(sys.argv[1])
    only = sys.argv[2:] or list(LAYOUTS) + list(VPP_LAYOUTS)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name in only:
        if name in VPP_LAYOUTS:
            run_vpp_layout(name, out)
        else:
            run_layout(name, out)
        if dist.get_rank() == 0:
            print(f"saved {name}", flush=True)
    common.write_json(out / "layouts.json", {n: {**LAYOUTS, **VPP_LAYOUTS}[n] for n in only}) \
        if dist.get_rank() == 0 else None
    common.finish()


if __name__ == "__main__":
    main()
