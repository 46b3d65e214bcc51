"""Every case of the engine matrix exports to a directory that from_pretrained loads, bitwise
equal to the weights the engine itself reported at save time."""

import json
from pathlib import Path

import pytest
import torch

from hf_ckpt_integrations import export_checkpoint, verify_checkpoint
from helpers import hf_ckpt, load_safetensors

pytestmark = pytest.mark.engine

DS_CASES = ["z1-fp32", "z1-bf16", "z2-fp32", "z2-bf16", "z3-fp32", "z3-bf16", "z1-frozen", "z2-frozen",
            "z3-frozen", "z2-tied", "z3-tied"]
ALL_CASES = DS_CASES + ["trainer-z3"]


def paths(name, case):
    """(source dir, config dir or None, reference dir, training dtype) of a matrix case."""
    if name.startswith("trainer"):
        return case / "run" / "checkpoint-4", None, case / "reference" / "checkpoint-4", "fp32"
    run = json.loads((case / "reference" / "run.json").read_text())
    return case / "ckpt", case / "config", case / "reference", run["dtype"]


def _expected_names(module_ref, config_dir):
    cfg = json.loads((Path(config_dir) / "config.json").read_text())
    names = set(module_ref)
    if cfg.get("tie_word_embeddings"):
        names.discard("lm_head.weight")
    return names


@pytest.mark.parametrize("name", ALL_CASES)
def test_default_export_is_the_fp32_masters(name, engine_ckpt, tmp_path):
    src, config, ref, _ = paths(name, engine_ckpt(name))
    report = export_checkpoint(src, tmp_path / "hf", config=config and str(config))
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    masters = load_safetensors(ref / "master.safetensors")
    module = load_safetensors(ref / "module.safetensors")
    assert set(out) == _expected_names(module, config or src)
    for n, t in out.items():
        assert t.dtype == torch.float32, n
        # Frozen parameters have no fp32 master: they are the module weights, cast up.
        want = masters[n] if n in masters else module[n].float()
        assert torch.equal(t, want), n
    # No bloat: the files hold the tensor bytes plus headers and config (< 1%).
    weights = sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.safetensors"))
    assert report["tensor_bytes"] == sum(t.numel() * 4 for t in out.values())
    assert weights <= report["tensor_bytes"] * 1.01


@pytest.mark.parametrize("name", ALL_CASES)
def test_training_dtype_export_loads_with_engine_logits(name, engine_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    src, config, ref, dtype = paths(name, engine_ckpt(name))
    export_checkpoint(src, tmp_path / "hf", dtype=dtype, config=config and str(config))
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch_dtype, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    module = load_safetensors(ref / "module.safetensors")
    state = model.state_dict()
    for n, t in module.items():
        assert state[n].dtype == t.dtype and torch.equal(state[n], t), n
    model.eval()
    from common import probe_input

    with torch.no_grad():
        logits = model(input_ids=probe_input()).logits
    assert torch.equal(logits, torch.load(ref / "logits.pt")), "logits differ from the engine's"


@pytest.mark.parametrize("name", ["z2-bf16", "z3-fp32", "trainer-z3"])
def test_cli_verify_passes_then_names_a_flipped_tensor(name, engine_ckpt, tmp_path):
    src, config, _, _ = paths(name, engine_ckpt(name))
    dst = tmp_path / "hf"
    args = ["export", src, dst, "--quiet"] + (["--config", config] if config else [])
    assert hf_ckpt(*args).returncode == 0
    ok = hf_ckpt("verify", dst, "--against", src)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok:")

    victim = "model.layers.1.mlp.down_proj.weight"
    shard = dst / "model.safetensors"
    header_len = int.from_bytes(shard.read_bytes()[:8], "little")
    header = json.loads(shard.read_bytes()[8:8 + header_len])
    start, end = header[victim]["data_offsets"]
    pos = 8 + header_len + (start + end) // 2
    data = bytearray(shard.read_bytes())
    data[pos] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = hf_ckpt("verify", dst, "--against", src)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert victim in bad.stdout
    assert bad.stdout.count("differs:") == 1


def test_verify_api_reports_missing_tensor(engine_ckpt, tmp_path):
    src, config, _, _ = paths("z2-fp32", engine_ckpt("z2-fp32"))
    export_checkpoint(src, tmp_path / "hf", config=str(config), max_shard_size="200KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert verify_checkpoint(tmp_path / "hf", src).ok
    # Drop one shard from the index: its tensors must be reported missing.
    dropped = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != dropped}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    report = verify_checkpoint(tmp_path / "hf", src)
    assert not report.ok and all("missing" in d for d in report.differences)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_workers_write_the_same_bytes(dtype, engine_ckpt, tmp_path):
    """--workers N writes shards from threads: every file identical to a one-worker export."""
    src, config, _, _ = paths("z3-bf16", engine_ckpt("z3-bf16"))
    one = export_checkpoint(src, tmp_path / "one", dtype=dtype, config=str(config), max_shard_size="100KB")
    assert one["shards"] > 2
    r = hf_ckpt("export", src, tmp_path / "four", "--dtype", dtype, "--config", config, "--max-shard-size", "100KB",
                "--workers", "4", "--quiet")
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "four").iterdir())
    for n in names:
        assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "four" / n).read_bytes(), n
