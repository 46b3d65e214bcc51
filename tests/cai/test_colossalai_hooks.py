"""``install_colossalai_hooks``: real ColossalAI 0.5.0 booster runs on CPU (gloo), 2 processes.

    .venv-cai/bin/python -m pytest tests/cai -q

Each case of ``colossalai_hook_case.CASES`` is run once per session (all at once) and cached
under ``.test-cache/cai/`` keyed by the engine script, the code it exercises and the package
versions. References come from an independent route: the model built from the same seed in
this process (bitwise, no step) and a single-process SGD step (tolerance).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from procs import wait_or_stop  # tests/support, on the path via tests/conftest.py

pytest.importorskip("colossalai")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SCRIPT = HERE / "colossalai_hook_case.py"
TIMEOUT_S = 600
# What the engine runs besides the script: a change here must rebuild the cached runs. The whole
# package is keyed (by relative name and bytes), so a module moved or renamed cannot break the key.
_CODE = [SCRIPT, REPO / "tests/support/colossalai_cpu_shim.py"] + sorted(
    (REPO / "hf_ckpt_integrations").rglob("*.py"))


def _case_module():
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module("colossalai_hook_case")


def _cache_key() -> str:
    import colossalai
    import torch
    import transformers

    h = hashlib.sha256(f"{torch.__version__} {colossalai.__version__} {transformers.__version__}".encode())
    for p in _CODE:
        h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def runs():
    """``{case: outdir}``; every case run once (concurrently), reused while the cache key holds."""
    cases = list(_case_module().CASES)
    root = Path(os.environ.get("HFCKPT_TEST_CACHE", REPO / ".test-cache")) / "cai" / _cache_key()
    todo = [c for c in cases if not (root / c / "done.json").is_file()]
    procs = {}
    for i, case in enumerate(todo):
        out = root / case
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        log = open(root / f"{case}.log", "w")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--master_port", str(29610 + i), str(SCRIPT), case, str(out)]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        procs[case] = (subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    failed = []
    for case, (proc, log) in procs.items():
        wait_or_stop(proc, TIMEOUT_S)
        log.close()
        if proc.returncode != 0:
            failed.append(f"{case} (rc {proc.returncode}):\n{(root / f'{case}.log').read_text()[-4000:]}")
    if failed:
        for case in procs:
            shutil.rmtree(root / case, ignore_errors=True)  # never cache a failed run
        pytest.fail("engine runs failed: " + "\n".join(failed))
    return {c: root / c for c in cases}


def _reference(case: str, *, step: bool):
    """The unsharded model from the same seed, optionally after the same SGD step (one process)."""
    import torch
    from transformers import LlamaForCausalLM

    m = _case_module()
    kwargs, tied, _ = m.CASES[case]
    torch.manual_seed(m.SEED)
    ref = LlamaForCausalLM(m.tiny_llama_config(tied))
    loss = None
    if step:
        opt = torch.optim.SGD(ref.parameters(), lr=m.LR)
        ids = m.make_batch()
        out = ref(input_ids=ids, labels=ids)
        loss = out.loss.item()
        out.loss.backward()
        opt.step()
    if kwargs["precision"] == "bf16":
        inv_freq = ref.model.rotary_emb.inv_freq
        ref = ref.to(torch.bfloat16)
        ref.model.rotary_emb.inv_freq = inv_freq  # a buffer from_pretrained keeps in fp32
    ref.config._attn_implementation = "eager"  # the same kernels as _load, so logits compare bitwise
    return ref.eval(), loss


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", torch_dtype="auto").eval()


CASES = ["tp2_fp32", "tp2_bf16", "tp2_tied", "pp2_fp32"]
STEP_CASES = [c for c in CASES if c != "pp2_fp32"]  # pp: the 1F1B schedule does not run on CPU


def test_package_import_does_not_import_colossalai():
    code = ("import sys, hf_ckpt_integrations as h; assert 'colossalai' not in sys.modules; "
            "assert 'install_colossalai_hooks' in h.__all__; h.install_colossalai_hooks; "
            "assert 'colossalai' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_padding_record_must_match_the_gathered_shape():
    """Seed 003: the pad record describes the global tensor; a local-length record is refused."""
    from hf_ckpt_integrations.errors import LayoutError
    from hf_ckpt_integrations.sources.colossalai import TensorInfo, _finish

    good = TensorInfo("e", "F32", (1024, 64), holders={0: (512, 64), 1: (512, 64)}, groups=[(0, 1)],
                      shard_dim=0, padding=(0, 1001, 1024))
    _finish(good)
    assert good.shape == (1001, 64)
    assert good.sources(1) == [0, 1]
    bad = TensorInfo("e", "F32", (1024, 64), holders={0: (512, 64), 1: (512, 64)}, groups=[(0, 1)],
                     shard_dim=0, padding=(0, 501, 512))
    with pytest.raises(LayoutError, match="refusing to unpad"):
        _finish(bad)


@pytest.mark.parametrize("case", CASES)
def test_nostep_bitwise_equal_to_unsharded_model(runs, case):
    import torch

    ref, _ = _reference(case, step=False)
    ref_sd = ref.state_dict()
    ids = _case_module().make_batch()
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
    for sub in ("nostep_sharded", "nostep_single"):
        loaded = _load(runs[case] / sub)
        assert loaded.config.vocab_size == 1001
        assert tuple(loaded.get_input_embeddings().weight.shape) == (1001, 64)
        assert loaded.dtype == ref.dtype
        sd = loaded.state_dict()
        assert set(sd) == set(ref_sd)
        for name, t in ref_sd.items():
            assert torch.equal(sd[name], t), f"{sub}: {name} differs"
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=ids).logits, ref_logits), sub


@pytest.mark.parametrize("case", STEP_CASES)
def test_after_one_step_matches_single_process_step(runs, case):
    import torch

    done = json.loads((runs[case] / "done.json").read_text())
    ref, ref_loss = _reference(case, step=True)
    init, _ = _reference(case, step=False)
    bf16 = ref.dtype == torch.bfloat16
    assert done["loss"] == pytest.approx(ref_loss, rel=2e-2 if bf16 else 1e-5)
    loaded = _load(runs[case] / "step_sharded")
    assert tuple(loaded.lm_head.weight.shape) == (1001, 64)
    sd, init_sd = loaded.state_dict(), init.state_dict()
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=0, atol=1e-5)
    moved = 0.0
    for name, t in ref.state_dict().items():
        torch.testing.assert_close(sd[name].float(), t.float(), msg=name, **tol)
        moved = max(moved, (sd[name].float() - init_sd[name].float()).abs().max().item())
    assert moved > 1e-3  # the step really is in the checkpoint
    ids = _case_module().make_batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float(),
                                   **(dict(rtol=5e-2, atol=5e-2) if bf16 else dict(rtol=1e-4, atol=1e-4)))


@pytest.mark.parametrize("case", CASES)
def test_directory_layout_is_hf(runs, case):
    from safetensors import safe_open

    d = runs[case] / "nostep_sharded"
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert sorted(set(index["weight_map"].values())) == shards
    total = 0
    for s in shards:
        with safe_open(str(d / s), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for k in f.keys():
                total += f.get_slice(k).get_shape() and f.get_tensor(k).nbytes
    assert index["metadata"]["total_size"] == total
    names = set(index["weight_map"])
    _, tied, _ = _case_module().CASES[case]
    # Tied embeddings are one tensor: written once under its first name, as save_pretrained does.
    assert ("lm_head.weight" in names) != tied
    assert not list(d.glob(".hfckpt-tmp*")) and not list(d.glob("*.bin"))
    config = json.loads((d / "config.json").read_text())
    assert config["vocab_size"] == 1001 and config["architectures"] == ["LlamaForCausalLM"]


def test_not_larger_than_colossalai_own_save(runs):
    """Same weights as ColossalAI 0.5.0's own save; its index total_size is not in bytes."""
    import torch

    d = runs["tp2_fp32"]
    ours = _load(d / "step_sharded").state_dict()
    own = torch.load(d / "cai_own" / "pytorch_model-00001.bin", weights_only=True)
    assert set(own) == set(ours)
    for k, v in own.items():
        assert torch.equal(ours[k], v), k
    ours_bytes = sum(p.stat().st_size for p in (d / "step_sharded").glob("*.safetensors"))
    own_bytes = sum(p.stat().st_size for p in (d / "cai_own").glob("*.bin"))
    assert ours_bytes <= own_bytes


@pytest.mark.parametrize("case", ["tp2_fp32", "tp2_bf16"])
def test_cli_inspects_exports_and_verifies_booster_directories(runs, case, tmp_path):
    """`hf-ckpt inspect/export/verify` take ColossalAI's own save and the hook's directory."""
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "hf_ckpt_integrations", *map(str, args)],
                              capture_output=True, text=True, timeout=300)

    own, hooked = runs[case] / "cai_own", runs[case] / "step_sharded"
    r = cli("inspect", own, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["engine"] == "hf-directory"
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["model.embed_tokens.weight"]["shape"] == [1001, 64]
    # ColossalAI 0.5.0 unpads with a view: torch.save still writes the 1024-row padded storage.
    assert any("bloated" in n for n in info["notes"]), info["notes"]
    # The hook's weights are exactly ColossalAI's own (bitwise), and a lean export of its .bin too.
    assert cli("verify", hooked, "--against", own).returncode == 0
    assert cli("export", own, tmp_path / "lean", "--quiet").returncode == 0
    assert cli("verify", tmp_path / "lean", "--against", hooked).returncode == 0
