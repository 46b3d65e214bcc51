"""A tiny MoE model (``families.py``) trained with HF ``Trainer`` + DeepSpeed ZeRO and
``ConsolidatedCheckpointCallback``, then saved live (the Accelerate hook's path) — both must write
the Hub layout.

``torchrun --standalone --nproc_per_node 2 family_trainer_cb.py OUT --family mixtral --stage 3``.
Writes ``OUT/run/checkpoint-2/`` (Trainer + callback), ``OUT/live/`` (``live_tensors`` of the
ZeRO-3 module through ``write_distributed``, what ``accelerator.save_model`` runs) and
``OUT/reference/hf/`` (``save_pretrained`` of a plain model holding the engine's fp32 masters).

``--family deepseek_v3 --bf16``: bf16 training (DeepSpeed ``bf16``), the callback at its default
dtype (the training dtype); the routers the class keeps in fp32 must come from the masters.
Writes ``OUT/run/checkpoint-2/``, ``OUT/reference/hf/`` (the fp32 masters, ``save_pretrained``) and
``OUT/reference/hf-bf16/`` (``from_pretrained(masters, dtype=bf16).save_pretrained()``); no live save.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import families  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, family, n=8):
        self.items = [{k: v[0] for k, v in families.batch(family, i, 0, size=1).items()} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--family", choices=(*families.MOE, "deepseek_v3"), required=True)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--bf16", action="store_true")
    args = p.parse_args()

    common.init_cpu_deepspeed_state()
    import transformers.training_args
    from transformers import Trainer, TrainingArguments

    if args.bf16:
        # Test-support shim: TrainingArguments refuses bf16 without a bf16 GPU; DeepSpeed's bf16
        # runs on CPU (gloo), and that is what this run needs.
        transformers.training_args.is_torch_bf16_gpu_available = lambda: True

    from hf_ckpt_integrations import ConsolidatedCheckpointCallback
    from hf_ckpt_integrations.integrations._dist import write_distributed
    from hf_ckpt_integrations.sources.live import live_tensors, reads_are_collective

    rank = torch.distributed.get_rank()
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        # Threshold 0: every parameter stays partitioned, so the live save streams partitions
        # (an expert's slice: only the ranks that hold it) instead of reading persistent copies.
        "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": False,
                              "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": "auto"},
    }
    targs = TrainingArguments(
        output_dir=str(args.out / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=[], deepspeed=ds_config, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, save_strategy="steps", accelerator_config={"use_configured_state": True},
        bf16=args.bf16,
    )
    model = _deepseek_v3() if args.family == "deepseek_v3" else families.build(args.family)
    callback = ConsolidatedCheckpointCallback() if args.bf16 else ConsolidatedCheckpointCallback(dtype="fp32")
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(args.family), callbacks=[callback])
    trainer.train()
    if args.bf16:
        masters, _ = common.engine_weights(trainer.model_wrapped.module, zero3=args.stage == 3)  # collective
        if rank == 0:
            ref = _deepseek_v3()
            missing, unexpected = ref.load_state_dict(masters, strict=False)
            assert not unexpected and not set(missing) - {n for n, _ in ref.named_buffers()}, (missing, unexpected)
            ref.save_pretrained(args.out / "reference" / "hf")
            key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
            type(ref).from_pretrained(args.out / "reference" / "hf", **{key: torch.bfloat16}).save_pretrained(
                args.out / "reference" / "hf-bf16")
        common.finish()
        return

    module = trainer.model_wrapped.module
    write_distributed(live_tensors(module, dtype="fp32"), args.out / "live", collective=reads_are_collective(module))
    masters, _ = common.engine_weights(module, zero3=args.stage == 3)  # collective
    if rank == 0:
        families.reference_save(args.family, masters, args.out / "reference" / "hf")
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


def _deepseek_v3():
    """A tiny DeepSeek-V3 (dense layer 0, MoE layer 1): its class keeps the router (``gate.weight``,
    ``e_score_correction_bias``) in fp32 (``_keep_in_fp32_modules_strict``)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.DeepseekV3Config(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, vocab_size=families.VOCAB,
                              max_position_embeddings=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                              topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
                              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return tf.DeepseekV3ForCausalLM(cfg)


if __name__ == "__main__":
    main()
