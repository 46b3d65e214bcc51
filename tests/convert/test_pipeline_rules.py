"""The rules moved into the conversion layer from the DeepSpeed sources, on synthetic tensors
(milliseconds, no engine): the GPT-NeoX pipeline rules file with its numbered ``{block}``, the
row-parallel bias (``tp: row_bias``), a TP rule the source overrides the file's with, and the one TP
merge (:func:`convert.tp_rules.merge_slices`) every source's slices go through."""

import json

import numpy as np
import pytest

from hf_ckpt_integrations.assemble import torch_tensor
from hf_ckpt_integrations.convert import RuleError, apply_rules, load_rules, parse_rules, target_names
from hf_ckpt_integrations.convert.tp_rules import Rule, merge_slices
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.mapped_files import MappedFiles
from hf_ckpt_integrations.plan import Piece, TensorPlan
from hf_ckpt_integrations.sources.deepspeed.pipeline_rules import builtin_rules, builtin_types

INNER = ["input_layernorm.weight", "attention.query_key_value.weight", "attention.dense.bias", "mlp.linear2.weight",
         "attention.rotary_emb.inv_freq"]


def _neox_names(n):
    """A GPT-NeoX PipelineModule's names (convert_neox_to_hf.py's numbering): layer 0 the embedding,
    layers 2..n+1 the blocks, n+3 the final norm, n+4 the output layer."""
    names = ["0.word_embeddings.weight"] + [f"{i + 2}.{x}" for i in range(n) for x in INNER]
    return names + [f"{n + 3}.norm.weight", f"{n + 4}.final_linear.weight"]


def _slices(tmp_path, name, array, tp):
    """``array`` cut in ``tp`` slices along dim 0 (each its own file), or held whole by every rank (tp
    negative: -tp replicas)."""
    path = tmp_path / name.replace("/", "_")
    parts = [array] * -tp if tp < 0 else np.split(array, tp)
    path.write_bytes(b"".join(np.ascontiguousarray(p, dtype=np.float32).tobytes() for p in parts))
    out, at = [], 0
    for p in parts:
        out.append(TensorPlan(name, tuple(p.shape), "F32", [[Piece(str(path), at * 4, p.size, "F32")]]))
        at += p.size
    return out


def _one(name):
    return [TensorPlan(name, (2,), "F32", [[Piece("/nowhere", 0, 2, "F32")]])]


def test_gpt_neox_rules_follow_the_reference_layer_numbering():
    rules = builtin_rules("gpt_neox")
    assert builtin_types() == ["gpt_neox"]
    names = _neox_names(3)
    done = apply_rules(rules, {n: _one(n) for n in names}, {"parallel_residual": None})
    got = {t.name for t in done.tensors}
    assert {"gpt_neox.embed_in.weight", "gpt_neox.final_layer_norm.weight", "embed_out.weight"} <= got
    assert {f"gpt_neox.layers.{b}.attention.query_key_value.weight" for b in range(3)} <= got
    assert "gpt_neox.layers.0.mlp.dense_4h_to_h.weight" in got  # mlp.linear2 is dense_4h_to_h
    assert not any("inv_freq" in n for n in got)
    assert sorted(done.dropped) == [f"{i}.attention.rotary_emb.inv_freq" for i in (2, 3, 4)]
    assert target_names(rules, names)["4.attention.dense.bias"] == "gpt_neox.layers.2.attention.dense.bias"
    tps = {r.match.pattern.split("\\.", 1)[1]: r.tp for r in rules.rules if r.drop is None}
    assert tps["attention\\.dense\\.weight"] == "1" and tps["attention\\.dense\\.bias"] == "row_bias"
    assert tps["input_layernorm\\.weight"] == "replicated" and tps["final_linear\\.weight"] == "0"


def test_a_block_rule_on_a_layer_without_the_marker_is_refused():
    names = _neox_names(1) + ["7.input_layernorm.weight"]
    with pytest.raises(LayoutError, match=r"7.input_layernorm.weight: .* names its block number, but no tensor "
                                          r"of the checkpoint matching .* has layer 7"):
        apply_rules(builtin_rules("gpt_neox"), {n: _one(n) for n in names}, {"parallel_residual": None})


def test_a_user_rules_file_renames_a_fork(tmp_path):
    """Seed 001's fork calls its layernorm weights 'scale'; numbered blocks, the layer index itself."""
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"number": {"block": {"group": "layer", "among": r"(?P<layer>\d+)\.attention\.qkv"}},
                             "rules": [{"match": r"(?P<layer>\d+)\..*layernorm\.scale", "tp": "replicated",
                                        "to": "model.layers.{block}.norm.weight"},
                                       {"match": r"(?P<layer>\d+)\.attention\..*", "to": "x.{layer}", "tp": "0"}]}))
    rules = load_rules(str(f))
    names = ["5.attention.qkv", "9.attention.qkv", "9.input_layernorm.scale"]
    assert target_names(rules, names) == {"5.attention.qkv": "x.5", "9.attention.qkv": "x.9",
                                          "9.input_layernorm.scale": "model.layers.1.norm.weight"}
    with pytest.raises(LayoutError, match="5.mlp.w1.weight: no rule of .* matches it"):
        apply_rules(rules, {n: _one(n) for n in names + ["5.mlp.w1.weight"]})


@pytest.mark.parametrize("number,why", [
    ([], r"'number' is \{'var'"),
    ({"block": {"group": "layer"}}, r"number\['block'\]: is \{'group'"),
    ({"block": {"group": "layer", "among": "(?P<layer>"}}, "'among' is not a regex"),
    ({"block": {"group": "layer", "among": r"\d+\.qkv"}}, "has no named group 'layer'"),
    ({"tp": {"group": "layer", "among": r"(?P<layer>\d+)"}}, "a numbered variable is an identifier that is not a param"),
])
def test_a_bad_numbering_is_refused_when_loaded(number, why):
    with pytest.raises(RuleError, match=f"^r.json: .*{why}"):
        parse_rules({"params": ["tp"], "number": number, "rules": []}, "r.json")


def test_a_numbered_variable_on_a_rule_without_its_group_is_refused_when_loaded():
    obj = {"number": {"block": {"group": "layer", "among": r"(?P<layer>\d+)\.qkv"}},
           "rules": [{"match": r"(?P<i>\d+)\.norm", "to": "layers.{block}.norm"}]}
    with pytest.raises(RuleError, match=r"rules\[0\] .* uses \['block'\]"):
        parse_rules(obj, "r.json")


def _bias_rules():
    return parse_rules({"params": ["parallel_residual"], "rules": [
        {"match": r"(?P<layer>\d+)\.attention\.dense\.bias", "to": "b{layer}", "tp": "row_bias"}]}, "r.json")


@pytest.mark.parametrize("residual,want", [(True, [2.0, 4.0, 6.0]), (False, [1.0, 2.0, 3.0])])
def test_a_row_bias_is_summed_under_the_parallel_residual_else_one_copy(tmp_path, residual, want):
    slices = _slices(tmp_path, "2.attention.dense.bias", np.array([1.0, 2.0, 3.0]), -2)
    (t,) = apply_rules(_bias_rules(), {"2.attention.dense.bias": slices}, {"parallel_residual": residual}).tensors
    assert t.name == "b2"
    assert (t.reduce, len(t.parts), len(t.replicas)) == (("sum", 2, 0) if residual else (None, 1, 1))
    with MappedFiles() as files:
        assert torch_tensor(t, files).tolist() == want


def test_a_tp_rule_the_source_gives_overrides_the_files(tmp_path):
    """A universal checkpoint keeps the row-parallel bias each rank holds (one copy), never the sum."""
    slices = _slices(tmp_path, "2.attention.dense.bias", np.array([1.0, 2.0, 3.0]), -2)
    one = Rule(None, "row_bias, universal checkpoint: one copy")
    (t,) = apply_rules(_bias_rules(), {"2.attention.dense.bias": slices}, {"parallel_residual": True},
                       {"2.attention.dense.bias": one}).tensors
    assert (t.reduce, len(t.parts), len(t.replicas), t.rule) == (None, 1, 1, one.source)


def test_the_one_tp_merge_concatenates_keeps_module_checks_and_drops_vocab_padding(tmp_path):
    full = np.arange(24, dtype=np.float32).reshape(6, 4)
    ss = _slices(tmp_path, "w", full, 2)
    mod = _slices(tmp_path, "m", full, 2)
    ss = [TensorPlan(s.name, s.shape, "F32", s.parts, module_check=(s.parts, m.parts)) for s, m in zip(ss, mod)]
    t = merge_slices("embed", ss, Rule(0, "recorded", keep_rows=5), "pass --tp-rule")
    assert (t.shape, t.cat_dim, t.keep_rows, t.rule) == ((5, 4), 0, 5, "recorded")
    assert t.module_check == ([s.parts[0] for s in ss], [m.parts[0] for m in mod])
    with MappedFiles() as files:
        assert (torch_tensor(t, files).numpy() == full[:5]).all()
    with pytest.raises(LayoutError, match=r"embed: merged as replicated \(r\), but its 2 TP slices hold shapes "
                                          r".*; pass --tp-rule"):
        merge_slices("embed", [ss[0], _slices(tmp_path, "v", full, 3)[0]], Rule(None, "r"), "pass --tp-rule")


def test_one_slice_given_whole_cuts_vocab_padding_in_the_same_merge_or_refuses(tmp_path):
    # The one TP merge also decides the padding of a tensor given whole (Megatron's global tensors):
    # its first keep_rows rows as a byte copy; a plan that already merges pieces is refused, never
    # written with its padding.
    full = np.arange(24, dtype=np.float32).reshape(6, 4)
    (whole,) = _slices(tmp_path, "w", full, 1)
    t = merge_slices("embed", [whole], Rule(0, "rules: tp vocab", keep_rows=5), "fix the rule")
    assert (t.shape, t.is_byte_copy, t.rule) == ((5, 4), True, "rules: tp vocab")
    with MappedFiles() as files:
        assert (torch_tensor(t, files).numpy() == full[:5]).all()
    assert merge_slices("embed", [whole], Rule(0, "r", keep_rows=6), "fix").shape == (6, 4)  # nothing to cut
    merged = merge_slices("w", _slices(tmp_path, "r", full, -2), Rule(None, "replicated"), "fix")
    assert merged.replicas
    with pytest.raises(LayoutError, match=r"embed: rules: tp vocab drops vocabulary padding to 5 rows, but the "
                                          r"tensor is already a merge of several pieces; fix the rule"):
        merge_slices("embed", [merged], Rule(0, "rules: tp vocab", keep_rows=5), "fix the rule")
