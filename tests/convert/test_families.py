"""The Hub layout: every export path writes exactly what ``save_pretrained`` writes, per family.

Each case trains a tiny model of one family under a real DeepSpeed engine on 2 ranks
(``engines/family_train.py``) and saves, as the reference, ``save_pretrained`` of a plain model
holding the engine's fp32 masters. The export must hold the same tensor names, dtypes, shapes and
bytes. transformers 5 fuses MoE experts in memory (``mlp.experts.gate_up_proj`` [E, 2I, H]) and
splits them back on save: so must every export, and the result must load without missing keys in
transformers 5 (.venv) and 4.51 (.venv-cai).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, export, in_process

FAMILY_CASES = [f"fam-{f}-z3" for f in ("llama", "gpt2", "t5", "bert", "mixtral", "qwen2_moe", "llava")]
FAMILY_CASES.append("fam-mixtral-z2")
MOE_CASES = ["fam-mixtral-z3", "fam-mixtral-z2", "fam-qwen2_moe-z3"]
CAI_PYTHON = REPO / ".venv-cai" / "bin" / "python"


def _tensors(directory):
    """name -> (dtype, shape, bytes) of every tensor in a safetensors directory (index or one file)."""
    out = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, meta in header.items():
            if name != "__metadata__":
                a, b = meta["data_offsets"]
                assert name not in out, f"{name} stored twice"
                out[name] = (meta["dtype"], tuple(meta["shape"]), raw[8 + n + a:8 + n + b])
    return out


def assert_same_as_save_pretrained(got_dir, ref_dir):
    got, ref = _tensors(got_dir), _tensors(ref_dir)
    assert sorted(got) == sorted(ref), (sorted(set(got) - set(ref))[:5], sorted(set(ref) - set(got))[:5])
    for name, (dtype, shape, data) in ref.items():
        assert got[name][:2] == (dtype, shape), (name, got[name][:2], (dtype, shape))
        assert got[name][2] == data, f"{name}: bytes differ"


@pytest.mark.engine
@pytest.mark.parametrize("name", FAMILY_CASES)
def test_export_equals_save_pretrained(engine_ckpt, tmp_path, name):
    case = engine_ckpt(name)
    out = tmp_path / "out"
    export(case / "ckpt", out, "--quiet", config=case / "config", run=in_process())
    assert_same_as_save_pretrained(out, case / "reference" / "hf")
    got, want = (json.loads((d / "config.json").read_text()) for d in (out, case / "reference" / "hf"))
    assert (got["architectures"], got["dtype"]) == (want["architectures"], want["dtype"])  # as save_pretrained sets


@pytest.mark.engine
def test_inspect_shows_the_expert_split(engine_ckpt):
    from helpers import hf_ckpt

    case = engine_ckpt("fam-mixtral-z3")
    r = hf_ckpt("inspect", case / "ckpt", "--config", case / "config")
    assert r.returncode == 0, r.stderr
    assert ("hub layout  model.layers.*.mlp.experts.gate_up_proj -> "
            "model.layers.*.block_sparse_moe.experts.*.w1.weight, model.layers.*.block_sparse_moe.experts.*.w3.weight "
            "(split into 8 leading-dim slices; 2 tensor(s))") in r.stdout
    info = json.loads(hf_ckpt("inspect", case / "ckpt", "--config", case / "config", "--json").stdout)
    groups = {c["source"]: c for c in info["conversions"]}
    assert groups["model.layers.0.mlp.experts.down_proj"]["into"] == [
        f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in range(4)]
    names = {t["name"]: t for t in info["tensors"]}
    assert names["model.layers.1.block_sparse_moe.experts.3.w3.weight"]["hub_source"] == \
        "model.layers.1.mlp.experts.gate_up_proj"


@pytest.mark.engine
@pytest.mark.parametrize("name", MOE_CASES)
def test_moe_export_loads_in_transformers_5(engine_ckpt, tmp_path, name):
    from transformers import AutoModelForCausalLM

    case = engine_ckpt(name)
    out = tmp_path / "out"
    export(case / "ckpt", out, "--quiet", config=case / "config", run=in_process())
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ref = AutoModelForCausalLM.from_pretrained(case / "reference" / "hf", dtype=torch.float32)
    got, want = model.state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


_CAI_LOAD = r"""
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
out, ref = sys.argv[1], sys.argv[2]
model, info = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32, output_loading_info=True)
want = load_file(ref)
got = model.state_dict()
print(json.dumps({"version": __import__("transformers").__version__,
                  "missing": info["missing_keys"], "unexpected": info["unexpected_keys"],
                  "mismatched": [str(m) for m in info["mismatched_keys"]],
                  "not_in_model": sorted(set(want) - set(got)),
                  "differ": sorted(k for k in want if k in got and not torch.equal(got[k], want[k]))}))
"""


@pytest.mark.engine
@pytest.mark.skipif(not CAI_PYTHON.exists(), reason=".venv-cai (transformers 4.51) is not built")
@pytest.mark.parametrize("name", ["fam-mixtral-z3", "fam-qwen2_moe-z3"])
def test_moe_export_loads_in_transformers_4(engine_ckpt, tmp_path, name):
    case = engine_ckpt(name)
    out = tmp_path / "out"
    export(case / "ckpt", out, "--quiet", config=case / "config", run=in_process())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    ref = case / "reference" / "hf" / "model.safetensors"
    r = subprocess.run([str(CAI_PYTHON), "-c", _CAI_LOAD, str(out), str(ref)], capture_output=True, text=True,
                       timeout=600, env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["version"].startswith("4."), seen["version"]
    assert seen == {**seen, "missing": [], "unexpected": [], "mismatched": [], "not_in_model": [], "differ": []}, seen


@pytest.mark.engine
def test_trainer_callback_and_live_save_write_the_hub_layout(engine_ckpt):
    """Qwen2-MoE under ZeRO-3: the callback's checkpoint-2/ (from the partition files) and the live
    save (partitions streamed, one expert's ranks at a time) both equal save_pretrained."""
    case = engine_ckpt("fam-cb-qwen2_moe-z3")
    ref = case / "reference" / "hf"
    assert_same_as_save_pretrained(case / "run" / "checkpoint-2", ref)
    assert_same_as_save_pretrained(case / "live", ref)
    assert any(".mlp.experts.3.up_proj.weight" in n for n in _tensors(case / "live"))


def test_hub_layout_cache_skips_transformers_and_is_rechecked(engine_ckpt, tmp_path):
    """Every checkpoint-N of a run asks transformers the same question: the second export takes the
    answer from the cache (no torch import, same bytes); a cache entry that no longer tiles the
    checkpoint's tensors is ignored and the layout derived again."""
    case = engine_ckpt("fam-mixtral-z3")
    cache = tmp_path / "cache"
    code = ("import sys; from hf_ckpt_integrations.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH', 'torch' in sys.modules); sys.exit(rc)")

    def export(dst):
        r = subprocess.run([sys.executable, "-c", code, "export", str(case / "ckpt"), str(dst), "--config",
                            str(case / "config"), "--quiet"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "HF_CKPT_CACHE": str(cache)})
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert "TORCH True" in export(tmp_path / "a")  # derived by transformers
    entries = list((cache / "hub-layout").glob("*.json"))
    assert len(entries) == 1
    assert "TORCH False" in export(tmp_path / "b")  # from the cache
    entry = json.loads(entries[0].read_text())
    experts = [h for h in entry["answer"]["layout"] if h[3] != 0]
    assert experts, "the Mixtral layout splits experts"
    experts[0][3] += 1  # one slice shifted by an element: no longer tiles its tensor (nor fits its digest)
    entries[0].write_text(json.dumps(entry))
    assert "TORCH True" in export(tmp_path / "c")  # not trusted: derived again
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    for other in ("b", "c"):
        assert sorted(p.name for p in (tmp_path / other).iterdir()) == files
        for f in files:
            assert (tmp_path / other / f).read_bytes() == (tmp_path / "a" / f).read_bytes(), (other, f)
