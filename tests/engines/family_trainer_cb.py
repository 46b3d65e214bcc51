"""A tiny MoE model (``families.py``) trained with HF ``Trainer`` + DeepSpeed ZeRO and
``ConsolidatedCheckpointCallback``, then saved live (the Accelerate hook's path) — both must write
the Hub layout.

``torchrun --standalone --nproc_per_node 2 family_trainer_cb.py OUT --family mixtral --stage 3``.
Writes ``OUT/run/checkpoint-2/`` (Trainer + callback), ``OUT/live/`` (``live_tensors`` of the
ZeRO-3 module through ``write_distributed``, what ``accelerator.save_model`` runs) and
``OUT/reference/hf/`` (``save_pretrained`` of a plain model holding the engine's fp32 masters).
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
    p.add_argument("--family", choices=families.MOE, required=True)
    p.add_argument("--stage", type=int, default=3)
    args = p.parse_args()

    common.init_cpu_deepspeed_state()
    from transformers import Trainer, TrainingArguments

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
    }
    targs = TrainingArguments(
        output_dir=str(args.out / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=[], deepspeed=ds_config, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, save_strategy="steps", accelerator_config={"use_configured_state": True},
    )
    trainer = Trainer(model=families.build(args.family), args=targs, train_dataset=Tokens(args.family),
                      callbacks=[ConsolidatedCheckpointCallback(dtype="fp32")])
    trainer.train()

    module = trainer.model_wrapped.module
    write_distributed(live_tensors(module, dtype="fp32"), args.out / "live", collective=reads_are_collective(module))
    masters, _ = common.engine_weights(module, zero3=args.stage == 3)  # collective
    if rank == 0:
        families.reference_save(args.family, masters, args.out / "reference" / "hf")
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
