"""verl LoRA actors: ``--merge-adapters`` from the rank files alone (base weights and LoRA weights
both in them), the adapter config from verl's ``actor/lora_adapter/``.

Engine case ``rank-verl-lora`` (tests/engines/verl_lora.py, 2 CPU ranks, gloo): a PeftModel
(``all-linear`` LoRA, r=4, alpha=8) under FSDP2 saved as verl's checkpoint manager and fsdp worker
save it; the references come from the engine's own gathered full state dict: peft's
``merge_and_unload`` of it, and ``get_peft_model_state_dict`` of it.
"""

import json
import shutil

import torch

from helpers import assert_bitwise_equal, export, export_refused, hf_ckpt, load_hf_state, load_safetensors


def test_merge_without_base_is_pefts_merge(engine_ckpt, tmp_path):
    case = engine_ckpt("rank-verl-lora")
    out = tmp_path / "merged"
    r = export(case / "ckpt", out, "--merge-adapters")
    ref = load_safetensors(case / "reference_merged.safetensors")
    full = load_safetensors(case / "reference_full.safetensors")
    base = {k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in full.items() if "lora_" not in k}
    got = load_safetensors(out / "model.safetensors")
    assert set(got) == set(ref)
    merged = [k for k in ref if not torch.equal(ref[k], base[k])]
    assert len(merged) == 14  # all-linear: 7 projections x 2 layers, the update applied (verl's merger once wrote the base)
    for k in ref:
        if k in merged:
            assert (got[k] - ref[k]).abs().max() <= 1e-6, k
            assert (got[k] - base[k]).abs().max() > 1e-4, k
        else:
            assert torch.equal(got[k], ref[k]), k
    loaded = load_hf_state(out, torch.float32)
    assert set(loaded) >= set(ref) - {"lm_head.weight"}


def test_adapter_export_uses_verls_lora_adapter_config(engine_ckpt, tmp_path):
    case = engine_ckpt("rank-verl-lora")
    out = tmp_path / "adapter"
    r = export(case / "ckpt", out)
    assert_bitwise_equal(load_safetensors(out / "adapter_model.safetensors"),
                         load_safetensors(case / "reference_adapter.safetensors"))
    info = json.loads(hf_ckpt("inspect", case / "ckpt", "--json").stdout)
    assert info["adapter"]["config"].endswith("actor/lora_adapter/adapter_config.json")
    assert info["adapter"]["base_in_checkpoint"] == 21  # every base weight of the tiny Llama


def test_merge_without_adapter_config_refused(engine_ckpt, tmp_path):
    """No lora_adapter/ (verl failed to write it, or it was not copied): LoRA's alpha is unknown."""
    actor = tmp_path / "actor"
    shutil.copytree(engine_ckpt("rank-verl-lora") / "ckpt/global_step_2/actor", actor)
    shutil.rmtree(actor / "lora_adapter")
    export_refused(actor, tmp_path / "out", "--merge-adapters", match=("no adapter_config.json", "--config"))


def test_base_names_of_a_peft_state_dict():
    """The base weights a PeftModel's state dict holds, under the base model's names; adapter tensors none."""
    from hf_ckpt_integrations.sources.peft import base_name

    assert base_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert base_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"
    assert base_name("base_model.model.model.norm.weight") == "model.norm.weight"
    for adapter in ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                    "base_model.model.lm_head.modules_to_save.default.weight", "model.norm.weight"):
        assert base_name(adapter) is None, adapter
