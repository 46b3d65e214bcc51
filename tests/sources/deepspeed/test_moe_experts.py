"""DeepSpeed MoE with expert parallelism (ZeRO-1/2): experts come from their expert groups'
partitions (each partitioned over its expert-data-parallel ranks), are named by their global id
as DeepSpeed's ``layer_L_expert_E`` files name them, and every rank order is proven against those
files' weights before it is used."""

import json

import pytest
import torch

from hf_ckpt_integrations import export_checkpoint, inspect_checkpoint, verify_checkpoint
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.sources.deepspeed import moe, zero12
from helpers import export_refused, load_safetensors, tampered_copy

LOCAL = "moe1.deepspeed_moe.experts.deepspeed_experts."


def _deepspeed_expert_dp_groups(world, ep, data_before_expert):
    """The expert-data-parallel groups DeepSpeed's ``groups._create_expert_and_data_parallel``
    builds without model or pipeline parallelism (its legacy path, transcribed)."""
    ep_stride = world // ep
    if data_before_expert:
        return [list(range(i * ep_stride, (i + 1) * ep_stride)) for i in range(ep)]
    return [list(range(i, world, ep)) for i in range(ep)]


@pytest.mark.parametrize("world,ep", [(4, 2), (8, 2), (8, 4), (4, 4), (4, 1)])
def test_topologies_are_the_groups_deepspeed_builds(world, ep):
    count = world // ep
    (_, e_d), (_, d_e) = moe.TOPOLOGIES
    for rank_of, data_before in ((e_d, False), (d_e, True)):
        ours = [[rank_of(e, k, ep, count) for k in range(count)] for e in range(ep)]
        assert ours == _deepspeed_expert_dp_groups(world, ep, data_before)


def test_global_expert_name():
    counts = {LOCAL: 4}
    assert moe.global_expert_name(LOCAL + "1.0.weight", 1, 2, counts, "f") == LOCAL + "3.0.weight"
    assert moe.global_expert_name(LOCAL + "0.2.bias", 0, 2, counts, "f") == LOCAL + "0.2.bias"
    with pytest.raises(LayoutError, match="local expert 2 of a layer with 4 expert files"):
        moe.global_expert_name(LOCAL + "2.0.weight", 0, 2, counts, "f")
    with pytest.raises(LayoutError, match="which no layer_"):
        moe.global_expert_name("moe9.deepspeed_moe.experts.deepspeed_experts.0.w", 0, 2, counts, "f")


def _expert_files(tag, layers):
    for layer, experts in layers.items():
        for e, key_id in experts.items():
            torch.save({f"moe{layer}.deepspeed_moe.experts.deepspeed_experts.{key_id}.0.weight": torch.ones(2)},
                       tag / f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt")
    import os

    return sorted(os.listdir(tag))


def test_expert_files_found_by_layer(tmp_path):
    names = _expert_files(tmp_path, {0: {0: 0, 1: 1}, 1: {0: 0, 1: 1, 2: 2, 3: 3}})
    found = moe.find_expert_files(str(tmp_path), names, 0)
    assert found.counts == {"moe0.deepspeed_moe.experts.deepspeed_experts.": 2,
                            "moe1.deepspeed_moe.experts.deepspeed_experts.": 4}
    assert len(found.weights) == 6 and len(found.files) == 6
    assert not moe.find_expert_files(str(tmp_path), names, 1)  # another model-parallel rank: none


def test_missing_expert_file_refused(tmp_path):
    names = _expert_files(tmp_path, {0: {0: 0, 1: 1, 3: 3}})
    with pytest.raises(LayoutError, match=r"miss experts \[2\]"):
        moe.find_expert_files(str(tmp_path), names, 0)


def test_expert_file_of_another_expert_refused(tmp_path):
    names = _expert_files(tmp_path, {0: {0: 0, 1: 0}})
    with pytest.raises(LayoutError, match="not a weight of expert 1"):
        moe.find_expert_files(str(tmp_path), names, 0)


def test_expert_without_its_file_weight_refused_before_any_rank_order():
    class Rank:
        path = "zero_pp_rank_0_mp_rank_00_optim_states.pt"

    names = [LOCAL + "0.0.weight", LOCAL + "0.0.bias"]
    held = {LOCAL + f"{e}.0.{w}": object() for e in range(2) for w in ("weight", "bias")}
    del held[LOCAL + "1.0.bias"]  # global expert 1 = expert-parallel rank 1's local expert 0
    experts = moe.Experts(held, {LOCAL: 2}, ["f"])
    with pytest.raises(LayoutError, match=r"no layer_\*_expert_\* file holds \['moe1\.deepspeed_moe"):
        moe.plan_expert_group({r: Rank() for r in range(4)}, 1, names, [(3, 2), (3,)], 2, "m.pt", {}, experts, [],
                              plan_group=zero12.plan_group)


def test_autoep_expert_file_named_as_such(tmp_path):
    name = "layer_0_expert_0_mp_rank_00_model_states.pt"
    torch.save({"model.layers.0.mlp.experts.w1.0": torch.ones(2)}, tmp_path / name)
    with pytest.raises(LayoutError, match="AutoEP expert file"):
        moe.find_expert_files(str(tmp_path), [name], 0)


CASES = ["moe-z2-ep2", "moe-z1-ep2-dxe"]


@pytest.mark.engine
@pytest.mark.parametrize("name", CASES)
def test_moe_export_is_the_engine_masters_experts_gathered(name, engine_ckpt, tmp_path):
    case = engine_ckpt(name)
    run = json.loads((case / "reference" / "run.json").read_text())
    export_checkpoint(case / "ckpt", tmp_path / "hf", weights_only=True)  # no config: the engine's own names
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    masters = load_safetensors(case / "reference" / "master.safetensors")
    experts = {n for n in masters if ".deepspeed_experts." in n}
    assert len(experts) == 2 * run["num_experts"] * 4  # 2 MoE layers x 4 experts x 2 Linear (weight, bias)
    assert set(out) == set(masters)
    assert [n for n in masters if not torch.equal(out[n], masters[n])] == []
    assert verify_checkpoint(tmp_path / "hf", against=case / "ckpt").ok
    # The rank order DeepSpeed used (recorded by the run, not in the files) is the one proven.
    order = "use_data_before_expert_parallel_" if run["data_before_expert"] else "DeepSpeed's default E + D"
    assert any("MoE" in n and order in n for n in inspect_checkpoint(case / "ckpt")["notes"])
    if run["dtype"] == "bf16":  # the training dtype: the experts' module weights, as the expert files hold them
        export_checkpoint(case / "ckpt", tmp_path / "hf16", dtype="bf16", weights_only=True)
        module = load_safetensors(case / "reference" / "module.safetensors")
        out16 = load_safetensors(tmp_path / "hf16" / "model.safetensors")
        assert [n for n in module if not torch.equal(out16[n], module[n])] == []


@pytest.mark.engine
def test_moe_experts_not_matching_their_files_refused(engine_ckpt, tmp_path):
    src = tampered_copy(engine_ckpt("moe-z2-ep2") / "ckpt", tmp_path,
                        "global_step2/layer_0_expert_3_mp_rank_00_model_states.pt",
                        lambda state: {k: v + 1 for k, v in state.items()})  # the weights of another training
    export_refused(src, tmp_path / "hf", match="in no rank order DeepSpeed builds")


@pytest.mark.engine
def test_moe_missing_expert_file_refused(engine_ckpt, tmp_path):
    src = tampered_copy(engine_ckpt("moe-z2-ep2") / "ckpt", tmp_path)
    (src / "global_step2" / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    export_refused(src, tmp_path / "hf", match="miss experts [2]")


@pytest.mark.engine
def test_moe_expert_file_without_a_weight_refused(engine_ckpt, tmp_path):
    src = tampered_copy(engine_ckpt("moe-z2-ep2") / "ckpt", tmp_path,
                        "global_step2/layer_1_expert_1_mp_rank_00_model_states.pt",
                        lambda state: {k: v for k, v in state.items() if not k.endswith(".2.bias")})
    # Without that weight the expert's masters could not be proven at any place.
    export_refused(src, tmp_path / "hf", match="no layer_*_expert_* file holds")
