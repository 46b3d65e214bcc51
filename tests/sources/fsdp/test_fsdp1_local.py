"""FSDP1 ``LOCAL_STATE_DICT`` rank files: flat parameters split by the config's model
(hf_ckpt_integrations/sources/fsdp_rank_files/local.py).

Engine case ``rank-fsdp1-local`` (tests/engines/fsdp1_local.py, 2 CPU ranks, gloo): a tiny Llama of
odd sizes (hidden 63, vocabulary 1001: the root unit's flat parameter is padded on the last rank)
wrapped per decoder layer, saved by Accelerate's ``save_fsdp_model`` under LOCAL_STATE_DICT with
``use_orig_params`` off (fp32, no padding between parameters) and on (bf16 compute: alignment padding,
the parameters' views beside the flat parameters); each export bitwise equal to the engine's own
FULL_STATE_DICT of the same run and loaded with ``from_pretrained``.

Fast: the candidate layouts (:func:`layouts`) and the parameters of each unit of a meta model.
"""

import json
import shutil

import pytest
import torch

from helpers import assert_bitwise_equal, export, export_refused, hf_ckpt, load_hf_state, load_safetensors
from hf_ckpt_integrations.sources.fsdp_rank_files.local import layouts, unit_params


@pytest.mark.parametrize("variant", ["flat", "orig"])
def test_local_state_dict_export_is_the_engines_weights(engine_ckpt, tmp_path, variant):
    case = engine_ckpt("rank-fsdp1-local")
    out = tmp_path / "out"
    r = export(case / variant / "state", out, "--config", case / "config")
    ref = load_safetensors(case / variant / "reference.safetensors")
    got = load_safetensors(out / "model.safetensors")
    assert set(got) == set(ref)
    assert_bitwise_equal(got, ref)
    assert all(t.dtype == torch.float32 for t in got.values())
    assert_bitwise_equal(load_hf_state(out, torch.float32), ref)
    info = json.loads(hf_ckpt("inspect", case / variant / "state", "--config", case / "config", "--json").stdout)
    assert info["placements"] == {"flat parameter": len(ref)}
    assert info["flat_parameters"]["views"] is (variant == "orig")


@pytest.fixture
def local_case(engine_ckpt, tmp_path):
    case = engine_ckpt("rank-fsdp1-local")
    src = tmp_path / "state"
    shutil.copytree(case / "orig" / "state", src)
    return case, src


def test_local_without_config_refused(local_case, tmp_path):
    _, src = local_case
    export_refused(src, tmp_path / "out", match=("pytorch_model_fsdp_rank0.bin", "pass --config"))


def test_local_with_another_models_config_refused(local_case, tmp_path):
    """A config of another model (hidden 64): no FSDP layout of its parameters gives the recorded counts."""
    import sys

    import common

    _, src = local_case
    common.tiny_llama_config().save_pretrained(tmp_path / "other")
    export_refused(src, tmp_path / "out", "--config", tmp_path / "other",
                   match=("flat parameter", "no FSDP layout", "not the trained model's"))


def test_local_missing_rank_refused(local_case, tmp_path):
    """A missing rank before the last is named; the last one leaves a gap in the flat parameters
    (the file names do not record the world size)."""
    case, src = local_case
    (src / "pytorch_model_fsdp_rank1.bin").rename(tmp_path / "rank1")
    export_refused(src, tmp_path / "out", "--config", case / "config",
                   match=("_flat_param do not tile", "a gap", "a rank's file is missing"))
    (tmp_path / "rank1").rename(src / "pytorch_model_fsdp_rank1.bin")
    (src / "pytorch_model_fsdp_rank0.bin").unlink()
    export_refused(src, tmp_path / "out", "--config", case / "config",
                   match=("pytorch_model_fsdp_rank0.bin", "missing"))


def test_local_view_out_of_place_refused(local_case, tmp_path):
    """use_orig_params' views must sit where the layout puts them: a view one element longer fits no layout."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    case, src = local_case
    path = src / "pytorch_model_fsdp_rank0.bin"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)  # torch.load of a ShardedTensor needs one
    try:
        sd = torch.load(path, weights_only=False)
        sd["model.norm.weight"] = torch.zeros(sd["model.norm.weight"].numel() + 1)
        torch.save(sd, path)
    finally:
        dist.destroy_process_group()
    export_refused(src, tmp_path / "out", "--config", case / "config", match=("_flat_param", "no FSDP layout"))


def test_local_flat_parameter_of_one_rank_only_refused(local_case, tmp_path):
    """Ranks must hold the same FSDP units: an extra flat parameter in rank 1's file names the mix."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    case, src = local_case
    path = src / "pytorch_model_fsdp_rank1.bin"
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        sd = torch.load(path, weights_only=False)
        sd["model.layers.7._flat_param"] = sd["model.layers.1._flat_param"]
        torch.save(sd, path)
    finally:
        dist.destroy_process_group()
    export_refused(src, tmp_path / "out", "--config", case / "config",
                   match=("pytorch_model_fsdp_rank1.bin", "model.layers.7._flat_param", "rank 0's only"))


def test_local_file_under_a_sharded_name_refused(local_case, tmp_path):
    """Flat parameters are never exported as tensors: LOCAL files renamed as SHARDED_STATE_DICT ones are refused."""
    case, src = local_case
    for r in (0, 1):
        (src / f"pytorch_model_fsdp_rank{r}.bin").rename(src / f"pytorch_model_fsdp_0_rank{r}.bin")
    export_refused(src, tmp_path / "out", "--config", case / "config",
                   match=("pytorch_model_fsdp_0_rank0.bin", "flat parameter", "LOCAL_STATE_DICT"))


def test_layouts_candidates():
    # use_orig_params=False: the parameters end to end, nothing else.
    assert layouts([3, 5], 2, 8) == {(0, 3): [0]}
    # alignment of 4 (fp32 compute) and 8 (bf16 compute) agree here: one layout, both named.
    assert layouts([8, 3], 2, 12) == {(0, 8): [2, 4, 8]}
    # ... and differ here with the same total: two layouts (refused by the source as ambiguous).
    assert layouts([2, 3], 4, 8) == {(0, 2): [2], (0, 4): [4]}
    assert layouts([3, 5], 2, 9) == {}


def test_unit_params_follow_fsdp1s_flattening_order():
    """Each unit holds its module's parameters not under a nested unit, in named_modules order; a
    tied weight once, under its first name."""
    import sys

    import common
    from hf_ckpt_integrations.convert.hub_layout import meta_model

    model = meta_model(common.tiny_llama_config(tie_word_embeddings=True))
    params, aliases, loose = unit_params(model, ["model.layers.0", "model.layers.1", ""], "x")
    assert [n for n, _ in params[""]] == ["model.embed_tokens.weight", "model.norm.weight"]
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert [n for n, _ in params["model.layers.1"]][:2] == ["model.layers.1.self_attn.q_proj.weight",
                                                            "model.layers.1.self_attn.k_proj.weight"]
    assert loose == []
    _, _, loose = unit_params(model, ["model.layers.0"], "x")
    assert "model.layers.1.mlp.up_proj.weight" in [n for n, _ in loose]


def test_verify_takes_the_exports_own_config(local_case, tmp_path):
    """The files keep no config beside them and only the config's model splits them: verify without
    --config reads the config.json the export wrote into DST (sources' needs_config hook)."""
    case, src = local_case
    out = tmp_path / "out"
    assert hf_ckpt("export", src, out, "--config", case / "config").returncode == 0
    v = hf_ckpt("verify", out, "--against", src)
    assert v.returncode == 0 and "bitwise equal" in v.stdout, v.stdout[-2000:] + v.stderr[-2000:]
