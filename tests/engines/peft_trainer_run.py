"""Fine-tune a tiny Llama with a peft LoRA adapter under HF ``Trainer`` + DeepSpeed, with
``ConsolidatedCheckpointCallback``, and record the engine's own adapter at every save.

``torchrun --standalone --nproc_per_node 2 peft_trainer_run.py OUT --stage S [--gather-on-save]
[--modules-to-save] [--rslora] [--adapter-name NAME] [--no-callback]``.

Writes ``OUT/base/`` (the frozen base model, ``save_pretrained`` before training; the run loads it
from there, so ``adapter_config.json`` names it), ``OUT/run/checkpoint-N/`` (Trainer + callback),
``OUT/reference/checkpoint-N/adapter.safetensors`` (peft's ``get_peft_model_state_dict`` of the
adapter parameters gathered from the engine inside the save) and ``logits.safetensors`` (the PEFT
model's logits on the probe input at that moment), ``OUT/acc/`` (``accelerator.save_model`` with
``install_accelerate_hooks`` after training) and ``OUT/metrics/rank{r}.json`` (peak RSS before
and after each callback save). ``--nccl-rules``: that ``save_model`` again with NCCL's device rules
on (tests/support/nccl_rules.py), partitions on the device and offloaded: ``OUT/nccl/{device,cpu}/``.
"""
import argparse
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def rss_mb():
    """Peak RSS of this process so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb():
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--gather-on-save", action="store_true")
    p.add_argument("--modules-to-save", action="store_true")
    p.add_argument("--rslora", action="store_true")
    p.add_argument("--adapter-name", default="default")
    p.add_argument("--no-callback", action="store_true", help="the Trainer alone (what users get today)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--nccl-rules", action="store_true")
    args = p.parse_args()

    common.init_cpu_deepspeed_state()
    rank = torch.distributed.get_rank()

    import deepspeed
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_ckpt_integrations import ConsolidatedCheckpointCallback, install_accelerate_hooks

    base_dir = args.out / "base"
    if rank == 0:
        torch.manual_seed(0)
        LlamaForCausalLM(common.tiny_llama_config()).save_pretrained(base_dir)
    torch.distributed.barrier()
    model = LlamaForCausalLM.from_pretrained(base_dir)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["lm_head"] if args.modules_to_save else None, use_rslora=args.rslora,
                      task_type="CAUSAL_LM")
    torch.manual_seed(1)
    model = get_peft_model(model, lora, adapter_name=args.adapter_name)
    probe = common.probe_input()
    metrics = {"saves": {}}

    class ReferenceCallback(TrainerCallback):
        """The engine's own adapter inside the save: the trainable parameters gathered (collective)."""

        def on_save(self, targs, state, control, model=None, **kwargs):
            trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
            with deepspeed.zero.GatheredParameters([q for _, q in trainable], enabled=args.stage == 3):
                gathered = {n: q.detach().cpu().clone().contiguous() for n, q in trainable}
            adapter = get_peft_model_state_dict(model, state_dict=gathered, adapter_name=args.adapter_name,
                                                save_embedding_layers=False)
            was_training = model.training
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=probe).logits.detach().cpu().contiguous()
            model.train(was_training)
            if rank == 0:
                ref = args.out / "reference" / f"checkpoint-{state.global_step}"
                ref.mkdir(parents=True, exist_ok=True)
                save_file({k: v.contiguous() for k, v in adapter.items()}, str(ref / "adapter.safetensors"))
                save_file({"logits": logits}, str(ref / "logits.safetensors"))

    class Measured(ConsolidatedCheckpointCallback):
        def _consolidate(self, directory, model):
            before, current = rss_mb(), current_rss_mb()
            out = super()._consolidate(directory, model)
            metrics["saves"][Path(directory).name] = {"peak_rss_before_mb": before, "peak_rss_after_mb": rss_mb(),
                                                      "rss_before_mb": current, "rss_after_mb": current_rss_mb()}
            return out

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": args.stage,
                              "stage3_gather_16bit_weights_on_model_save": args.gather_on_save},
    }
    targs = TrainingArguments(
        output_dir=str(args.out / "run"), max_steps=args.steps, save_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, logging_steps=1, report_to=[], deepspeed=ds_config, seed=0, dataloader_num_workers=0,
        disable_tqdm=True, save_strategy="steps", accelerator_config={"use_configured_state": True},
    )
    callbacks = [ReferenceCallback()] + ([] if args.no_callback else [Measured()])
    trainer = Trainer(model=model, args=targs, train_dataset=common.RandomTokens(), callbacks=callbacks)
    trainer.train()

    if not args.no_callback:
        install_accelerate_hooks(trainer.accelerator)
        before = rss_mb()
        trainer.accelerator.save_model(trainer.model_wrapped, str(args.out / "acc"))
        metrics["accelerate_save"] = {"peak_rss_before_mb": before, "peak_rss_after_mb": rss_mb()}
        if args.nccl_rules:
            from tests.support import nccl_rules

            nccl_rules.engine_saves(lambda dst: trainer.accelerator.save_model(trainer.model_wrapped, str(dst)),
                                    trainer.accelerator.unwrap_model(trainer.model_wrapped), args.out / "nccl")
    metrics["peak_rss_end_mb"] = rss_mb()
    (args.out / "metrics").mkdir(parents=True, exist_ok=True)
    common.write_json(args.out / "metrics" / f"rank{rank}.json", metrics)
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
