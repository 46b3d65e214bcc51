"""Train a tiny Llama with HF ``Trainer`` + DeepSpeed and ``ConsolidatedCheckpointCallback``.

``torchrun --standalone --nproc_per_node 2 trainer_callback_run.py OUT --stage S [--dtype fp32|bf16]
[--gather-on-save] [--cb-dtype fp32] [--checkpoints every|last] [--max-shard-size 300KB]
[--save-total-limit 2] [--resume-from CASE/run/checkpoint-4] [--final] [--fail-test]``.

Writes ``OUT/run/checkpoint-N/`` (Trainer + callback), ``OUT/reference/checkpoint-N/`` (the engine's
own weights at save time, as in ``trainer_train.py``), ``OUT/reference/run.json`` (losses); with
``--resume-from DIR`` the run resumes from that checkpoint (a fresh process, as a user would); with
``--final`` ``OUT/final/`` from ``hf_ckpt_integrations.integrations.trainer.save_model`` and
``OUT/reference/final/``; with ``--fail-test`` ``OUT/fail/rank{r}.json``: what each rank saw when
rank 1 fails to write its shard. ``OUT/metrics/rank{r}.json``: seconds and peak RSS per rank.
``--nccl-rules``: the callback's consolidation of the last checkpoint again (a copy without its HF
weights), with NCCL's device rules on (tests/support/nccl_rules.py): ``OUT/nccl/device/``.
"""
import argparse
import hashlib
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def tree_hash(path):
    h = hashlib.sha256()
    for p in sorted(Path(path).iterdir()):
        if p.is_file():
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def dump(path, obj):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    common.write_json(path, obj)


def consolidate_under_rules(cb, model, checkpoint, out):
    """The callback's consolidation of ``checkpoint`` again, under NCCL's rules, into a copy of it
    without the HF weights the callback wrote there (``out/device``)."""
    import shutil

    from tests.support import nccl_rules

    def save(dst):
        if rank() == 0:
            shutil.copytree(checkpoint, dst, ignore=shutil.ignore_patterns("model*.safetensors", "model*.json"))
        torch.distributed.barrier()
        return cb._consolidate(str(dst), model)

    nccl_rules.engine_saves(save, model, out, variants=("device",))


def rank():
    return torch.distributed.get_rank()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--gather-on-save", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--cb-dtype", default=None)
    p.add_argument("--checkpoints", default="every")
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--resume-from", default=None,
                   help="resume instead of training from scratch: a checkpoint-N dir; a relative path is taken "
                        "from OUT's parent (the test cache holds the earlier case there)")
    p.add_argument("--final", action="store_true")
    p.add_argument("--fail-test", action="store_true")
    p.add_argument("--nccl-rules", action="store_true")
    args = p.parse_args()

    common.init_cpu_deepspeed_state()

    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_ckpt_integrations import ConsolidatedCheckpointCallback
    from hf_ckpt_integrations import orchestrator
    from hf_ckpt_integrations.integrations import _dist

    rank = torch.distributed.get_rank()

    def record(model, ref):
        masters, module = common.engine_weights(model, zero3=args.stage == 3)
        if rank == 0:
            ref.mkdir(parents=True, exist_ok=True)
            save_file(masters, str(ref / "master.safetensors"))
            save_file(module, str(ref / "module.safetensors"))

    class ReferenceCallback(TrainerCallback):
        def __init__(self, root):
            self.root = root

        def on_save(self, targs, state, control, model=None, **kwargs):
            record(model, self.root / f"checkpoint-{state.global_step}")

    seconds, written = [], {}

    class Timed(ConsolidatedCheckpointCallback):
        def _consolidate(self, directory, model):
            t = time.perf_counter()
            out = super()._consolidate(directory, model)
            seconds.append(round(time.perf_counter() - t, 3))
            written[os.path.basename(directory)] = out.get("written_here", [])
            return out

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "zero_optimization": {"stage": args.stage,
                              "stage3_gather_16bit_weights_on_model_save": args.gather_on_save},
        "bf16": {"enabled": "auto"},
    }

    def make_trainer(output_dir):
        torch.manual_seed(0)
        model = LlamaForCausalLM(common.tiny_llama_config())
        targs = TrainingArguments(
            output_dir=str(output_dir), max_steps=args.steps, save_steps=args.save_steps,
            save_total_limit=args.save_total_limit,
            per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1, report_to=[],
            deepspeed=ds_config, bf16=args.dtype == "bf16", seed=0, dataloader_num_workers=0,
            disable_tqdm=True, save_strategy="steps",
            accelerator_config={"use_configured_state": True},
        )
        cb = Timed(dtype=args.cb_dtype, checkpoints=args.checkpoints, max_shard_size=args.max_shard_size)
        trainer = Trainer(model=model, args=targs, train_dataset=common.RandomTokens(),
                          callbacks=[ReferenceCallback(args.out / "reference"), cb])
        return trainer, cb

    def losses(trainer):
        return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}

    trainer, cb = make_trainer(args.out / "run")
    resume = None
    if args.resume_from is not None:
        resume = Path(args.resume_from)
        resume = str(resume if resume.is_absolute() else args.out.parent / resume)
    trainer.train(resume_from_checkpoint=resume)
    run = {"resumed_from": resume, "stage": args.stage, "dtype": args.dtype, "steps": args.steps, "losses": losses(trainer),
           "reports": {os.path.basename(k): v for k, v in cb.reports.items()}}

    if args.final:
        record(trainer.model, args.out / "reference" / "final")
        run["final"] = cb.save_model(trainer, str(args.out / "final"))

    if args.fail_test:
        target = args.out / "run" / f"checkpoint-{args.steps}"
        before = tree_hash(target) if rank == 0 else None
        real_write_shard = orchestrator.write_shard
        if rank == 1:
            def failing(path, tensors, progress=None):
                raise OSError(28, "No space left on device (injected on rank 1)", path)
            orchestrator.write_shard = failing  # this rank's disk "fills up"; the other rank is healthy
        try:
            _dist.consolidate_checkpoint(target, dtype="fp32", max_shard_size="100KB", existing="replace")
            seen = {"raised": False}
        except Exception as e:  # what a user's script would see on this rank
            seen = {"raised": True, "type": type(e).__name__, "message": str(e),
                    "failures": {str(k): v for k, v in getattr(e, "failures", {}).items()}}
        orchestrator.write_shard = real_write_shard  # the disk is fine again for what follows
        torch.distributed.barrier()
        if rank == 0:
            seen["unchanged"] = tree_hash(target) == before
            seen["leftovers"] = [n for n in os.listdir(target) if n.startswith(".hfckpt")]
        dump(args.out / "fail" / f"rank{rank}.json", seen)

    dump(args.out / "metrics" / f"rank{rank}.json",
                      {"consolidate_seconds": seconds, "written_here": written,
                       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    if rank == 0:
        dump(args.out / "reference" / "run.json", run)
    if args.nccl_rules:
        consolidate_under_rules(cb, trainer.model, args.out / "run" / f"checkpoint-{args.steps}", args.out / "nccl")
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
