"""HF-format directories as a source: inspect (with the bloat audit), export, verify."""

import json

import torch

from helpers import export, hf_ckpt, load_safetensors


def test_bloated_bin_is_flagged_and_exported_lean(tmp_path):
    # Seed 002: tensors that are views of one flat buffer; torch.save writes the whole buffer per file.
    flat = torch.arange(3 * 1000, dtype=torch.float32)
    state = {"a.weight": flat[:1000].view(10, 100), "b.weight": flat[1000:2000].view(10, 100)}
    src = tmp_path / "bloated"
    src.mkdir()
    torch.save(state, src / "pytorch_model.bin")
    r = hf_ckpt("inspect", src, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["engine"] == "hf-directory" and info["tensor_count"] == 2
    assert "12,000 storage bytes for 8,000 tensor bytes" in info["notes"][0] and "bloated" in info["notes"][0]
    r = export(src, tmp_path / "lean", "--quiet", "--weights-only")
    out = load_safetensors(tmp_path / "lean" / "model.safetensors")
    assert all(torch.equal(out[k], v) for k, v in state.items())
    data = (tmp_path / "lean" / "model.safetensors").read_bytes()
    assert len(data) == 8 + int.from_bytes(data[:8], "little") + 8_000  # header + each tensor's own bytes
    assert hf_ckpt("verify", tmp_path / "lean", "--against", src).returncode == 0
    # and a changed value is caught
    state["b.weight"] = state["b.weight"].clone()
    state["b.weight"][0, 0] += 1
    torch.save(state, src / "pytorch_model.bin")
    bad = hf_ckpt("verify", tmp_path / "lean", "--against", src)
    assert bad.returncode == 1 and "b.weight" in bad.stdout


def test_trainer_checkpoint_prefers_the_deepspeed_masters(engine_ckpt):
    """A checkpoint-N with both model.safetensors and global_stepN/ is read as DeepSpeed."""
    case = engine_ckpt("trainer-z3")
    r = hf_ckpt("inspect", case / "run" / "checkpoint-4", "--json")
    assert json.loads(r.stdout)["engine"] == "deepspeed"
