"""The conversion layer (rules as data, run as plan data) on synthetic tensors: every operation checked
against numpy on an ``arange`` written to files, the reads counted, and bad rules refused when loaded."""

import json

import numpy as np
import pytest
import torch

from hf_ckpt_integrations.assemble import torch_tensor
from hf_ckpt_integrations.convert import RuleError, apply_rules, load_rules, parse_rules
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.mapped_files import MappedFiles
from hf_ckpt_integrations.plan import Piece, TensorPlan


def _write(tmp_path, name, array):
    path = tmp_path / name
    path.write_bytes(np.ascontiguousarray(array, dtype=np.float32).tobytes())
    return str(path)


def _plan(tmp_path, name, array):
    return TensorPlan(name, tuple(array.shape), "F32", [[Piece(_write(tmp_path, name, array), 0, array.size, "F32")]])


def _values(t, files):
    return torch_tensor(t, files).numpy()


def _read(t):
    return sum(p.numel for part in t.parts for p in part)


# The worked example of docs/conversions.md: a Megatron-style GQA model, stacked layers, TP 2.
L, G, HPG, D, H, FFN, VOCAB, PADDED = 3, 2, 2, 2, 4, 6, 7, 8
RULES = {
    "format": 1, "engine": "example", "family": "llama", "reference": "docs/conversions.md",
    "params": ["groups", "q_rows", "kv_rows", "tp", "ffn_per_rank", "vocab_size"],
    "rules": [
        {"match": r"embedding\.word_embeddings\.weight", "to": "model.embed_tokens.weight", "tp": "vocab"},
        {"match": r"decoder\.layers\.self_attention\.linear_qkv\.weight", "tp": "1", "unstack": "layer",
         "split": {"dim": 0, "groups": "{groups}", "sizes": ["{q_rows}", "{kv_rows}", "{kv_rows}"]},
         "to": ["model.layers.{layer}.self_attn.q_proj.weight", "model.layers.{layer}.self_attn.k_proj.weight",
                "model.layers.{layer}.self_attn.v_proj.weight"]},
        {"match": r"decoder\.layers\.(?P<i>\d+)\.mlp\.linear_fc1\.weight", "tp": "0",
         "split": {"dim": 0, "groups": "{tp}", "sizes": ["{ffn_per_rank}", "{ffn_per_rank}"]},
         "to": ["model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"]},
        {"match": r"decoder\.layers\.(?P<i>\d+)\.self_attention\.linear_proj\.bias", "tp": "sum",
         "to": "model.layers.{i}.self_attn.o_proj.bias"},
        {"match": r"decoder\.layers\.(?P<i>\d+)\.input_layernorm\.weight", "tp": "replicated",
         "to": "model.layers.{i}.input_layernorm.weight"},
        {"match": r".*\._extra_state", "drop": "Transformer Engine's FP8 state, not a weight"},
    ],
}
PARAMS = {"groups": G, "q_rows": HPG * D, "kv_rows": D, "tp": 2, "ffn_per_rank": FFN // 2, "vocab_size": VOCAB}


def _megatron(tmp_path):
    """The source tensors as each of 2 TP ranks holds them, and the full tensors they come from."""
    rng = np.random.default_rng(0)
    per_group = (HPG + 2) * D
    qkv = rng.standard_normal((L, G * per_group, H)).astype(np.float32)  # per group: q heads, k, v
    fc1 = [rng.standard_normal((2 * FFN, H)).astype(np.float32) for _ in range(L)]  # [gate; up], TP-split per half
    emb = rng.standard_normal((PADDED, H)).astype(np.float32)
    bias = [rng.standard_normal(H).astype(np.float32) for _ in range(2)]
    norm = rng.standard_normal(H).astype(np.float32)
    half = G * per_group // 2
    tensors = {
        "embedding.word_embeddings.weight": [_plan(tmp_path, f"emb{r}", emb[r * 4:(r + 1) * 4]) for r in range(2)],
        "decoder.layers.self_attention.linear_qkv.weight": [_plan(tmp_path, f"qkv{r}", qkv[:, r * half:(r + 1) * half])
                                                            for r in range(2)],
        "decoder.layers.0.self_attention.linear_proj.bias": [_plan(tmp_path, f"bias{r}", bias[r]) for r in range(2)],
        "decoder.layers.0.input_layernorm.weight": [_plan(tmp_path, f"norm{r}", norm) for r in range(2)],
        "decoder.layers.0.self_attention.core_attention._extra_state": _plan(tmp_path, "extra", np.zeros(1)),
    }
    for i in range(L):
        # Megatron's fc1 on TP rank r: [gate rows of r; up rows of r]
        tensors[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = [
            _plan(tmp_path, f"fc1-{i}-{r}", np.concatenate([fc1[i][r * 3:(r + 1) * 3], fc1[i][FFN + r * 3:FFN + (r + 1) * 3]]))
            for r in range(2)]
    return tensors, qkv, fc1, emb, bias, norm


def test_worked_example_equals_numpy(tmp_path):
    tensors, qkv, fc1, emb, bias, norm = _megatron(tmp_path)
    rules = parse_rules(RULES, "example.json")
    done = apply_rules(rules, tensors, PARAMS)
    by = {t.name: t for t in done.tensors}
    assert done.dropped == {"decoder.layers.0.self_attention.core_attention._extra_state":
                            "Transformer Engine's FP8 state, not a weight"}
    per_group = (HPG + 2) * D
    with MappedFiles() as files:
        assert np.array_equal(_values(by["model.embed_tokens.weight"], files), emb[:VOCAB])
        for i in range(L):
            groups = qkv[i].reshape(G, per_group, H)
            want = {"q": groups[:, :HPG * D], "k": groups[:, HPG * D:(HPG + 1) * D], "v": groups[:, (HPG + 1) * D:]}
            for k, w in want.items():
                t = by[f"model.layers.{i}.self_attn.{k}_proj.weight"]
                assert np.array_equal(_values(t, files), w.reshape(-1, H)), (i, k)
                assert _read(t) == w.size  # layer i's rows only: never the stacked tensor assembled
            assert np.array_equal(_values(by[f"model.layers.{i}.mlp.gate_proj.weight"], files), fc1[i][:FFN])
            assert np.array_equal(_values(by[f"model.layers.{i}.mlp.up_proj.weight"], files), fc1[i][FFN:])
            assert by[f"model.layers.{i}.mlp.gate_proj.weight"].is_byte_copy  # each rank's gate rows, in rank order
        assert np.array_equal(_values(by["model.layers.0.self_attn.o_proj.bias"], files), bias[0] + bias[1])
        t = by["model.layers.0.input_layernorm.weight"]
        assert t.replicas and np.array_equal(_values(t, files), norm)
    assert {c["source"] for c in done.conversions} >= {"decoder.layers.self_attention.linear_qkv.weight"}


def test_interleaved_split_of_tp_rank_halves(tmp_path):
    """fc1 at TP 2: each rank holds [gate_r; up_r]; an interleaved split (groups = TP size) gives gate and up."""
    tensors, _, fc1, *_ = _megatron(tmp_path)
    rules = parse_rules({"params": ["half"], "rules": [
        {"match": r"decoder\.layers\.(?P<i>\d+)\.mlp\.linear_fc1\.weight", "tp": "0",
         "split": {"dim": 0, "groups": 2, "sizes": ["{half}", "{half}"]},
         "to": ["gate.{i}", "up.{i}"]}], "unmatched": "keep"}, "fc1.json")
    only = {k: v for k, v in tensors.items() if "linear_fc1" in k}
    done = apply_rules(rules, only, {"half": FFN // 2})
    by = {t.name: t for t in done.tensors}
    with MappedFiles() as files:
        for i in range(L):
            assert np.array_equal(_values(by[f"gate.{i}"], files), fc1[i][:FFN])
            assert np.array_equal(_values(by[f"up.{i}"], files), fc1[i][FFN:])


def test_concat_and_transpose(tmp_path):
    rng = np.random.default_rng(1)
    w1, w3, conv = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4), (3, 4), (2, 3, 4)))
    tensors = {"e.w1.0": _plan(tmp_path, "w1", w1), "e.w3.0": _plan(tmp_path, "w3", w3),
               "conv": _plan(tmp_path, "conv", conv)}
    rules = parse_rules({"rules": [
        {"match": r"e\.w1\.(?P<e>\d+)", "concat": {"dim": 0, "with": ["e.w3.{e}"]}, "to": "experts.{e}.gate_up"},
        {"match": "conv", "transpose": [2, 0, 1], "to": "conv_t"}]}, "t.json")
    done = apply_rules(rules, tensors, {})
    by = {t.name: t for t in done.tensors}
    assert set(by) == {"experts.0.gate_up", "conv_t"}
    assert by["experts.0.gate_up"].is_byte_copy  # a dim-0 concat is the pieces end to end
    with MappedFiles() as files:
        assert np.array_equal(_values(by["experts.0.gate_up"], files), np.concatenate([w1, w3]))
        assert np.array_equal(_values(by["conv_t"], files), conv.transpose(2, 0, 1))


def test_unmatched_and_twice_written_names_are_refused(tmp_path):
    tensors = {"a": _plan(tmp_path, "a", np.zeros(2)), "b": _plan(tmp_path, "b", np.zeros(2))}
    with pytest.raises(LayoutError, match="b: no rule of r.json matches it"):
        apply_rules(parse_rules({"rules": [{"match": "a", "to": "x"}]}, "r.json"), tensors)
    with pytest.raises(LayoutError, match="x: written twice"):
        apply_rules(parse_rules({"rules": [{"match": "[ab]", "to": "x"}]}, "r.json"), tensors)
    with pytest.raises(LayoutError, match="splits dim 0 of \\[2\\] into 1 x \\[1, 2\\]"):
        apply_rules(parse_rules({"rules": [{"match": "[ab]", "split": {"dim": 0, "sizes": [1, 2]},
                                            "to": ["x{n}", "y"]}], "params": ["n"]}, "r.json"), tensors, {"n": 1})


@pytest.mark.parametrize("rule, message", [
    ({"to": "x"}, r"rules\[0\]: needs a 'match' regex"),
    ({"match": "(", "to": "x"}, r"rules\[0\] \(match '\('\): 'match' is not a regex"),
    ({"match": "a"}, r"needs 'to' \(the output name\) or 'drop'"),
    ({"match": "a", "to": "x", "tp": "2"}, r"'tp' must be one of"),
    ({"match": "a", "to": "x", "tp": "vocab"}, r"needs the param 'vocab_size'"),
    ({"match": "a", "to": ["x", "y"]}, r"2 'to' names without a 'split'"),
    ({"match": "a", "to": ["x"], "split": {"dim": 0, "sizes": [1, 1]}}, r"a split into 2 parts needs 2 'to' names"),
    ({"match": "a", "to": ["x", "y"], "split": {"dim": 0, "sizes": [1, "{n}"]}}, r"'\{param\}' of a declared param"),
    ({"match": "a", "to": "x.{layer}"}, r"uses \['layer'\], which neither"),
    ({"match": "a", "to": "x", "transpose": [0, 0]}, r"'transpose' is a permutation"),
    ({"match": "a", "to": "x", "drop": "why"}, r"'drop' is the reason"),
    ({"match": "a", "to": "x", "rename": "y"}, r"unknown keys \['rename'\]"),
    ({"match": "a", "to": "x{0}"}, r"braces other than"),
    ({"match": "a", "to": "x.{layer}", "unstack": ["layer", "layer"]}, r"'unstack' names the variable"),
    ({"match": "a", "to": "x.{layer}", "unstack": []}, r"'unstack' names the variable"),
])
def test_bad_rule_fails_at_load_naming_file_and_rule(tmp_path, rule, message):
    path = tmp_path / "family.json"
    path.write_text(json.dumps({"rules": [rule]}))
    with pytest.raises(RuleError, match=f"^{path}: .*{message}") as e:
        load_rules(str(path))
    assert "\n" not in str(e.value)


def test_worked_example_file_loads():
    rules = parse_rules(RULES, "example.json")
    assert [r.index for r in rules.rules] == list(range(len(RULES["rules"])))
    assert rules.find("decoder.layers.7.mlp.linear_fc1.weight")[1] == {"i": "7"}


def test_row_split_keeps_replica_checks_and_column_split_is_a_box(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    tensors = {"w": [_plan(tmp_path, f"w{r}", w) for r in range(2)], "c": _plan(tmp_path, "c", w)}
    rules = parse_rules({"rules": [
        {"match": "w", "tp": "replicated", "split": {"dim": 0, "sizes": [1, 3]}, "to": ["w_a", "w_b"]},
        {"match": "c", "split": {"dim": 1, "sizes": [2, 1]}, "to": ["c_a", "c_b"]}]}, "s.json")
    by = {t.name: t for t in apply_rules(rules, tensors).tensors}
    # A run of rows: the same rows of every replica are checked (the split keeps the TP replica check).
    assert by["w_b"].replicas == [[Piece(str(tmp_path / "w1"), 12, 9, "F32")]]
    with MappedFiles() as files:
        assert np.array_equal(_values(by["w_b"], files), w[1:])
        assert np.array_equal(_values(by["c_a"], files), w[:, :2])
        assert np.array_equal(_values(by["c_b"], files), w[:, 2:])


def test_vocab_on_a_tensor_given_whole_keeps_the_first_rows_as_a_byte_copy(tmp_path):
    # A source that places its TP slices itself (Megatron's global tensors) gives the padded tensor whole:
    # 'tp': 'vocab' still drops the padding, as a box of its bytes (nothing assembled).
    w = np.arange(24, dtype=np.float32).reshape(8, 3)  # 5 real rows padded to 8
    rules = parse_rules({"params": ["vocab_size"],
                         "rules": [{"match": "emb", "tp": "vocab", "to": "model.embed_tokens.weight"}]}, "v.json")
    (out,) = apply_rules(rules, {"emb": _plan(tmp_path, "emb", w)}, {"vocab_size": 5}).tensors
    assert out.shape == (5, 3) and out.is_byte_copy and _read(out) == 15
    with MappedFiles() as files:
        assert np.array_equal(_values(out, files), w[:5])


def test_unstack_of_two_leading_axes_is_a_box_per_index_pair(tmp_path):
    # Megatron's experts: [layers, experts, 2F, H] stacked, [gate; up] per expert -> one (layer, expert) box each
    w = np.arange(2 * 3 * 4 * 2, dtype=np.float32).reshape(2, 3, 4, 2)
    rules = parse_rules({"rules": [
        {"match": "fc1", "unstack": ["layer", "expert"], "split": {"dim": 0, "sizes": [2, 2]},
         "to": ["l{layer}.e{expert}.w1", "l{layer}.e{expert}.w3"]}]}, "moe.json")
    done = apply_rules(rules, {"fc1": _plan(tmp_path, "fc1", w)})
    by = {t.name: t for t in done.tensors}
    assert len(by) == 2 * 3 * 2 and done.conversions[0]["op"] == "unstack layer, expert, split dim 0"
    with MappedFiles() as files:
        for layer in range(2):
            for expert in range(3):
                gate = by[f"l{layer}.e{expert}.w1"]
                assert np.array_equal(_values(gate, files), w[layer, expert, :2])
                assert np.array_equal(_values(by[f"l{layer}.e{expert}.w3"], files), w[layer, expert, 2:])
                assert _read(gate) == 4 and gate.is_byte_copy  # that expert's gate rows only
