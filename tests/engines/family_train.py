"""Train one tiny model of a family (``families.py``) under DeepSpeed ZeRO and save references.

``torchrun --standalone --nproc_per_node 2 family_train.py OUT --family F --stage S``. Writes
``OUT/ckpt/`` (``engine.save_checkpoint``), ``OUT/config/config.json`` (the model's config with
``architectures``, as a user keeps it next to a raw DeepSpeed save) and ``OUT/reference/hf/``:
``save_pretrained`` (on rank 0) of a plain model loaded with the engine's fp32 masters — the names,
shapes and bytes an export must equal.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import families  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--family", choices=families.FAMILIES, required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    model = families.build(args.family)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    for step in range(args.steps):
        loss = engine(**families.batch(args.family, step, rank)).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}")

    masters, _ = common.engine_weights(engine.module, zero3=args.stage == 3)  # collective
    if rank == 0:
        families.reference_save(args.family, masters, args.out / "reference" / "hf")
        engine.module.config.save_pretrained(args.out / "config")
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
