"""How a pipeline save's TP slices merge into a universal checkpoint, on synthetic slices
(milliseconds, no engine): a row-parallel bias is the parameter each TP rank holds (one copy, the
others checked) where the HF export of a parallel-residual model sums it."""

import torch

from hf_ckpt_integrations.plan import Piece, TensorPlan
from hf_ckpt_integrations.sources.deepspeed import name_map as nm
from hf_ckpt_integrations.sources.deepspeed import pipeline_tp


def _slices(tmp_path):
    path = tmp_path / "b.bin"
    path.write_bytes(torch.tensor([1.0, 2.0, 3.0, 1.0, 2.0, 3.0]).numpy().tobytes())
    return [TensorPlan("2.attention.dense.bias", (3,), "F32", [[Piece(str(path), 12 * r, 3, "F32")]])
            for r in range(2)]


def test_a_row_bias_is_summed_for_hf_and_kept_per_rank_for_universal(tmp_path):
    m = nm.builtin_map("gpt_neox")
    args = ("gpt_neox.layers.0.attention.dense.bias", "2.attention.dense.bias", _slices(tmp_path))
    hf = pipeline_tp.merge_slices(*args, nm.ROW_BIAS, True, None, [], m)
    assert hf.reduce == "sum" and len(hf.parts) == 2
    uc = pipeline_tp.merge_slices(*args, pipeline_tp.UNIVERSAL_ROW_BIAS, True, None, [], m)
    assert uc.reduce is None and len(uc.parts) == 1 and len(uc.replicas) == 1 and uc.shape == (3,)
    assert "universal checkpoint: one copy" in uc.rule
