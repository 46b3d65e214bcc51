"""Model-parallel layouts the engines get wrong (seeds 000, 001, 004), on real DeepSpeed runs."""

import json
import shutil

import pytest
import torch

from hf_ckpt_integrations import export_checkpoint, inspect_checkpoint
from hf_ckpt_integrations.sources.deepspeed.allowlist import load as load_rank_file
from helpers import export, export_refused, hf_ckpt, load_safetensors

pytestmark = pytest.mark.engine

CASES = ["replica-z2", "replica-z3", "replica-z2-dp2", "autotp-z1", "autotp-z2", "z2-dp12", "z3-dp12"]


@pytest.mark.parametrize("name", CASES)
def test_exports_bitwise_equal_to_engine(name, engine_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    case = engine_ckpt(name)
    export_checkpoint(case / "ckpt", tmp_path / "hf", config=str(case / "config"))
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.vocab_size == 1001
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    ref = load_safetensors(case / "reference" / "master.safetensors")
    assert set(out) == set(ref)
    for n, t in ref.items():
        assert torch.equal(out[n], t), n
    r = hf_ckpt("verify", tmp_path / "hf", "--against", case / "ckpt", "--config", case / "config")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("name,dp", [("replica-z2", 1), ("replica-z3", 1), ("replica-z2-dp2", 2)])
def test_inspect_names_the_replica_axis(name, dp, engine_ckpt):
    case = engine_ckpt(name)
    r = hf_ckpt("inspect", case / "ckpt", "--config", case / "config", "--json")
    info = json.loads(r.stdout)
    assert (info["mp_axis"], info["mp_size"], info["dp_size"]) == ("replica", 2, dp)
    assert "full shape" in info["mp_axis_reason"]
    assert {t["rule"] for t in info["tensors"]} == {"replica axis"}
    assert all(t["replicas"] == 1 for t in info["tensors"])


def test_replica_axis_detected_from_bytes_without_config(engine_ckpt):
    case = engine_ckpt("replica-z2")
    info = inspect_checkpoint(case / "ckpt")
    assert info["mp_axis"] == "replica" and "byte-identical" in info["mp_axis_reason"]


def test_inspect_reports_autotp_rules(engine_ckpt):
    case = engine_ckpt("autotp-z2")
    info = inspect_checkpoint(case / "ckpt", config=str(case / "config"))
    assert (info["mp_axis"], info["mp_size"], info["dp_size"]) == ("tp", 2, 1)
    by_name = {t["name"]: t for t in info["tensors"]}
    assert by_name["model.layers.0.self_attn.o_proj.weight"]["cat_dim"] == 1
    assert by_name["model.layers.0.mlp.up_proj.weight"]["cat_dim"] == 0
    assert by_name["model.norm.weight"]["cat_dim"] is None and by_name["model.norm.weight"]["replicas"] == 1
    assert {t["rule"] for t in info["tensors"]} == {"universal_checkpoint_info"}
    # DeepSpeed 0.19.8 splits the 1001-row lm_head unevenly (501 + 500): nothing to unpad.
    assert info["padding_removed"] == {}


def _copy(case, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(case / "ckpt", src)
    return src, src / "global_step2"


def _refused(src, tmp_path, *args, match):
    return export_refused(src, tmp_path / "out", *args, match=match)


def test_corrupted_replica_refused_naming_file_and_tensor(engine_ckpt, tmp_path):
    case = engine_ckpt("replica-z2")
    src, tag = _copy(case, tmp_path)
    victim = tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    part = load_rank_file(victim)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    offset, nbytes = part.byte_range()
    data = bytearray(victim.read_bytes())
    data[offset + 4 * 10] ^= 0x40  # element 10 of the flat partition: model.embed_tokens.weight
    victim.write_bytes(bytes(data))
    line = _refused(src, tmp_path, "--config", case / "config", match=str(victim))
    assert "model.embed_tokens.weight" in line and "differs" in line


def test_missing_model_parallel_rank_refused(engine_ckpt, tmp_path):
    case = engine_ckpt("autotp-z1")
    src, tag = _copy(case, tmp_path)
    (tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    _refused(src, tmp_path, "--config", case / "config", match="rank file is missing")


def _strip_universal_info(tag):
    """Turn an AutoTP checkpoint into one that records no merge rules (seed 001's situation)."""
    for f in tag.glob("mp_rank_*_model_states.pt"):
        sd = torch.load(f, weights_only=False)  # our own test file
        sd.pop("universal_checkpoint_info")
        torch.save(sd, f)


def test_tp_without_recorded_rules_uses_hf_tp_plan(engine_ckpt, tmp_path):
    case = engine_ckpt("autotp-z2")
    src, tag = _copy(case, tmp_path)
    _strip_universal_info(tag)
    info = inspect_checkpoint(src, config=str(case / "config"))
    rules = {t["name"]: t["rule"] for t in info["tensors"]}
    assert rules["model.layers.1.self_attn.o_proj.weight"].startswith("HF tp plan")
    assert rules["lm_head.weight"].startswith("HF tp plan lm_head")
    assert rules["model.norm.weight"] == "each slice has the full shape from config.json"
    export_checkpoint(src, tmp_path / "hf", config=str(case / "config"))
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    for n, t in load_safetensors(case / "reference" / "master.safetensors").items():
        assert torch.equal(out[n], t), n


def test_unknown_tp_parameter_refused_then_user_rule_merges_it(engine_ckpt, tmp_path):
    case = engine_ckpt("autotp-z2")
    src, tag = _copy(case, tmp_path)
    _strip_universal_info(tag)
    config = tmp_path / "config"
    shutil.copytree(case / "config", config)
    cfg = json.loads((config / "config.json").read_text())
    cfg["base_model_tp_plan"] = {"layers.*.self_attn.*": "colwise", "layers.*.mlp.*": "colwise"}  # no o/down rules
    del cfg["base_model_tp_plan"]["layers.*.mlp.*"]
    (config / "config.json").write_text(json.dumps(cfg))
    line = _refused(src, tmp_path, "--config", config, match="--tp-rule")
    # o_proj is colwise by this (wrong) plan: the full shape from config.json exposes it.
    assert "model.layers.0.self_attn.o_proj.weight" in line or "mlp" in line, line
    cfg["base_model_tp_plan"] = {}
    (config / "config.json").write_text(json.dumps(cfg))
    line = _refused(src, tmp_path, "--config", config, match="--tp-rule")
    assert "suggests dim" in line
    rules = ["model.layers.*.self_attn.[qkv]_proj.weight=0", "model.layers.*.mlp.gate_proj.weight=0",
             "model.layers.*.mlp.up_proj.weight=0", "*o_proj.weight=1", "*down_proj.weight=1"]
    args = [a for r in rules for a in ("--tp-rule", r)]
    r = export(src, tmp_path / "out", "--config", config, "--quiet", *args)
    out = load_safetensors(tmp_path / "out" / "model.safetensors")
    for n, t in load_safetensors(case / "reference" / "master.safetensors").items():
        assert torch.equal(out[n], t), n


@pytest.mark.parametrize("name", ["tp-z1", "tp-z2"])
def test_custom_tp_mpu_needs_one_rule_for_the_vocab_parallel_embedding(name, engine_ckpt, tmp_path):
    """q/k/v/o/gate/up/down and lm_head merge by the HF tp plan, norms by their full shape; the
    vocabulary-parallel embedding is in no plan, so export refuses until the user says dim 0."""
    from transformers import AutoModelForCausalLM

    case = engine_ckpt(name)
    line = _refused(case / "ckpt", tmp_path, "--config", case / "config", match="model.embed_tokens.weight")
    assert "--tp-rule 'model.embed_tokens.weight=0'" in line and "suggests dim 0" in line
    rule = ["model.embed_tokens.weight=0"]
    info = inspect_checkpoint(case / "ckpt", config=str(case / "config"), tp_rules=rule)
    rules = {t["name"]: t["rule"] for t in info["tensors"]}
    assert rules["model.embed_tokens.weight"] == "user rule model.embed_tokens.weight=0"
    assert rules["model.layers.0.mlp.down_proj.weight"] == "HF tp plan model.layers.*.mlp.down_proj: rowwise"
    assert rules["model.layers.0.input_layernorm.weight"] == "each slice has the full shape from config.json"
    export_checkpoint(case / "ckpt", tmp_path / "hf", config=str(case / "config"), tp_rules=rule)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    for n, t in load_safetensors(case / "reference" / "master.safetensors").items():
        assert torch.equal(out[n], t), n
    r = hf_ckpt("verify", tmp_path / "hf", "--against", case / "ckpt", "--config", case / "config",
                "--tp-rule", rule[0])
    assert r.returncode == 0, r.stdout + r.stderr
