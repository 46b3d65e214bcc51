"""Seed 001 end to end: save a TP=2 (or DP=2) ZeRO-1 run, convert it with DeepSpeed's own
``ds_to_universal``, load it at TP=1 / DP=1 with ``checkpoint.load_universal`` and keep training.

``torchrun --nproc_per_node 2 ds_universal.py OUT train --layout tp|dp --info helper|naive``
    trains 4 steps, saves at step 2 (``--info helper``: with
    ``hf_ckpt_integrations.integrations.deepspeed.save_checkpoint``; ``naive``: with a bare
    ``{"universal_checkpoint_version": ...}``, what a user adds to get past ds_to_universal's
    assert), records the loss of every step, and converts ``global_step2`` to
    ``global_step2_universal`` on rank 0.
``torchrun --nproc_per_node 1 ds_universal.py OUT resume --from DIR``
    loads DIR's universal checkpoint into a plain (TP=1, DP=1) Llama, runs steps 2 and 3 on the
    same global batches, records the losses.
"""
import argparse
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from ds_parallel_train import GridMPU  # noqa: E402
from ds_tp_train import TP_VOCAB, make_tp_llama  # noqa: E402

STEPS, SAVE_AT = 4, 2


def ds_config(**extra):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 10**9, **extra}


def global_batch(step, dp):
    return torch.cat([common.fixed_batch(step, rank=r, vocab_size=TP_VOCAB) for r in range(dp)])


def train(args):
    import deepspeed
    from hf_ckpt_integrations.integrations.deepspeed import save_checkpoint, universal_checkpoint_info

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    config = common.tiny_llama_config(vocab_size=TP_VOCAB)
    if args.layout == "tp":
        mpu = GridMPU(world)
        model, dp, dp_rank = make_tp_llama(config, mpu), 1, 0
    else:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        mpu, model, dp, dp_rank = None, LlamaForCausalLM(config), world, rank
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(), mpu=mpu)
    losses = []
    for step in range(STEPS):
        if step == SAVE_AT:
            if args.info == "helper":
                save_checkpoint(engine, str(args.out / "ckpt"), tag=f"global_step{SAVE_AT}")
            else:
                info = {"universal_checkpoint_version": universal_checkpoint_info(engine.module)["universal_checkpoint_version"]}
                engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{SAVE_AT}",
                                       client_state={"universal_checkpoint_info": info})
        ids = common.fixed_batch(step, rank=dp_rank, vocab_size=TP_VOCAB)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world)  # mean over ranks: the global batch's loss
    if rank == 0:
        config.save_pretrained(args.out / "config")
        src = args.out / "ckpt" / f"global_step{SAVE_AT}"
        r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
                            "--output_folder", str(src) + "_universal"], capture_output=True, text=True)
        (args.out / "ds_to_universal.log").write_text(r.stdout + r.stderr)
        common.write_json(args.out / "run.json", {"layout": args.layout, "info": args.info, "world_size": world,
                                                  "dp": dp, "losses": losses, "ds_to_universal_rc": r.returncode})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


def resume(args):
    import deepspeed
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    source = Path(args.src)
    if not source.is_absolute():  # relative to OUT's parent: the test cache holds the earlier case there
        source = args.out.parent / source
    import json

    trained = json.loads((source / "run.json").read_text())
    dp = trained["dp"]
    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    model = LlamaForCausalLM(common.tiny_llama_config(vocab_size=TP_VOCAB))
    cfg = ds_config(checkpoint={"load_universal": True})
    cfg["train_micro_batch_size_per_gpu"] = 2 * dp
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    engine.load_checkpoint(str(source / "ckpt"))
    losses = []
    for step in range(SAVE_AT, STEPS):
        ids = global_batch(step, dp)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    common.write_json(args.out / "run.json", {"resumed_from": str(source), "losses": losses,
                                              "expected": trained["losses"][SAVE_AT:]})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("mode", choices=["train", "resume"])
    p.add_argument("--layout", choices=["tp", "dp"], default="tp")
    p.add_argument("--info", choices=["helper", "naive"], default="helper")
    p.add_argument("--from", dest="src")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (train if args.mode == "train" else resume)(args)


if __name__ == "__main__":
    main()
