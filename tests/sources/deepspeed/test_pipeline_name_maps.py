"""Pipeline name maps as data (sources/deepspeed/name_maps/*.json, --source-option name_map=FILE) and
the row-parallel bias sum, on synthetic names and slices (milliseconds, no engine)."""

import json

import pytest
import torch

from hf_ckpt_integrations.assemble import torch_tensor
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.mapped_files import MappedFiles
from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan, check_plan
from hf_ckpt_integrations.sources.deepspeed import name_map as nm


def _neox_layers(n):
    inner = ["input_layernorm.weight", "attention.query_key_value.weight", "attention.dense.bias",
             "mlp.dense_4h_to_h.weight"]
    layers = {0: ["word_embeddings.weight"], n + 3: ["norm.weight"], n + 4: ["final_linear.weight"]}
    layers.update({i + 2: list(inner) for i in range(n)})
    return layers


def test_gpt_neox_map_follows_the_reference_layer_numbering():
    """convert_neox_to_hf.py: layer 0 embed_in, layer i+2 block i, L+3 final norm, L+4 embed_out."""
    m = nm.builtin_map("gpt_neox")
    layers = _neox_layers(3)
    blocks = m.blocks(layers)
    assert blocks == {2: 0, 3: 1, 4: 2}

    def hf(layer, inner):
        e = m.lookup(layer, inner, blocks)
        return m.hf_name(e, layer, blocks), e.tp

    assert hf(0, "word_embeddings.weight") == ("gpt_neox.embed_in.weight", "0")
    assert hf(4, "attention.query_key_value.weight") == ("gpt_neox.layers.2.attention.query_key_value.weight", "0")
    assert hf(2, "attention.dense.weight") == ("gpt_neox.layers.0.attention.dense.weight", "1")
    assert hf(3, "mlp.dense_4h_to_h.weight") == ("gpt_neox.layers.1.mlp.dense_4h_to_h.weight", "1")
    assert hf(2, "mlp.linear2.weight") == ("gpt_neox.layers.0.mlp.dense_4h_to_h.weight", "1")
    assert hf(2, "attention.dense.bias") == ("gpt_neox.layers.0.attention.dense.bias", nm.ROW_BIAS)
    assert hf(2, "input_layernorm.weight")[1] == "replicated"
    assert hf(6, "norm.weight") == ("gpt_neox.final_layer_norm.weight", "replicated")
    assert hf(7, "final_linear.weight") == ("embed_out.weight", "0")
    assert m.lookup(2, "attention.rotary_emb.inv_freq", blocks).drop


def test_a_block_entry_on_a_layer_without_the_marker_is_refused():
    m = nm.builtin_map("gpt_neox")
    with pytest.raises(ValueError, match="holds no 'attention.query_key_value.weight'"):
        m.lookup(0, "input_layernorm.weight", m.blocks(_neox_layers(1)))


def test_a_user_map_renames_a_fork(tmp_path):
    """Seed 001's fork calls its layernorm weights 'scale'."""
    f = tmp_path / "map.json"
    f.write_text(json.dumps({"block_marker": "attention.query_key_value.weight", "tensors": [
        {"layer": "*layernorm.scale", "hf": "model.layers.{block}.norm.weight", "tp": "replicated"},
        {"layer": "attention.*", "hf": "x.{layer}", "tp": "0"}]}))
    m = nm.load_map(str(f))
    blocks = m.blocks({5: ["attention.query_key_value.weight", "input_layernorm.scale"]})
    e = m.lookup(5, "input_layernorm.scale", blocks)
    assert (m.hf_name(e, 5, blocks), e.tp) == ("model.layers.0.norm.weight", "replicated")
    assert m.hf_name(m.lookup(5, "attention.dense.weight", blocks), 5, blocks) == "x.5"
    assert m.lookup(5, "mlp.w1.weight", blocks) is None


@pytest.mark.parametrize("obj,why", [
    ([], "a JSON object with a 'tensors' list"),
    ({"tensors": [{"hf": "a"}]}, "needs a 'layer' pattern"),
    ({"tensors": [{"layer": "a"}]}, "needs an 'hf' name or a 'drop' reason"),
    ({"tensors": [{"layer": "a", "hf": "b", "tp": "2"}]}, "'tp' must be one of"),
    ({"tensors": [{"layer": "a", "hf": "b.{block}"}]}, "has no 'block_marker'"),
])
def test_a_bad_user_map_is_refused_with_the_reason(tmp_path, obj, why):
    f = tmp_path / "map.json"
    f.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=why):
        nm.load_map(str(f))


def test_native_names_split():
    assert nm.split_native("12.mlp.linear1.weight") == (12, "mlp.linear1.weight")
    with pytest.raises(ValueError, match="not a pipeline parameter name"):
        nm.split_native("tied_modules.embed.word_embeddings.weight")


def _bias_file(tmp_path, values):
    path = tmp_path / "b.bin"
    path.write_bytes(b"".join(torch.tensor(v, dtype=torch.float32).numpy().tobytes() for v in values))
    return str(path)


def test_a_summed_bias_is_the_sum_of_its_parts(tmp_path):
    path = _bias_file(tmp_path, [[1.0, 2.0, 3.0], [0.5, -2.0, 4.0]])
    t = TensorPlan("b", (3,), "F32", [[Piece(path, 0, 3, "F32")], [Piece(path, 12, 3, "F32")]],
                   part_shapes=[(3,), (3,)], reduce="sum")
    check_plan(ExportPlan("x", "src", None, [t]))
    assert not t.is_byte_copy
    with MappedFiles() as files:
        assert torch_tensor(t, files).tolist() == [1.5, 0.0, 7.0]


def test_a_sum_of_parts_of_another_shape_is_refused(tmp_path):
    path = _bias_file(tmp_path, [[1.0, 2.0, 3.0, 4.0]])
    t = TensorPlan("b", (2,), "F32", [[Piece(path, 0, 2, "F32")], [Piece(path, 8, 2, "F32")]],
                   part_shapes=[(2,), (1, 2)], reduce="sum")
    with pytest.raises(LayoutError, match="a reduce 'sum' of parts not all of its shape"):
        check_plan(ExportPlan("x", "src", None, [t]))
