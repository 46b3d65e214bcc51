"""lean_state_dict and the storage-bloat audit: pure, fast, no engine (seed 002 in miniature)."""

import torch

from hf_ckpt_integrations import lean_state_dict
from hf_ckpt_integrations.lean import audit, is_lean


def flat_views():
    """Three parameters as views of one flat buffer, as ZeRO-1/2 leaves them; b is tied to a."""
    flat = torch.arange(1000, dtype=torch.float32)
    a = flat[0:200].view(10, 20)
    c = flat[200:1000].view(40, 20)
    return flat, {"a": a, "b": a, "c": c, "step": 3}


def test_views_get_their_own_storage_and_values_are_unchanged():
    _, sd = flat_views()
    lean = lean_state_dict(sd)
    for name in ("a", "c"):
        assert is_lean(lean[name]) and torch.equal(lean[name], sd[name])
        assert lean[name].untyped_storage().nbytes() == lean[name].numel() * 4
    assert lean["step"] == 3


def test_tied_weights_stay_shared_once():
    _, sd = flat_views()
    lean = lean_state_dict(sd)
    assert lean["a"] is lean["b"]
    assert lean["a"].untyped_storage().data_ptr() != lean["c"].untyped_storage().data_ptr()


def test_lean_tensors_are_not_copied():
    own = torch.ones(5, 5)
    sd = {"own": own, "alias": own}
    lean = lean_state_dict(sd)
    assert lean["own"] is own and lean["alias"] is own


def test_input_is_not_modified_and_type_is_kept():
    from collections import OrderedDict

    flat, sd = flat_views()
    sd = OrderedDict(sd)
    lean = lean_state_dict(sd)
    assert type(lean) is OrderedDict and list(lean) == list(sd)
    assert sd["a"].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    lean["a"].zero_()
    assert flat[:200].sum() > 0  # the training buffer is untouched


def test_non_contiguous_view_is_made_contiguous():
    base = torch.arange(12.0).view(3, 4)
    lean = lean_state_dict({"t": base.t()})
    assert is_lean(lean["t"]) and torch.equal(lean["t"], base.t())


def test_torch_save_shard_bloat_is_audited_and_cured(tmp_path):
    _, sd = flat_views()
    shard = {"a": sd["a"]}  # one small tensor of a big flat buffer: the seed-002 shard
    torch.save(shard, tmp_path / "bloated.bin")
    torch.save(lean_state_dict(shard), tmp_path / "lean.bin")
    bad = audit(tmp_path / "bloated.bin")
    good = audit(tmp_path / "lean.bin")
    assert bad["tensor_bytes"] == good["tensor_bytes"] == 200 * 4
    assert bad["storage_bytes"] == 1000 * 4 and bad["ratio"] == 5.0
    assert good["storage_bytes"] == 200 * 4 and good["ratio"] == 1.0
    # the file really carries the other 800 elements of the flat buffer
    assert (tmp_path / "bloated.bin").stat().st_size - (tmp_path / "lean.bin").stat().st_size >= 800 * 4


def test_audit_directory_with_safetensors_and_tied_bin(tmp_path):
    from safetensors.torch import save_file

    _, sd = flat_views()
    lean = lean_state_dict(sd)
    save_file({"a": lean["a"], "c": lean["c"]}, str(tmp_path / "model.safetensors"))
    torch.save({"a": lean["a"], "b": lean["b"]}, tmp_path / "pytorch_model.bin")
    report = audit(tmp_path)
    assert report["files"]["model.safetensors"]["ratio"] == 1.0
    assert report["files"]["model.safetensors"]["tensor_bytes"] == 1000 * 4
    # tied names count once: one storage, one view
    assert report["files"]["pytorch_model.bin"]["tensor_bytes"] == 200 * 4
    assert report["files"]["pytorch_model.bin"]["ratio"] == 1.0


def test_save_pretrained_accepts_lean_state_dict(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    # Make every parameter a view of one flat buffer, as ZeRO-1/2 does.
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    pos = 0
    for p in params:
        p.data = flat[pos:pos + p.numel()].view_as(p)
        pos += p.numel()
    model.save_pretrained(tmp_path, state_dict=lean_state_dict(model.state_dict()))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
