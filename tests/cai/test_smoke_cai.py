"""ColossalAI 0.5.0 CPU smoke tests. Run inside the second venv:

    .venv-cai/bin/python -m pytest tests/cai -x -q

(see docs/colossalai-env.md). Skipped where colossalai is not installed, e.g.
under the main .venv.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from procs import wait_or_stop  # tests/support, on the path via tests/conftest.py

pytest.importorskip("colossalai")

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
SMOKE_SCRIPT = HERE / "colossalai_smoke.py"
SUPPORT_DIR = HERE.parent / "support"
TIMEOUT_S = 600


def _import_from(directory: Path, name: str):
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    return importlib.import_module(name)


def test_shim_install_is_idempotent():
    import torch
    from colossalai.accelerator import CpuAccelerator

    shim = _import_from(SUPPORT_DIR, "colossalai_cpu_shim")
    shim.install()
    patched = {name: CpuAccelerator.__dict__[name] for name in shim._PATCHES}
    shim.install()
    assert shim.is_installed()
    assert {name: CpuAccelerator.__dict__[name] for name in shim._PATCHES} == patched

    acc = CpuAccelerator()
    acc.manual_seed(7)
    acc.manual_seed_all(7)
    state = acc.get_rng_state()
    assert torch.equal(state, torch.get_rng_state())
    first = torch.rand(3)
    acc.set_rng_state(state, "cpu")
    assert torch.equal(torch.rand(3), first)
    acc.synchronize()
    acc.empty_cache()


def test_hybrid_parallel_tp2_sharded_save(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    outdir = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nproc_per_node", "2",
        str(SMOKE_SCRIPT), str(outdir),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log_path = tmp_path / "torchrun.log"
    with open(log_path, "w") as log:
        # A file, not a pipe: torchrun starts its workers in their own sessions,
        # so a pipe could stay open (and block us) after torchrun itself is gone.
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        if not wait_or_stop(proc, TIMEOUT_S):
            pytest.fail(f"smoke run exceeded {TIMEOUT_S} s:\n{log_path.read_text()[-6000:]}")
    output = log_path.read_text()
    assert proc.returncode == 0, output[-6000:]

    done = json.loads((outdir / "done.json").read_text())
    assert done["world_size"] == 2
    # In memory the vocab is padded 1001 -> 1024 (make_vocab_size_divisible_by=64)
    # and split across the 2 TP ranks.
    assert done["live_embedding_rows_per_rank"] == 512
    # What ColossalAI 0.5.0 writes for save_model(shard=True) with the default
    # use_safetensors=False: a HF-style .bin shard + index, plus the configs.
    assert done["files"] == [
        "config.json",
        "generation_config.json",
        "pytorch_model-00001.bin",
        "pytorch_model.bin.index.json",
    ]

    model_dir = outdir / "model"
    loaded = AutoModelForCausalLM.from_pretrained(model_dir)
    # Observed truth for ColossalAI 0.5.0: the saved checkpoint is UN-padded.
    # The TP shards are gathered and the 1024-row padded embedding / lm_head are
    # cut back to the config's vocab_size, so 1001 rows are written and
    # config.json keeps vocab_size=1001.
    assert loaded.config.vocab_size == 1001
    assert tuple(loaded.get_input_embeddings().weight.shape) == (1001, 64)
    assert tuple(loaded.lm_head.weight.shape) == (1001, 64)
    assert loaded.dtype == torch.float32

    # The gathered weights equal one single-process SGD step from the same init.
    smoke = _import_from(HERE, "colossalai_smoke")
    torch.manual_seed(smoke.SEED)
    ref = LlamaForCausalLM(smoke.tiny_llama_config())
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.SGD(ref.parameters(), lr=smoke.LR)
    ids = smoke.make_batch()
    out = ref(input_ids=ids, labels=ids)
    assert out.loss.item() == pytest.approx(done["loss"], rel=1e-5)
    out.loss.backward()
    opt.step()

    saved = loaded.state_dict()
    ref_sd = ref.state_dict()
    assert set(saved) == set(ref_sd)
    moved = 0.0
    for name, ref_tensor in ref_sd.items():
        torch.testing.assert_close(saved[name], ref_tensor, rtol=0, atol=1e-5, msg=name)
        moved = max(moved, (saved[name] - init[name]).abs().max().item())
    assert moved > 1e-3  # the optimizer step really is in the checkpoint
