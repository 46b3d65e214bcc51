"""A live model's plan is an ExportPlan closed by the passes every plan gets (output dtype by the
one rule, then ``check_plan``), and the writer hands each live read the decided output dtype."""

import pytest
import torch

from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.integrations._dist import write_distributed
from hf_ckpt_integrations.plan import ExportPlan
from hf_ckpt_integrations.sources.live import live_tensors
from helpers import load_safetensors


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Embedding(5, 4))
    m.register_buffer("steps", torch.arange(3))  # an integer tensor: never cast
    return m


def test_a_live_plan_has_its_dtypes_decided_by_the_one_rule(tmp_path):
    plan = live_tensors(_model(), dtype="bf16")
    assert isinstance(plan, ExportPlan)
    assert {t.name: t.out_dtype for t in plan.tensors} == {"0.weight": "BF16", "0.bias": "BF16", "1.weight": "BF16",
                                                          "steps": "I64"}
    assert {t.name: t.src_dtype for t in plan.tensors}["0.weight"] == "F32"  # what the model holds
    write_distributed(plan, tmp_path / "out")
    got = load_safetensors(tmp_path / "out" / "model.safetensors")
    for name, t in _model().state_dict().items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_a_live_plan_is_checked_before_anything_is_read():
    """check_plan runs on live plans too: a tensor safetensors cannot store under its name is refused
    while planning (here the name safetensors reserves for its metadata)."""
    m = _model()
    m.register_parameter("__metadata__", torch.nn.Parameter(torch.zeros(2)))
    with pytest.raises(LayoutError, match="not a valid tensor name for safetensors"):
        live_tensors(m)
