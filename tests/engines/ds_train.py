"""Train a tiny Llama under a real DeepSpeed ZeRO engine and save a checkpoint with references.

Launched by the tests as ``torchrun --standalone --nproc_per_node N ds_train.py OUT --stage S
--dtype fp32|bf16 [--variant plain|frozen|tied]``. Writes:

- ``OUT/ckpt/``: ``engine.save_checkpoint`` output (``latest``, ``global_stepK/``);
- ``OUT/config/config.json``: the HF config (a raw DeepSpeed save has none; tests pass ``--config``);
- ``OUT/reference/master.safetensors``: fp32 masters from ``safe_get_full_fp32_param``;
- ``OUT/reference/module.safetensors``: 16-bit (training-dtype) module weights, gathered under
  ZeRO-3 with ``GatheredParameters``;
- ``OUT/reference/logits.pt``: the engine's logits on ``common.probe_input()``.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--variant", choices=["plain", "frozen", "tied"], default="plain")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    import deepspeed
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    config = common.tiny_llama_config(tie_word_embeddings=args.variant == "tied")
    model = LlamaForCausalLM(config)
    if args.variant == "frozen":
        # Frozen parameters live outside the optimizer's flat groups: ZeRO-2/3 store them as
        # "frozen_param_fragments", ZeRO-1 only in the module state dict.
        model.model.embed_tokens.weight.requires_grad_(False)
        model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)

    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)

    for step in range(args.steps):
        ids = common.fixed_batch(step, rank=rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    ckpt = args.out / "ckpt"
    engine.save_checkpoint(str(ckpt), tag=f"global_step{args.steps}")

    # References, taken from the engine itself. Every call below is a collective.
    named = list(engine.module.named_parameters())
    masters, module = common.engine_weights(engine.module, zero3=args.stage == 3)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=common.probe_input()).logits.detach().cpu()

    if rank == 0:
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(masters, str(ref / "master.safetensors"))
        save_file(module, str(ref / "module.safetensors"))
        torch.save(logits, ref / "logits.pt")
        config.save_pretrained(args.out / "config")
        common.write_json(ref / "run.json", {"stage": args.stage, "dtype": args.dtype,
                                            "variant": args.variant, "steps": args.steps,
                                            "world_size": torch.distributed.get_world_size(),
                                            "frozen": [n for n, p in named if not p.requires_grad]})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
