"""Synthetic DeepSpeed saves (benchmarks/synth_ckpt.py, the scale benchmark's input) export bitwise.

Proves the generator writes what the reader understands, and covers the plan's many-rank paths
on real files: ZeRO-3 parameters smaller than the rank count (on the first ranks only), ZeRO-1/2
partitions that cut through parameters, every rank's recorded param_slice_mappings checked.
"""

import sys

import pytest
import torch

from hf_ckpt_integrations import export_checkpoint
from hf_ckpt_integrations.sources import build_plan
from helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from synth_ckpt import make_checkpoint  # noqa: E402


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_many_ranks_export_bitwise(stage, tmp_path):
    src = tmp_path / "ckpt"
    # hidden 8 at 37 ranks: the layernorms (8 elements) sit on 8 of the 37 ZeRO-3 ranks.
    info = make_checkpoint(src, stage=stage, dp=37, layers=2, hidden=8, vocab=40, heads=2, kv_heads=1,
                           reference=True)
    plan = build_plan(str(src))
    assert plan.detail["zero_stage"] == stage and plan.detail["dp_size"] == 37 and len(plan.tensors) == info["tensors"]
    norm = next(t for t in plan.tensors if t.name == "model.norm.weight")
    assert len(norm.parts[0]) == (8 if stage == 3 else 1)
    export_checkpoint(str(src), str(tmp_path / "hf"), dtype="fp32")
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ref = torch.load(src / "reference_fp32.pt")
    assert set(got) == set(ref)
    for name, t in ref.items():
        assert torch.equal(got[name].view(torch.int32), t.view(torch.int32)), name


def test_zero3_plan_in_tensors_not_pieces(tmp_path):
    """Issue 39: a ZeRO-3 plan holds one StridedPieces per tensor (its pieces made on demand), equal to
    the listed pieces; the optimizer states (universal) move it without making its pieces, to the same
    places the per-piece path finds."""
    import dataclasses

    from hf_ckpt_integrations.plan import StridedPieces
    from hf_ckpt_integrations.sources.deepspeed.optim_states import OptimizerStates

    src = tmp_path / "ckpt"
    make_checkpoint(src, stage=3, dp=5, layers=1, hidden=8, vocab=12, heads=2, kv_heads=1)
    plan = build_plan(str(src))
    states = OptimizerStates(str(src / "global_step1"))
    listed = OptimizerStates(str(src / "global_step1"))
    for t in plan.tensors:
        (part,) = t.parts
        assert isinstance(part, StridedPieces)
        plain = dataclasses.replace(t, parts=[list(part)])  # the same tensor as a list of Pieces
        assert states.has_states(t) and listed.has_states(plain)
        for name in states.tensor_names:
            got, want = states.state_plan(t, name).parts[0], listed.state_plan(plain, name).parts[0]
            assert isinstance(got, StridedPieces) and list(got) == want
        for name in states.scalar_names:
            assert states.scalar(t, name) == listed.scalar(plain, name)
