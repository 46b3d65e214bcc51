"""Train a tiny Llama with a plain HF ``Trainer`` (no DeepSpeed, one process) and keep its checkpoint.

``torchrun --standalone --nproc_per_node 1 trainer_plain.py OUT``. Writes ``OUT/run/checkpoint-2/``:
``model.safetensors`` beside the Trainer's own pickles (``training_args.bin``, ``optimizer.pt``,
``scheduler.pt``, ``rng_state.pth``), which an export must neither read as weights nor refuse.
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
    args = p.parse_args()

    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(common.tiny_llama_config())
    targs = TrainingArguments(
        output_dir=str(args.out / "run"), max_steps=2, save_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
        save_strategy="steps", use_cpu=True)
    Trainer(model=model, args=targs, train_dataset=common.RandomTokens(n=8)).train()
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
