"""Synthetic DeepSpeed ZeRO-1/2/3 checkpoints with the real file structure, for scale tests.

The files are what ``engine.save_checkpoint`` writes, built with ``torch.save`` and DeepSpeed's own
pickled types (``LossScaler``, ``ZeroStageEnum``, ``fragment_address``), with the keys DeepSpeed
0.19 records: ``param_shapes``, ``param_slice_mappings``, ``single_partition_of_fp32_groups`` /
``fp32_flat_groups``, ``group_paddings``, ``partition_count``, ``zero_stage``, Adam's ``exp_avg`` and
``exp_avg_sq``, ``ds_config``, ``ds_version``:

- ZeRO-1/2: one ``mp_rank_00_model_states.pt`` (the whole 16-bit module, ``param_shapes``) and per
  rank ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` holding that rank's slice of the one
  flat fp32 group (padded to a multiple of ``2 * dp`` elements, the padding removed from the last
  rank's saved slice and recorded in ``group_paddings``), with its ``param_slice_mappings``;
- ZeRO-3: per rank ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (empty module tensors,
  ``param_shapes``) and ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` whose flat fp32 buffer
  holds ``ceil(n / dp)`` elements of every parameter (the last rank zero-padded).

The model is a Llama with the *structure* of a 70B-class one (80 layers, 9 tensors per layer,
8:1 query to key/value heads, intermediate 3.5x hidden, untied embeddings: 723 tensors) and a
small hidden size: ZeRO-1/2 partitions must add up to the whole model, so tiny partitions at
1,024 ranks need a tiny model, not just tiny files. Rank count, file count, tensor count and
per-rank metadata are those of the real thing; only the bytes per partition shrink.

``python benchmarks/synth_ckpt.py DST --stage 3 --dp 1024`` writes one; :func:`make_checkpoint` is
the same from Python (``reference=True`` also saves the full fp32 masters as ``reference_fp32.pt``).
"""

import argparse
import bisect
import json
import math
import os
import sys
import time
from collections import OrderedDict

import numpy as np
import torch

__all__ = ["llama_shapes", "deepseek_v3_shapes", "make_checkpoint"]

TAG = "global_step1"


def llama_shapes(layers=80, hidden=64, vocab=32000, heads=8, kv_heads=1, intermediate=None):
    """Parameter name -> shape of a Llama, in ``state_dict`` order."""
    intermediate = intermediate or int(hidden * 3.5)
    head_dim = hidden // heads
    kv = kv_heads * head_dim
    shapes = OrderedDict([("model.embed_tokens.weight", (vocab, hidden))])
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update([(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.k_proj.weight", (kv, hidden)),
                       (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.o_proj.weight", (hidden, hidden)),
                       (p + "mlp.gate_proj.weight", (intermediate, hidden)),
                       (p + "mlp.up_proj.weight", (intermediate, hidden)),
                       (p + "mlp.down_proj.weight", (hidden, intermediate)),
                       (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))])
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def deepseek_v3_shapes(layers=61, dense=3, experts=256, hidden=32, moe_intermediate=32, vocab=1024):
    """Parameter name -> shape of a DeepSeek-V3-like MoE (``DeepseekV3ForCausalLM``'s names: MLA
    attention, ``dense`` dense layers, then ``experts`` routed experts + one shared expert per layer):
    61 layers and 256 experts give V3's 45,395 tensors (671B parameters at V3's sizes); tiny sizes here,
    but an expert matrix (32 x 32) still reaches all of 1,024 ZeRO-3 ranks, as a real one does."""
    h, m = hidden, moe_intermediate
    shapes = OrderedDict([("model.embed_tokens.weight", (vocab, h))])
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update([(p + "self_attn.q_a_proj.weight", (h, h)), (p + "self_attn.q_a_layernorm.weight", (h,)),
                       (p + "self_attn.q_b_proj.weight", (h, h)), (p + "self_attn.kv_a_proj_with_mqa.weight", (h, h)),
                       (p + "self_attn.kv_a_layernorm.weight", (h,)), (p + "self_attn.kv_b_proj.weight", (h, h)),
                       (p + "self_attn.o_proj.weight", (h, h))])
        mlps = [p + "mlp."] if i < dense else [p + f"mlp.experts.{e}." for e in range(experts)] + [p + "mlp.shared_experts."]
        if i >= dense:
            shapes.update([(p + "mlp.gate.weight", (experts, h)), (p + "mlp.gate.e_score_correction_bias", (experts,))])
        for q in mlps:
            shapes.update([(q + "gate_proj.weight", (m, h)), (q + "up_proj.weight", (m, h)), (q + "down_proj.weight", (h, m))])
        shapes.update([(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))])
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (vocab, h)
    return shapes


def _config(layers, hidden, vocab, heads, kv_heads, intermediate):
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": intermediate or int(hidden * 3.5), "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def _ds_types():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return LossScaler, ZeroStageEnum, fragment_address


def _ds_config(stage):
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}


def _adam(part):
    return {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(part),
                          "exp_avg_sq": torch.zeros_like(part)}},
            "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                              "params": [0]}]}


def make_checkpoint(dst, *, stage: int, dp: int, layers=80, hidden=64, vocab=32000, heads=8, kv_heads=1,
                    intermediate=None, seed=0, reference=False, shapes=None, link_model_states=False) -> dict:
    """Write a ZeRO-``stage`` save of ``dp`` data-parallel ranks under ``dst`` (``latest``, the tag dir,
    ``config.json``); return a summary (tensors, parameters, files, bytes, seconds).

    ``shapes``: another model's ``{name: shape}`` (then no ``config.json``: the export stays
    torch-free). ``link_model_states``: ZeRO-3's per-rank model-states files, identical on every
    rank, written once and hard-linked (a 45K-tensor pickle x 1,024 ranks would take many minutes)."""
    started = time.perf_counter()
    LossScaler, ZeroStageEnum, fragment_address = _ds_types()
    custom = shapes is not None
    shapes = shapes or llama_shapes(layers, hidden, vocab, heads, kv_heads, intermediate)
    numels = [math.prod(s) for s in shapes.values()]
    rng = np.random.default_rng(seed)
    total = sum(numels)
    flat = torch.from_numpy(rng.standard_normal(total, dtype=np.float32))
    tag_dir = os.path.join(dst, TAG)
    os.makedirs(tag_dir, exist_ok=True)
    with open(os.path.join(dst, "latest"), "w") as fh:
        fh.write(TAG)
    if not custom:
        with open(os.path.join(dst, "config.json"), "w") as fh:
            json.dump(_config(layers, hidden, vocab, heads, kv_heads, intermediate), fh, indent=2)
    param_shapes = [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())]
    common = {"ds_config": _ds_config(stage), "ds_version": "0.19.8"}
    model_common = {"buffer_names": [], "optimizer": None, "param_shapes": param_shapes,
                    "frozen_param_shapes": OrderedDict(), "shared_params": {},
                    "frozen_param_fragments": OrderedDict(), "lr_scheduler": None, "data_sampler": None,
                    "random_ltd": None, "skipped_steps": 0, "global_steps": 1,
                    "global_samples": dp, "dp_world_size": dp, "mp_world_size": 1, **common}
    scaler = LossScaler(1.0)
    if stage == 3:
        _zero3(tag_dir, dp, shapes, numels, flat, model_common, common, scaler, ZeroStageEnum, link_model_states)
    else:
        _zero12(tag_dir, stage, dp, shapes, numels, flat, model_common, common, scaler, ZeroStageEnum,
                fragment_address)
    if reference:
        ref, off = {}, 0
        for (name, shape), n in zip(shapes.items(), numels):
            ref[name] = flat[off:off + n].view(shape).clone()
            off += n
        torch.save(ref, os.path.join(dst, "reference_fp32.pt"))
    names = os.listdir(tag_dir)
    return {"stage": stage, "dp": dp, "tensors": len(shapes), "parameters": total, "files": len(names),
            "bytes": sum(os.path.getsize(os.path.join(tag_dir, n)) for n in names),
            "seconds": round(time.perf_counter() - started, 2)}


def _zero3(tag_dir, dp, shapes, numels, flat, model_common, common, scaler, ZeroStageEnum, link=False):
    chunks = [-(-n // dp) for n in numels]
    per_rank = sum(chunks)
    empty = OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n in shapes)
    # Rank r's buffer: chunk r of every parameter, zero-padded past its end.
    padded = []
    off = 0
    for n, c in zip(numels, chunks):
        p = torch.zeros(c * dp)
        p[:n] = flat[off:off + n]
        padded.append(p.view(dp, c))
        off += n
    buffers = torch.cat(padded, dim=1)  # (dp, per_rank)
    assert buffers.shape == (dp, per_rank)
    for r in range(dp):
        part = buffers[r].clone()
        osd = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": scaler, "dynamic_loss_scale": False,
               "overflow": False, "partition_count": dp, "optimizer_state_dict": _adam(part),
               "fp32_flat_groups": [part]}
        torch.save({"optimizer_state_dict": osd, **common},
                   os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        states = os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        if link and r:
            os.link(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_00_model_states.pt"), states)
        else:
            torch.save({"module": empty, **model_common}, states)


def _zero12(tag_dir, stage, dp, shapes, numels, flat, model_common, common, scaler, ZeroStageEnum, fragment_address):
    total = len(flat)
    align = 2 * dp  # DeepSpeed aligns each flat group to nccl_start_alignment_factor (2) * dp
    size = -(-total // align) * align // dp
    padding = size * dp - total
    assert padding < size, "padding spans more than the last rank"
    module = OrderedDict()
    off = 0
    for (name, shape), n in zip(shapes.items(), numels):
        module[name] = flat[off:off + n].view(shape).to(torch.bfloat16)
        off += n
    torch.save({"module": module, **model_common}, os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    names = list(shapes)
    starts = [int(x) for x in np.cumsum([0] + numels[:-1])]
    for r in range(dp):
        lo, hi = r * size, min((r + 1) * size, total)
        part = flat[lo:hi].clone()
        mapping = OrderedDict()
        # Parameters intersecting [lo, hi): a binary search, not a scan, so 1,024 ranks stay fast.
        i = bisect.bisect_right(starts, lo) - 1
        while i < len(numels) and starts[i] < hi:
            a, b = max(lo, starts[i]), min(hi, starts[i] + numels[i])
            if b > a:
                mapping[names[i]] = fragment_address(numel=b - a, start=a - lo)
            i += 1
        osd = {"loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
               "base_optimizer_state": [_adam(part)["state"][0]], "single_partition_of_fp32_groups": [part],
               "zero_stage": ZeroStageEnum(stage), "group_paddings": [padding if r == dp - 1 else 0],
               "partition_count": [dp], "ds_version": "0.19.8", "param_slice_mappings": [mapping]}
        torch.save({"optimizer_state_dict": osd, **common},
                   os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dst")
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), required=True)
    ap.add_argument("--dp", type=int, required=True)
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--moe", action="store_true", help="a DeepSeek-V3-like MoE structure (--layers 61, 256 experts)")
    ap.add_argument("--experts", type=int, default=256)
    args = ap.parse_args(argv)
    if args.moe:
        shapes = deepseek_v3_shapes(layers=args.layers, experts=args.experts)
        print(json.dumps(make_checkpoint(args.dst, stage=args.stage, dp=args.dp, shapes=shapes,
                                         link_model_states=True)))
        return
    print(json.dumps(make_checkpoint(args.dst, stage=args.stage, dp=args.dp, layers=args.layers, hidden=args.hidden,
                                     vocab=args.vocab)))


if __name__ == "__main__":
    sys.exit(main())
