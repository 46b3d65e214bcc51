"""Real Megatron-Core (0.16.1) saves of a tiny Llama-like GPTModel on CPU with gloo (issue 37).

One torchrun launch of 4 ranks walks a matrix of layouts; for each it re-initialises
``parallel_state`` (``destroy_model_parallel`` then ``initialize_model_parallel``), builds the model
with the local layer spec (RMSNorm, SwiGLU, RoPE, GQA), takes one optimizer step and saves it twice:

- ``OUT/<layout>/torch_dist/``: what Megatron-LM's ``--ckpt-format torch_dist`` writes
  (``latest_checkpointed_iteration.txt``, ``iter_0000001/`` holding ``dist_checkpointing.save``'s
  ``.metadata``, ``__R_N.distcp``, ``common.pt``, ``metadata.json``);
- ``OUT/<layout>/legacy/``: Megatron-LM's ``--ckpt-format torch`` layout
  (``iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt``: ``model``, ``args`` an ``argparse.Namespace``,
  ``iteration``, ``checkpoint_version``);

plus ``OUT/<layout>/reference/logits.pt``: Megatron's own fp32 logits on ``common.probe_input()``
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
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

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
}


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


def run_layout(name, out):
    tp, pp, variant = LAYOUTS[name]
    tied = variant.endswith("-tied")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    cfg, model = build(tp, pp, tied, qkv_bias=variant == "qwen2")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, opt)
    base = out / name
    reference_logits(model, base / "reference")
    args = saved_args(tp, pp, tied, cfg)
    save_torch_dist(model, base / "torch_dist", args)
    save_legacy(model, base / "legacy", args)
    parallel_state.destroy_model_parallel()


def main():
    out = Path(sys.argv[1])
    only = sys.argv[2:] or list(LAYOUTS)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for name in only:
        run_layout(name, out)
        if dist.get_rank() == 0:
            print(f"saved {name}", flush=True)
    common.write_json(out / "layouts.json", {n: LAYOUTS[n] for n in only}) if dist.get_rank() == 0 else None
    common.finish()


if __name__ == "__main__":
    main()
