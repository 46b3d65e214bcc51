"""How a pipeline save's TP slices merge into a universal checkpoint, on synthetic slices
(milliseconds, no engine): a row-parallel bias is the parameter each TP rank holds (one copy, the
others checked) where the HF export of a parallel-residual model sums it."""

import torch

from hf_ckpt_integrations.convert import apply_rules
from hf_ckpt_integrations.plan import Piece, TensorPlan
from hf_ckpt_integrations.sources.deepspeed.pipeline_rules import builtin_rules, universal_tp_rules


def _slices(tmp_path):
    path = tmp_path / "b.bin"
    path.write_bytes(torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 3.0]).numpy().tobytes())
    return [TensorPlan("2.attention.dense.bias", (3,), "F32", [[Piece(str(path), 12 * r, 3, "F32")]])
            for r in range(2)]


def test_a_row_bias_is_summed_for_hf_and_kept_per_rank_for_universal(tmp_path):
    rules = builtin_rules("gpt_neox")
    names = ["2.attention.query_key_value.weight", "2.attention.dense.bias"]
    qkv = [TensorPlan(names[0], (3,), "F32", s.parts) for s in _slices(tmp_path)]
    tensors = {names[0]: qkv, names[1]: _slices(tmp_path)}
    _, hf = apply_rules(rules, tensors, {"parallel_residual": True}).tensors
    assert hf.reduce == "sum" and len(hf.parts) == 2 and hf.name == "gpt_neox.layers.0.attention.dense.bias"
    overrides = universal_tp_rules(rules, names)
    _, uc = apply_rules(rules, tensors, {"parallel_residual": True}, overrides).tensors
    assert uc.reduce is None and len(uc.parts) == 1 and len(uc.replicas) == 1 and uc.shape == (3,)
    assert "universal checkpoint: one copy" in uc.rule
