"""Train a tiny Llama with HF ``Trainer`` under DeepSpeed ZeRO and record references at every save.

``torchrun --standalone --nproc_per_node 2 trainer_train.py OUT [--stage 3] [--gather-on-save]
[--steps 4 --save-steps 2] [--dtype fp32|bf16]``. Writes ``OUT/run/checkpoint-N/`` (the Trainer's
own save: ``global_stepN/``, ``latest``, ``config.json`` ...) and for each N
``OUT/reference/checkpoint-N/{master,module}.safetensors`` and ``logits.pt``, taken from the
engine inside the save (see ``ReferenceCallback``). ``make demo`` runs this same script.
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
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--gather-on-save", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-steps", type=int, default=2)
    args = p.parse_args()

    common.init_cpu_deepspeed_state()

    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    class ReferenceCallback(TrainerCallback):
        """At each save, record the engine's own view of the weights (collective on all ranks)."""

        def on_save(self, targs, state, control, model=None, **kwargs):
            masters, module = common.engine_weights(model, zero3=args.stage == 3)
            was_training = model.training
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=common.probe_input()).logits.detach().cpu()
            model.train(was_training)
            if state.is_world_process_zero:
                ref = args.out / "reference" / f"checkpoint-{state.global_step}"
                ref.mkdir(parents=True, exist_ok=True)
                save_file(masters, str(ref / "master.safetensors"))
                save_file(module, str(ref / "module.safetensors"))
                torch.save(logits, ref / "logits.pt")

    torch.manual_seed(0)
    model = LlamaForCausalLM(common.tiny_llama_config())
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": args.stage,
                              "stage3_gather_16bit_weights_on_model_save": args.gather_on_save},
        "bf16": {"enabled": "auto"},
    }
    targs = TrainingArguments(
        output_dir=str(args.out / "run"), max_steps=args.steps, save_steps=args.save_steps,
        per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, report_to=[],
        deepspeed=ds_config, bf16=args.dtype == "bf16", seed=0, dataloader_num_workers=0,
        disable_tqdm=True, save_strategy="steps",
        accelerator_config={"use_configured_state": True},  # keep the state made above
    )
    trainer = Trainer(model=model, args=targs, train_dataset=common.RandomTokens(), callbacks=[ReferenceCallback()])
    trainer.train()
    if trainer.is_world_process_zero():
        common.write_json(args.out / "reference" / "run.json",
                          {"stage": args.stage, "dtype": args.dtype, "steps": args.steps,
                           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
