"""CPU smoke run of ColossalAI 0.5.0 tensor parallelism + sharded model save.

Launch (from the repository root, inside .venv-cai):

    torchrun --standalone --nproc_per_node 2 tests/cai/colossalai_smoke.py OUTDIR

Two gloo processes boost a tiny LlamaForCausalLM (built in code, no hub
download) with ``HybridParallelPlugin(tp_size=2, precision="fp32",
make_vocab_size_divisible_by=64)``, take one optimizer step on random tokens,
and save the model with ``booster.save_model(..., shard=True)`` to
``OUTDIR/model``. Rank 0 then writes ``OUTDIR/done.json`` listing the saved
files. Used by ``tests/cai/test_smoke_cai.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_TESTS_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_TESTS_DIR / "support"))
sys.path.insert(0, str(_TESTS_DIR / "engines"))

import colossalai_cpu_shim  # noqa: E402  (test-support module, see its docstring)

SEED = 1234
VOCAB_SIZE = 1001
SEQ_LEN = 16
BATCH = 2
# Plain SGD: the update is linear in the gradient, so the test can compare the
# saved weights with a single-process reference step at a tight tolerance
# (Adam's first step is ~lr*sign(grad) and flips on near-zero gradients).
LR = 0.1


def tiny_llama_config():
    """The tiny Llama used by the smoke run (also imported by the test): the matrix's own
    (tests/engines/common.py), vocabulary 1001."""
    from common import tiny_llama_config as base

    return base(vocab_size=VOCAB_SIZE)


def make_batch():
    """Random token ids, identical on every rank (TP needs identical inputs)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(0, VOCAB_SIZE, (BATCH, SEQ_LEN), generator=gen)


def main(outdir: Path) -> None:
    import torch
    import torch.distributed as dist

    import colossalai
    from colossalai.booster import Booster
    from colossalai.booster.plugin import HybridParallelPlugin
    from transformers import LlamaForCausalLM

    colossalai_cpu_shim.install()
    colossalai.launch_from_torch(backend="gloo", seed=SEED, verbose=False)
    try:
        rank = dist.get_rank()

        torch.manual_seed(SEED)
        model = LlamaForCausalLM(tiny_llama_config())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)

        plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", make_vocab_size_divisible_by=64)
        booster = Booster(plugin=plugin)
        # tp_size=2 on a 2-process world: dp=1, pp=1, no ZeRO.
        model, optimizer, *_ = booster.boost(model, optimizer)

        input_ids = make_batch()
        outputs = model(input_ids=input_ids, labels=input_ids)
        loss = outputs.loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()

        # In memory the vocab is padded to a multiple of 64 and split over TP.
        live_embed_rows = int(model.unwrap().get_input_embeddings().weight.shape[0])

        model_dir = outdir / "model"
        booster.save_model(model, str(model_dir), shard=True)
        dist.barrier()

        if rank == 0:
            files = sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file())
            info = {
                "files": files,
                "loss": float(loss.detach()),
                "live_embedding_rows_per_rank": live_embed_rows,
                "world_size": dist.get_world_size(),
                "torch": torch.__version__,
                "colossalai": colossalai.__version__,
            }
            (outdir / "done.json").write_text(json.dumps(info, indent=2) + "\n")
            print(json.dumps(info))
        dist.barrier()
    finally:
        # Without this, rank 1 aborts at exit with
        # "terminate called without an active exception".
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: torchrun --standalone --nproc_per_node 2 {sys.argv[0]} OUTDIR")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out)
