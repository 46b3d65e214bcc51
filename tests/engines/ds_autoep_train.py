"""DeepSpeed AutoEP (0.19.2+, ``"expert_parallel": {"enabled": true}``) on a tiny HF Mixtral, ZeRO-1/2.

Two MoE layers of 2 experts over ``autoep_size`` 2 on 2 ranks (one local expert per rank). AutoEP
swaps each ``mlp`` for an ``AutoEPMoELayer`` holding TorchTitan-style fused ``experts.w1/w2/w3``
(``[local, ffn, hidden]`` gate, ``[local, hidden, ffn]`` down, ``[local, ffn, hidden]`` up) and a
``router.gate``. Launched as ``torchrun --nproc_per_node 2 ds_autoep_train.py OUT --stage S [--dtype fp32|bf16]``.
Writes ``OUT/ckpt/`` (``engine.save_checkpoint``: ``layer_L_expert_E_mp_rank_00_model_states.pt``
holding ``...experts.wK.{E}`` per global expert ``E``) and in ``OUT/reference/``:

- ``master.safetensors``: every parameter's fp32 master from ``safe_get_full_fp32_param``; the
  fused experts gathered from every expert-parallel rank and cut per global expert, named as
  DeepSpeed's expert files name them (``model.layers.L.mlp.experts.w1.{E}``);
- ``hf/``: those masters put back into a fresh ``MixtralForCausalLM`` (gate_up_proj = w1 then w3,
  as AutoEP's repack split it) and written by transformers' own ``save_pretrained``: the Hub
  layout an export must equal.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

NUM_EXPERTS = 2
EP_SIZE = 2


def config():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, num_local_experts=NUM_EXPERTS,
                         num_experts_per_tok=1, max_position_embeddings=32)


def shim_transformers_registry():
    """DeepSpeed 0.19.8's AutoEP calls ``_CAN_RECORD_REGISTRY.get(key, default)``
    (auto_ep_presets/base.py); transformers 5.24's ``_CanRecordRegistry.get`` takes one argument
    and initialize fails with a TypeError. Accept the dict form; the one-argument form is unchanged."""
    from transformers.utils import output_capturing as oc

    one_arg = oc._CanRecordRegistry.get

    def get(self, key, *default):
        return dict.get(self, key, *default) if default else one_arg(self, key)

    oc._CanRecordRegistry.get = get


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups, safe_get_full_fp32_param
    from safetensors.torch import save_file
    from transformers import MixtralForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    shim_transformers_registry()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MixtralForCausalLM(config())
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "steps_per_print": 10**9,
        # the sequential expert loop: no grouped GEMM needed on CPU
        "expert_parallel": {"enabled": True, "autoep_size": EP_SIZE, "preset_model": "mixtral", "use_grouped_mm": False},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for step in range(args.steps):
        ids = common.fixed_batch(step, batch=2, seq=8, vocab_size=64, rank=rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}")

    masters = {}
    ep_rank = groups._get_expert_parallel_rank(f"ep_size_{EP_SIZE}")  # AutoEP's expert group name
    for n, q in engine.module.named_parameters():
        full = safe_get_full_fp32_param(q).detach().cpu().clone()
        if ".experts.w" in n:  # this rank's local experts, global ids ep_rank * local + i
            local = full.shape[0]
            for i in range(local):
                masters[f"{n}.{ep_rank * local + i}"] = full[i].contiguous()
        else:
            masters[n] = full.contiguous()
    everyone = [None] * world
    dist.all_gather_object(everyone, masters)
    if rank == 0:
        full = {}
        for m in everyone:
            for n, t in m.items():
                if n in full:  # dense weights agree on every rank
                    assert torch.equal(full[n], t), n
                full[n] = t
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(full, str(ref / "master.safetensors"))
        hf = MixtralForCausalLM(config())
        sd = {}
        for n, t in full.items():
            if ".mlp.router.gate." in n:
                sd[n.replace(".mlp.router.gate.", ".mlp.gate.")] = t
            elif ".experts.w" not in n:
                sd[n] = t
        for layer in range(hf.config.num_hidden_layers):
            pre = f"model.layers.{layer}.mlp.experts."
            sd[pre + "gate_up_proj"] = torch.stack(
                [torch.cat([full[f"{pre}w1.{e}"], full[f"{pre}w3.{e}"]]) for e in range(NUM_EXPERTS)])
            sd[pre + "down_proj"] = torch.stack([full[f"{pre}w2.{e}"] for e in range(NUM_EXPERTS)])
        hf.load_state_dict(sd, strict=True)  # every weight of the HF model, from the engine's masters
        hf.save_pretrained(str(ref / "hf"))
        common.write_json(ref / "run.json", {"stage": args.stage, "world_size": world, "ep_size": EP_SIZE,
                                            "dtype": args.dtype, "num_experts": NUM_EXPERTS})
    common.finish()


if __name__ == "__main__":
    main()
