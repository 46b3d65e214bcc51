"""DeepSpeed AutoEP saves (fused ``experts.w1/w2/w3`` per expert-parallel rank, one
``layer_L_expert_E`` file per global expert) export into the model's Hub layout, bitwise what
transformers' own ``save_pretrained`` writes from the engine's fp32 masters, experts gathered."""


import pytest
import torch

from hf_ckpt_integrations import export_checkpoint, inspect_checkpoint, verify_checkpoint
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.sources.deepspeed import autoep
from helpers import export_refused, load_safetensors, tampered_copy


def _layer(**over):
    layer = {"module_path": "model.layers.0.mlp", "expert_key_prefix": "model.layers.0.mlp.experts",
             "num_experts": 2, "ep_size": 2}
    layer.update(over)
    return layer


def test_preset_without_a_known_hf_layout_refused():
    model = {"ds_autoep_layers": [_layer()], "ds_config": {"expert_parallel": {"preset_model": "deepseek_v3"}}}
    with pytest.raises(LayoutError, match="preset_model 'deepseek_v3'"):
        autoep._layers(model, "m.pt")
    model["ds_config"]["expert_parallel"]["preset_model"] = "mixtral"
    assert autoep._layers(model, "m.pt")[1] == ("gate", "gate_up_proj", "down_proj")


def test_experts_not_divisible_over_ep_refused():
    model = {"ds_autoep_layers": [_layer(num_experts=3)], "ds_config": {"expert_parallel": {"preset_model": "mixtral"}}}
    with pytest.raises(LayoutError, match="3 experts over ep_size 2"):
        autoep._layers(model, "m.pt")


def test_autoep_files_told_from_deepspeed_moe_files(tmp_path):
    name = "layer_0_expert_1_mp_rank_00_model_states.pt"
    torch.save({"moe1.deepspeed_moe.experts.deepspeed_experts.1.0.weight": torch.ones(2)}, tmp_path / name)
    assert autoep.find_autoep_files(str(tmp_path), [name], 0) is None
    torch.save({"model.layers.0.mlp.experts.w1.1": torch.ones(2, 3)}, tmp_path / name)
    found = autoep.find_autoep_files(str(tmp_path), [name], 0)
    assert list(found.weights) == ["model.layers.0.mlp.experts.w1.1"]
    torch.save({"model.layers.0.mlp.experts.w1.0": torch.ones(2, 3)}, tmp_path / name)  # expert 0 in 1's file
    with pytest.raises(LayoutError, match="not a 2-D AutoEP weight of expert 1"):
        autoep.find_autoep_files(str(tmp_path), [name], 0)


@pytest.mark.engine
@pytest.mark.parametrize("name", ["autoep-z1", "autoep-z2-bf16"])
def test_autoep_export_is_save_pretrained_of_the_engine_masters(name, engine_ckpt, tmp_path):
    from transformers import MixtralForCausalLM

    case = engine_ckpt(name)
    ref_dir = case / "reference" / "hf"
    export_checkpoint(case / "ckpt", tmp_path / "hf", config=str(ref_dir))
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    ref = load_safetensors(ref_dir / "model.safetensors")
    assert sum(".block_sparse_moe.experts." in n for n in ref) == 2 * 2 * 3  # layers x experts x w1/w2/w3
    assert set(out) == set(ref)
    assert [n for n in ref if not (out[n].dtype == ref[n].dtype and torch.equal(out[n], ref[n]))] == []
    MixtralForCausalLM.from_pretrained(tmp_path / "hf")
    assert verify_checkpoint(tmp_path / "hf", against=case / "ckpt", config=str(ref_dir)).ok
    notes = inspect_checkpoint(case / "ckpt")["notes"]
    assert any(n.startswith("AutoEP") and "DeepSpeed's default E + D" in n for n in notes)
    if name.endswith("bf16"):  # the training dtype: each expert as the engine's own expert file holds it
        export_checkpoint(case / "ckpt", tmp_path / "hf16", config=str(ref_dir), dtype="bf16")
        out16 = load_safetensors(tmp_path / "hf16" / "model.safetensors")
        held = {}
        for path in sorted((case / "ckpt" / "global_step2").glob("layer_*_expert_*_model_states.pt")):
            for key, t in torch.load(path, weights_only=True).items():  # model.layers.L.mlp.experts.wK.E
                layer, w, e = key.split(".")[2], key.split(".")[-2], key.split(".")[-1]
                held[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"] = t
        assert len(held) == 12 and all(t.dtype == torch.bfloat16 for t in held.values())
        assert [n for n in held if not torch.equal(out16[n], held[n])] == []


@pytest.mark.engine
def test_autoep_experts_not_matching_their_files_refused(engine_ckpt, tmp_path):
    src = tampered_copy(engine_ckpt("autoep-z2-bf16") / "ckpt", tmp_path,
                        "global_step2/layer_1_expert_1_mp_rank_00_model_states.pt",
                        lambda state: {k: v + 1 for k, v in state.items()})  # the weights of another training
    export_refused(src, tmp_path / "hf", "--config", str(engine_ckpt("autoep-z2-bf16") / "reference" / "hf"),
                   match="in no rank order DeepSpeed builds")


@pytest.mark.engine
def test_autoep_router_copy_differing_from_the_router_refused(engine_ckpt, tmp_path):
    src = tampered_copy(engine_ckpt("autoep-z1") / "ckpt", tmp_path, "global_step2/mp_rank_00_model_states.pt",
                        edit=lambda state: state["module"]["model.layers.1.mlp.gate.gate.weight"].add_(1),
                        weights_only=False)  # not the router it copies
    export_refused(src, tmp_path / "hf", "--config", str(engine_ckpt("autoep-z1") / "reference" / "hf"),
                   match="differs from the router")
