"""Tensor-parallel merge rules and the merge itself on synthetic data (no engine)."""

import pytest
import torch

from hf_ckpt_integrations.assemble import check_replicas, torch_tensor
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.plan import Piece, TensorPlan
from hf_ckpt_integrations.mapped_files import MappedFiles
from hf_ckpt_integrations.convert import tp_rules

INFO = {  # the shape of what DeepSpeed AutoTP records
    "tp_replicated_parameter_patterns": [r"^model\.norm\.weight$"],
    "parameter_with_row_parallelism_patterns": [r"^model\.layers\.\d+\.self_attn\.o_proj\.weight$"],
    "vocabulary_parameter_patterns": [r"^lm_head\.weight$"],
    "original_vocab_size": 1001,
}


def test_rules_from_universal_info():
    r = tp_rules.rule_from_universal_info
    assert r("model.norm.weight", INFO).replicated
    assert r("model.layers.3.self_attn.o_proj.weight", INFO).dim == 1
    assert r("lm_head.weight", INFO) == tp_rules.Rule(0, "universal_checkpoint_info", 1001)
    assert r("model.layers.3.self_attn.q_proj.weight", INFO).dim == 0  # DeepSpeed's default


def test_rules_from_hf_plan():
    plans = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
             "model.embed_tokens": "rowwise", "lm_head": "colwise_gather_output"}
    r = tp_rules.rule_from_hf_plan
    assert r("model.layers.0.self_attn.q_proj.weight", plans).dim == 0
    assert r("model.layers.0.self_attn.q_proj.bias", plans).dim == 0
    assert r("model.layers.11.self_attn.o_proj.weight", plans).dim == 1
    assert r("model.layers.11.self_attn.o_proj.bias", plans).replicated  # row-parallel bias is replicated
    assert r("model.embed_tokens.weight", plans, embeddings=["model.embed_tokens"]).dim == 0
    assert r("lm_head.weight", plans).dim == 0
    assert r("model.norm.weight", plans) is None
    assert r("model.layers.0.self_attn.q_proj_extra.weight", plans) is None  # '*' is one component only


def test_user_rules_parse_and_match():
    rules = [tp_rules.parse_user_rule(t) for t in ("*.embed_tokens.weight=0", "model.norm.*=replicated")]
    assert tp_rules.rule_from_user("model.embed_tokens.weight", rules).dim == 0
    assert tp_rules.rule_from_user("model.norm.weight", rules).replicated
    assert tp_rules.rule_from_user("lm_head.weight", rules) is None
    for bad in ("nodim", "x=2", "=0", "x=rows"):
        with pytest.raises(ValueError, match="--tp-rule"):
            tp_rules.parse_user_rule(bad)


def test_concat_shape():
    assert tp_rules.concat_shape([(501, 64), (500, 64)], 0) == (1001, 64)
    assert tp_rules.concat_shape([(64, 32), (64, 32)], 1) == (64, 64)
    with pytest.raises(ValueError):
        tp_rules.concat_shape([(64, 32), (32, 32)], 1)


def _file(tmp_path, tensors):
    """Write tensors back to back as raw fp32 and return a Piece for each."""
    path = tmp_path / "raw.bin"
    pieces, offset = [], 0
    with open(path, "wb") as fh:
        for t in tensors:
            data = t.contiguous().view(-1).numpy().tobytes()
            fh.write(data)
            pieces.append(Piece(str(path), offset, t.numel(), "F32"))
            offset += len(data)
    return pieces


def test_merge_dim1_and_unpad_rows(tmp_path):
    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    a, b = full[:, :4], full[:, 4:]
    padded = torch.cat([full, torch.zeros(2, 8)])  # vocabulary padded from 6 to 8 rows
    p = _file(tmp_path, [a, b, padded[:4], padded[4:]])
    with MappedFiles() as files:
        t = TensorPlan("w", (6, 8), "F32", [[p[0]], [p[1]]], cat_dim=1, part_shapes=[(6, 4), (6, 4)])
        assert torch.equal(torch_tensor(t, files), full)
        v = TensorPlan("vocab", (6, 8), "F32", [[p[2]], [p[3]]], cat_dim=0, part_shapes=[(4, 8), (4, 8)], keep_rows=6)
        assert torch.equal(torch_tensor(v, files), full)


def test_replica_check_names_the_differing_copy(tmp_path):
    x = torch.randn(10)
    y = x.clone()
    y[3] += 1
    p = _file(tmp_path, [x, x, y])
    with MappedFiles() as files:
        check_replicas(TensorPlan("n", (10,), "F32", [[p[0]]], replicas=[[p[1]]]), files)
        with pytest.raises(LayoutError, match="its copy of n differs"):
            check_replicas(TensorPlan("n", (10,), "F32", [[p[0]]], replicas=[[p[1]], [p[2]]]), files)
