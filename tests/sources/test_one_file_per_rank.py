"""One file per rank, layer, expert or partition: two names for one (``rank_1`` and ``rank_01``)
are refused by every source that lists such files, naming both and the one to remove
(guards.claim_file, the one shared rule)."""

import shutil

import pytest
import torch

from helpers import export_refused
from hf_ckpt_integrations import guards
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.sources.deepspeed import moe, pipeline, rank_files
from rank_files_build import synthetic_layouts, write_rank_files


def test_claim_file_names_both_and_the_one_to_remove():
    slots = {}
    guards.claim_file(slots, 1, "/d/mp_rank_01_model_states.pt", where="/d", canonical="mp_rank_01_model_states.pt")
    with pytest.raises(LayoutError, match=r"mp_rank_01_model_states.pt and mp_rank_1_model_states.pt both claim "
                                          r"rank 1.*remove mp_rank_1_model_states.pt"):
        guards.claim_file(slots, 1, "/d/mp_rank_1_model_states.pt", where="/d", canonical="mp_rank_01_model_states.pt")
    with pytest.raises(LayoutError, match="remove the one this save did not write"):
        guards.claim_file(slots, 1, "/d/mp_rank_001_model_states.pt", where="/d")
    assert slots == {1: "/d/mp_rank_01_model_states.pt"}


@pytest.mark.parametrize("names", [
    ("model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt", "model_world_size_2_rank_01.pt"),
    ("pytorch_model_fsdp_0_rank0.bin", "pytorch_model_fsdp_0_rank1.bin", "pytorch_model_fsdp_0_rank01.bin"),
    ("pytorch_model_fsdp_rank0.bin", "pytorch_model_fsdp_rank1.bin", "pytorch_model_fsdp_rank001.bin"),
])
def test_fsdp_rank_files_two_files_for_one_rank_refused(tmp_path, names):
    """An edited copy of rank 1's file under another spelling of rank 1 used to be exported silently."""
    mesh, tensors = synthetic_layouts()["1d-uneven"]
    made = write_rank_files(tmp_path / "made", {"a": tensors["a"]}, (2,))
    src = tmp_path / "actor"
    src.mkdir()
    for rank, name in enumerate(names[:2]):
        shutil.copy(made / f"model_world_size_2_rank_{rank}.pt", src / name)
    sd = torch.load(made / "model_world_size_2_rank_1.pt", weights_only=False)
    sd["a"]._local_tensor.add_(1)
    torch.save(sd, src / names[2])
    export_refused(src, tmp_path / "out", match=(names[1], names[2], "both claim rank 1", f"remove {names[2]}"))


def _touch(d, *names):
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_bytes(b"")
    return str(d)


def test_deepspeed_rank_files_two_files_for_one_partition_refused(tmp_path):
    tag = _touch(tmp_path / "t", "mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_0_optim_states.pt")
    with pytest.raises(LayoutError, match="remove zero_pp_rank_1_mp_rank_0_optim_states.pt"):
        rank_files.find_rank_files(tag)


def test_pipeline_two_files_for_one_layer_refused(tmp_path):
    tag = _touch(tmp_path / "t", "mp_rank_00_model_states.pt", "layer_01-model_00-model_states.pt",
                 "layer_1-model_00-model_states.pt")
    with pytest.raises(LayoutError, match=r"layer_01-model_00-model_states.pt and layer_1-model_00-model_states.pt "
                                          r"both claim layer 1's tensor-parallel rank 0.*remove layer_1-model_00"):
        pipeline.rank_files(tag)


def test_moe_two_files_for_one_expert_refused(tmp_path):
    """deepspeed.moe and AutoEP expert files: the later name used to win silently."""
    names = ["layer_1_expert_0_mp_rank_00_model_states.pt", "layer_01_expert_0_mp_rank_00_model_states.pt"]
    tag = _touch(tmp_path / "t", *names)
    with pytest.raises(LayoutError, match="both claim MoE layer 1's expert 0.*remove layer_01_expert_0"):
        moe.expert_files(tag, sorted(names), 0)


def test_verl_rank_past_the_world_size_refused(tmp_path):
    """verl's names record the world size: rank 7 of a 2-rank save was ignored silently."""
    mesh, tensors = synthetic_layouts()["1d-uneven"]
    src = write_rank_files(tmp_path / "actor", {"a": tensors["a"]}, (2,))
    shutil.copy(src / "model_world_size_2_rank_1.pt", src / "model_world_size_2_rank_7.pt")
    export_refused(src, tmp_path / "out", match=("model_world_size_2_rank_7.pt", "rank 7 of a save of 2 ranks"))
