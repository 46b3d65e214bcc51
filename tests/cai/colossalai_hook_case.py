"""One real ColossalAI booster run saving through ``install_colossalai_hooks``.

    torchrun --standalone --nproc_per_node 2 tests/cai/colossalai_hook_case.py CASE OUTDIR

CASE (see CASES): the plugin settings and whether a training step can run on CPU. Writes, under
OUTDIR: ``nostep_sharded/`` and ``nostep_single/`` (hooked ``save_model``, shard=True with
``size_per_shard=0.25`` MiB so there are several shards, and shard=False) before any step;
with a step: ``step_sharded/`` after one SGD step and ``cai_own/`` (ColossalAI's own save of the
same weights, for the size/time comparison); and ``done.json`` (loss, timings, files).
Used by ``tests/cai/test_colossalai_hooks.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

_TESTS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS_DIR / "support"))
sys.path.insert(0, str(_TESTS_DIR / "engines"))

import colossalai_cpu_shim  # noqa: E402  (test-support module, see its docstring)

SEED = 1234
VOCAB_SIZE = 1001
SEQ_LEN = 16
BATCH = 2
LR = 0.1  # plain SGD: linear in the gradient, so a single-process reference step matches tightly
SHARD_MIB = 0.25

# name -> (HybridParallelPlugin kwargs, tie_word_embeddings, take a step)
CASES = {
    "tp2_fp32": (dict(tp_size=2, pp_size=1, precision="fp32"), False, True),
    "tp2_bf16": (dict(tp_size=2, pp_size=1, precision="bf16"), False, True),
    "tp2_tied": (dict(tp_size=2, pp_size=1, precision="fp32"), True, True),
    # The 1F1B schedule fails on torch 2.13 CPU (torch.distributed.is_hccl_available is gone),
    # so pp=2 is saved right after boosting.
    "pp2_fp32": (dict(tp_size=1, pp_size=2, num_microbatches=1, precision="fp32"), False, False),
}


def tiny_llama_config(tied: bool = False):
    """The matrix's tiny Llama (tests/engines/common.py), vocabulary 1001."""
    from common import tiny_llama_config as base

    return base(tie_word_embeddings=tied, vocab_size=VOCAB_SIZE)


def make_batch():
    import torch

    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=gen)


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return round(time.perf_counter() - t0, 3)


def _files(d: Path):
    return {p.name: p.stat().st_size for p in sorted(d.iterdir()) if p.is_file()}


def main(case: str, outdir: Path) -> None:
    import torch
    import torch.distributed as dist

    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from transformers import LlamaForCausalLM

    from hf_ckpt_integrations import install_colossalai_hooks

    kwargs, tied, step = CASES[case]
    colossalai_cpu_shim.install()
    colossalai.launch_from_torch(backend="gloo", seed=SEED, verbose=False)
    try:
        rank = dist.get_rank()
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(tiny_llama_config(tied))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        plugin = HybridParallelPlugin(make_vocab_size_divisible_by=64, **kwargs)
        booster = Booster(plugin=plugin)
        install_colossalai_hooks(booster)
        model, optimizer, *_ = booster.boost(model, optimizer)
        info = {"case": case, "world_size": dist.get_world_size(), "torch": torch.__version__,
                "colossalai": colossalai.__version__, "seconds": {}}
        emb = getattr(model.unwrap().get_input_embeddings(), "weight", None)
        info["live_embedding_rows_per_rank"] = None if emb is None else int(emb.shape[0])

        info["seconds"]["nostep_sharded"] = _timed(lambda: booster.save_model(
            model, str(outdir / "nostep_sharded"), shard=True, size_per_shard=SHARD_MIB))
        info["seconds"]["nostep_single"] = _timed(lambda: booster.save_model(
            model, str(outdir / "nostep_single"), shard=False))
        if step:
            ids = make_batch()
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            info["loss"] = float(loss.detach())
            info["seconds"]["step_sharded"] = _timed(lambda: booster.save_model(
                model, str(outdir / "step_sharded"), shard=True))
            original = booster._hf_ckpt_hooks["original_save_model"]
            info["seconds"]["cai_own"] = _timed(lambda: original(model, str(outdir / "cai_own"), shard=True))
        if rank == 0:
            info["files"] = {d.name: _files(d) for d in sorted(outdir.iterdir()) if d.is_dir()}
            (outdir / "done.json").write_text(json.dumps(info, indent=2) + "\n")
        dist.barrier()
    finally:
        # Without this, rank 1 aborts at exit with "terminate called without an active exception".
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in CASES:
        sys.exit(f"usage: torchrun --standalone --nproc_per_node 2 {sys.argv[0]} {{{','.join(CASES)}}} OUTDIR")
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], out)
