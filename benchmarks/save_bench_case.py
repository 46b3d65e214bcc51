"""One stage of the save-time benchmark: a live Llama under Accelerate + DeepSpeed ZeRO-2 or ZeRO-3.

Launched by ``save_bench.py`` as ``torchrun --standalone --nproc_per_node P save_bench_case.py WORK
--stage 2|3 --size 156m|small --rounds N --shard 100MB`` (P ranks, 2 by default). In one engine
process per rank it saves the same bf16 module ``N`` times with each variant, alternating (round
``r`` starts at variant ``r``), every run into a fresh directory ``WORK/<variant>``:

- ``save_pretrained``: plain ``transformers`` ``save_pretrained`` on rank 0 (ZeRO-2: the module
  itself; ZeRO-3: ``save_pretrained(state_dict=sd)`` of a full state dict gathered before the
  timer starts, i.e. the cost of writing the same bytes); the other ranks only wait at the barrier;
- ZeRO-3 only, ``ds_gather_save``: DeepSpeed's own gather and ``save_pretrained``, end to end:
  ``engine._zero3_consolidated_16bit_state_dict()`` on every rank (rank 0 receives the full state
  dict), then rank 0 ``save_pretrained(state_dict=sd)`` — the baseline of the ZeRO-3 goal;
- ``hooks``: ``accelerator.save_model`` after ``install_accelerate_hooks`` (this package), all ranks;
- ``accelerate``: Accelerate's own ``save_model`` (kept at ``accelerator._hf_ckpt_hooks``), i.e.
  DeepSpeed's clone path: ``clone_tensors_for_torch_save(state_dict)`` under ZeRO-2,
  ``engine._zero3_consolidated_16bit_state_dict()`` under ZeRO-3;
- ZeRO-3 only, two references that write nothing: ``gather_only`` (every parameter once through
  ``deepspeed.zero.GatheredParameters``, one at a time, bytes dropped: what the hooks' gathers cost
  without the writing) and ``gather_largest`` (the largest parameter alone).

Per run and rank: wall seconds (``perf_counter`` around the call plus a final barrier) and the
extra resident memory of the save: peak RSS during the call minus RSS just before it. The peak is
the larger of the kernel's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``
just before the call) and a sampler thread reading ``/proc/self/statm`` every 2 ms (the sampler
alone can miss peaks: it needs the GIL). Before each run, untimed: the previous output is removed,
``os.sync()`` flushes its dirty pages, ``gc.collect()`` and ``malloc_trim(0)`` return freed heap
memory to the kernel, then a barrier. Round 1's outputs are kept as ``WORK/check-<variant>`` for
the equality check the driver runs. Writes ``WORK/rank{r}.json``.
"""
import argparse
import ctypes
import gc
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "engines"))
import common  # noqa: E402  (tests/engines/common.py: init_cpu_deepspeed_state)

VARIANTS = ("save_pretrained", "hooks", "accelerate")
# ZeRO-3 only, a save: DeepSpeed's own gather + save_pretrained, timed end to end.
DS_GATHER = ("ds_gather_save",)
# ZeRO-3 only, references (not saves): the floor under any save that gathers parameter by parameter.
GATHER_REFS = ("gather_only", "gather_largest")
# hidden, layers, intermediate, heads, kv heads, vocab
SHAPES = {
    "156m": (1024, 8, 2816, 16, 4, 32000),  # the z2/z3-156m shape of benchmarks/make_ckpt.py
    "small": (128, 2, 352, 4, 2, 4000),     # smoke run only
}
PAGE = os.sysconf("SC_PAGE_SIZE")


def llama_config(size):
    from transformers import LlamaConfig

    hidden, layers, inter, heads, kv, vocab = SHAPES[size]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                       tie_word_embeddings=False)


# ---------------------------------------------------------------- memory
_statm = os.open("/proc/self/statm", os.O_RDONLY)


def rss_bytes() -> int:
    """Resident set size now (the VmRSS of /proc/self/status, read from statm: cheaper)."""
    return int(os.pread(_statm, 128, 0).split()[1]) * PAGE


def reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def hwm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


try:
    _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
except (OSError, AttributeError):
    _malloc_trim = None


class Sampler:
    """Peak of :func:`rss_bytes` sampled every ``interval`` seconds while in the ``with`` block."""

    def __init__(self, interval=0.002):
        self.interval, self.peak, self.samples = interval, 0, 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return False


# ---------------------------------------------------------------- the run
def main():
    p = argparse.ArgumentParser()
    p.add_argument("work", type=Path)
    p.add_argument("--stage", type=int, choices=[2, 3], required=True)
    p.add_argument("--size", choices=sorted(SHAPES), default="156m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shard", default="100MB")
    args = p.parse_args()

    common.init_cpu_deepspeed_state()  # before Accelerator: the real world size under gloo on CPU

    import deepspeed
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from hf_ckpt_integrations import install_accelerate_hooks

    hf_logging.disable_progress_bar()  # save_pretrained's per-shard tqdm bar: log noise only

    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        # true so that Accelerate's own save_model (the "accelerate" variant) can run under ZeRO-3;
        # the hooks do not need it.
        "zero_optimization": {"stage": args.stage, "stage3_gather_16bit_weights_on_model_save": True},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config), mixed_precision="bf16")
    install_accelerate_hooks(accelerator)
    original_save_model = accelerator._hf_ckpt_hooks["original_save_model"]
    dist = torch.distributed
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == accelerator.num_processes, (world, accelerator.num_processes)

    torch.manual_seed(0)
    config = llama_config(args.size)
    model = LlamaForCausalLM(config)
    optimizer = DummyOptim(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    # One training step, so the saved weights are the optimizer's output (bf16 views of ZeRO's
    # flat buffer under ZeRO-2, partitions under ZeRO-3), as in a real run.
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    module = accelerator.unwrap_model(model)
    names_params = list(module.named_parameters())
    n_params = sum(int(getattr(q, "ds_numel", q.numel())) for _, q in names_params)
    dtypes = sorted({str(q.dtype) for _, q in names_params})

    def gather_full_state_dict():
        """Rank 0: a full CPU copy of every parameter (one ``GatheredParameters`` at a time). Collective."""
        sd = {}
        for name, q in names_params:
            with deepspeed.zero.GatheredParameters([q], modifier_rank=None):
                if rank == 0:
                    sd[name] = q.detach().clone()
        return sd if rank == 0 else None

    largest = max(names_params, key=lambda nq: int(getattr(nq[1], "ds_numel", nq[1].numel())))

    def gather_each(params):
        for _, q in params:
            with deepspeed.zero.GatheredParameters([q], modifier_rank=None):
                pass

    def run(variant, dst):
        """The timed call of ``variant`` (every rank calls it)."""
        if variant == "gather_only":
            gather_each(names_params)
        elif variant == "gather_largest":
            gather_each([largest])
        elif variant == "save_pretrained":
            if rank == 0:
                kwargs = {"state_dict": pending.pop("sd")} if args.stage == 3 else {}
                module.save_pretrained(dst, max_shard_size=args.shard, **kwargs)
        elif variant == "hooks":
            accelerator.save_model(model, dst, max_shard_size=args.shard)
        elif variant == "accelerate":
            original_save_model(model, dst, max_shard_size=args.shard)
        elif variant == "ds_gather_save":
            sd = model._zero3_consolidated_16bit_state_dict()  # collective; the full dict on rank 0
            if rank == 0:
                module.save_pretrained(dst, state_dict=sd, max_shard_size=args.shard)
            del sd
        dist.barrier()

    saves = VARIANTS + (DS_GATHER if args.stage == 3 else ())
    variants = saves + (GATHER_REFS if args.stage == 3 else ())
    runs = {v: [] for v in variants}
    pending = {}
    for r in range(args.rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for variant in order:
            dst = args.work / variant
            if rank == 0:
                shutil.rmtree(dst, ignore_errors=True)
            if variant == "save_pretrained" and args.stage == 3:
                pending["sd"] = gather_full_state_dict()  # untimed: the baseline is the cost of writing
            os.sync()
            gc.collect()
            if _malloc_trim is not None:
                _malloc_trim(0)
            dist.barrier()
            hwm_ok = reset_hwm()
            with Sampler() as sampler:
                before = rss_bytes()
                started = time.perf_counter()
                run(variant, dst)
                wall = time.perf_counter() - started
            pending.clear()
            peak_hwm = hwm_bytes() if hwm_ok else 0
            peak = max(sampler.peak, peak_hwm)
            runs[variant].append({"round": r, "wall": wall, "rss_before": before, "peak": peak,
                                  "peak_sampled": sampler.peak, "peak_hwm": peak_hwm, "samples": sampler.samples,
                                  "extra": peak - before})
            print(f"[stage {args.stage} rank {rank}] round {r} {variant}: {wall:.2f} s, "
                  f"extra RSS {(peak - before) / 1e6:.0f} MB (sampled {(sampler.peak - before) / 1e6:.0f} MB, "
                  f"{sampler.samples} samples)", flush=True)
            dist.barrier()
            if r == 0 and rank == 0 and variant in saves:
                keep = args.work / f"check-{variant}"
                shutil.rmtree(keep, ignore_errors=True)
                os.rename(dst, keep)
            dist.barrier()

    out = {"rank": rank, "world": world, "stage": args.stage, "size": args.size, "shard": args.shard, "params": n_params,
           "param_dtypes": dtypes, "largest_param": [largest[0], int(getattr(largest[1], "ds_numel",
                                                                              largest[1].numel()))],
           "runs": runs, "hwm_reset": reset_hwm(),
           "malloc_trim": _malloc_trim is not None}
    (args.work / f"rank{rank}.json").write_text(json.dumps(out, indent=1))
    for variant in saves:
        if rank == 0:
            shutil.rmtree(args.work / variant, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
