"""Resume a saved DeepSpeed run, at its own layout or through ``hf-ckpt universal`` at another one.

``torchrun --nproc_per_node N ds_uc_resume.py OUT --from CASE_DIR --layout plain|replica|tp --stage S
--load own|universal [--dtype bf16 [--grad-accum fp32]] [--saved-dp D] [--rows R] [--config DIR]``

``CASE_DIR`` is an engine case (ds_train.py, ds_parallel_train.py, ds_configs_train.py or
ds_tp_train.py output: ``ckpt/`` saved after 2 steps, ``config/``), or, with ``--config DIR``, any
such save whose HF config.json is in ``DIR`` (a committed fixture of an older DeepSpeed): the
model is then rebuilt from that config. ``--dtype``/``--grad-accum`` repeat the saving run's
precision (bf16 with fp32 accumulation at stage 1 is DeepSpeed's BF16_Optimizer).

``--load own`` rebuilds the saving run's layout (``--layout``: plain data parallel, a replica
``mpu`` of N ranks, the TP-by-hand Llama of ds_tp_train.py) and loads ``ckpt`` with DeepSpeed's
ordinary loader; ``--load universal`` has rank 0 write (with ``--tp-rule``s) ``OUT/uc/global_step2``
with ``hf_ckpt_integrations.write_universal_checkpoint`` and loads it into a plain Llama on N
data-parallel ranks with ``"checkpoint": {"load_universal": true}``.

Either way the run records (rank 0) in ``OUT/loaded.safetensors`` the states the engine holds right
after loading — per parameter the full fp32 master, ``exp_avg`` and ``exp_avg_sq`` (gathered with
DeepSpeed's own ``safe_get_full_*`` helpers, TP slices concatenated along the dims ds_tp_train.py
split them on) — and in ``OUT/run.json`` the optimizer steps and the losses of the next two steps
on the same global batches the saving run would have seen (``--rows R``: on R rows a step instead,
the same for every run given the same R, cut evenly over its data-parallel ranks — for a layout
the saving run's batches do not divide into).
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from ds_parallel_train import GridMPU  # noqa: E402
from ds_tp_train import SPLITS, TP_VOCAB, make_tp_llama  # noqa: E402

SAVED_AT, STEPS = 2, 2


def resume_parser() -> argparse.ArgumentParser:
    """The arguments of every resume script: ``OUT`` and ``--from CASE_DIR`` (ds_pipe_resume.py too)."""
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--from", dest="src", type=Path, required=True)
    return p


def write_universal(args, ckpt: Path, config: Path, tp_rules=()):
    """Rank 0 writes ``OUT/uc/global_step2`` from ``ckpt`` with ``write_universal_checkpoint`` (its
    report in ``OUT/universal.json``); every rank waits for it. Returns ``(load_dir, tag)``."""
    tag = f"global_step{SAVED_AT}"
    if dist.get_rank() == 0:
        from hf_ckpt_integrations import write_universal_checkpoint

        report = write_universal_checkpoint(ckpt, args.out / "uc" / tag, config=str(config), tp_rules=list(tp_rules))
        common.write_json(args.out / "universal.json", report)
    dist.barrier()
    return str(args.out / "uc"), tag


def main():
    p = resume_parser()
    p.add_argument("--layout", choices=["plain", "replica", "tp"], required=True)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--load", choices=["own", "universal"], required=True)
    p.add_argument("--saved-dp", type=int, default=1, help="data-parallel size of the saving run")
    p.add_argument("--vocab", type=int, default=common.VOCAB_SIZE)
    p.add_argument("--tp-rule", action="append", default=[], help="passed to write_universal_checkpoint")
    p.add_argument("--config", type=Path, help="the save's HF config dir; the model is rebuilt from it")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--grad-accum", choices=["fp32"], default=None)
    p.add_argument("--rows", type=int, default=None, help="rows of every step's global batch")
    args = p.parse_args()

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    ckpt, load_dir, tag = args.src / "ckpt", str(args.src / "ckpt"), None
    if args.load == "universal":
        load_dir, tag = write_universal(args, ckpt, args.config or args.src / "config", args.tp_rule)

    if args.config is not None:
        config = LlamaConfig.from_pretrained(str(args.config))
        args.vocab = config.vocab_size
    else:
        config = common.tiny_llama_config(vocab_size=args.vocab)
    mpu, mp, dp, dp_rank = None, 1, world, rank
    torch.manual_seed(1)  # another init than the saving run: everything must come from the checkpoint
    if args.load == "own" and args.layout in ("replica", "tp"):
        mpu = GridMPU(world // args.saved_dp)
        mp, dp, dp_rank = mpu.get_model_parallel_world_size(), mpu.get_data_parallel_world_size(), \
            mpu.get_data_parallel_rank()
        model = make_tp_llama(config, mpu) if args.layout == "tp" else LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM(config)
    # Each data-parallel rank of this run takes an equal share of the saving run's global batch
    # (or of --rows rows).
    if args.rows:
        share, micro = None, args.rows // dp
        assert micro * dp == args.rows, f"{args.rows} rows do not split over {dp} data-parallel ranks"
    else:
        share = args.saved_dp // dp if args.saved_dp >= dp else None
        assert share and share * dp == args.saved_dp, "the saving run's batches must split evenly"
        micro = 2 * share
    ds_config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                 "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9}
    if args.dtype == "bf16":
        ds_config["bf16"] = {"enabled": True}
    if args.grad_accum:
        ds_config["data_types"] = {"grad_accum_dtype": args.grad_accum}
    if args.load == "universal":
        ds_config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu)
    path, _ = engine.load_checkpoint(load_dir, tag=tag)
    assert path is not None, f"nothing loaded from {load_dir}"

    # ZeRO-1/2 link each parameter to its optimizer-state fragments lazily (at the first step): now.
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    loaded = {}
    for name, param in engine.module.named_parameters():
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            full = safe_get_full_fp32_param(param) if state == "fp32" else safe_get_full_optimizer_state(param, state)
            full = full.detach().cpu().contiguous()
            dim = next((d for k, d in SPLITS.items() if f"{k}." in name), None) if args.layout == "tp" and mpu else None
            if dim is not None:
                parts = [torch.empty_like(full) for _ in range(mp)]
                dist.all_gather(parts, full, group=mpu.get_model_parallel_group())
                full = torch.cat(parts, dim=dim).contiguous()
            loaded[f"{state}/{name}"] = full.clone()
    base = engine.optimizer.optimizer
    steps = sorted({float(s["step"]) for s in base.state.values() if "step" in s})

    losses = []
    for step in range(SAVED_AT, SAVED_AT + STEPS):
        if args.rows:
            ids = common.fixed_batch(step, batch=args.rows, vocab_size=args.vocab)
            ids = ids[dp_rank * micro:(dp_rank + 1) * micro]
        elif args.layout == "plain":  # the saving run's rank r used fixed_batch(step, rank=r)
            ids = torch.cat([common.fixed_batch(step, rank=r, vocab_size=args.vocab)
                             for r in range(dp_rank * share, (dp_rank + 1) * share)])
        else:  # replicas / TP ranks of one data-parallel rank share its batch (saved with dp 1)
            ids = common.fixed_batch(step, rank=dp_rank, vocab_size=args.vocab)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses.append(reduced.item() / world)  # replicas/TP ranks report the same loss; DP ranks: the mean
    if rank == 0:
        save_file(loaded, str(args.out / "loaded.safetensors"))
        common.write_json(args.out / "run.json", {"load": args.load, "layout": args.layout, "world_size": world,
                                                  "stage": args.stage, "steps": steps, "losses": losses,
                                                  "optimizer": type(engine.optimizer).__name__,
                                                  "losses_hex": [float(x).hex() for x in losses],
                                                  "global_steps": engine.global_steps})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
