"""The Hub-layout rule on synthetic inputs (no engine): transformers' own ``revert_weight_conversion``
read as element ranges, the plan transforms that serve them, and the refusals."""

import pytest
import torch

from hf_ckpt_integrations.assemble import torch_tensor
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.plan import Piece, TensorPlan, narrow_pieces
from hf_ckpt_integrations.mapped_files import MappedFiles
from hf_ckpt_integrations.convert.hub_layout import hub_layout, meta_model

transformers = pytest.importorskip("transformers")
core = pytest.importorskip("transformers.core_model_loading")
if not hasattr(core, "revert_weight_conversion"):
    pytest.skip("transformers 4.x: no save-time conversion (the identity)", allow_module_level=True)


def _tiny(family):
    from families import config  # tests/engines (conftest puts it on sys.path)

    return config(family)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "llava"])
def test_ranges_equal_transformers_own_revert_on_real_tensors(family):
    """Each output = elements [offset, offset + n) of its source, exactly what revert_weight_conversion
    returns for real tensors (no views, no mode)."""
    from families import model_class

    torch.manual_seed(0)
    model = model_class(family)(_tiny(family))
    state = model.state_dict()
    layout = hub_layout({n: tuple(t.shape) for n, t in state.items()}, meta_model(model.config))
    want = core.revert_weight_conversion(model, dict(state))
    assert [h.name for h in layout] == list(want)  # save_pretrained's names, in its order
    for h in layout:
        n = want[h.name].numel()
        got = state[h.source].reshape(-1)[h.offset:h.offset + n].view(h.shape)
        assert torch.equal(got, want[h.name]), h.name


def test_no_conversion_is_none():
    model = meta_model(_tiny("llama"))
    assert hub_layout({n: tuple(t.shape) for n, t in model.state_dict().items()}, model) is None


def _with_conversion(converter):
    model = meta_model(_tiny("llama"))
    model._weight_conversions = [converter]  # as from_pretrained attaches them; save_pretrained reverts these
    return model, {n: tuple(t.shape) for n, t in model.state_dict().items()}


def test_transpose_is_refused_naming_tensor_and_model_type():
    model, shapes = _with_conversion(core.WeightConverter("mlp.down_proj.weight", "mlp.down_proj.weight",
                                                          operations=[core.Transpose(0, 1)]))
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: .*model type 'llama'.*strides"):
        hub_layout(shapes, model)


def test_concatenation_of_several_tensors_is_refused():
    # In memory q and k separate, on the Hub one fused tensor: a concatenation, not a slice.
    model, shapes = _with_conversion(core.WeightConverter("self_attn.qk.weight", ["self_attn.q_proj.weight",
                                                                                  "self_attn.k_proj.weight"],
                                                          operations=[core.Chunk(0)]))
    with pytest.raises(LayoutError, match=r"self_attn\.qk\.weight: .*'llama'.*new tensor"):
        hub_layout(shapes, model)


def test_narrow_pieces_crosses_piece_boundaries():
    pieces = [Piece("a", 0, 5, "F32"), Piece("b", 100, 3, "BF16"), Piece("c", 8, 4, "F32")]
    assert narrow_pieces(pieces, 3, 6) == [Piece("a", 12, 2, "F32"), Piece("b", 100, 3, "BF16"),
                                           Piece("c", 8, 1, "F32")]
    assert narrow_pieces(pieces, 5, 3) == [Piece("b", 100, 3, "BF16")]
    with pytest.raises(ValueError):
        narrow_pieces(pieces, 10, 3)


def _file(tmp_path, name, tensor):
    path = tmp_path / name
    path.write_bytes(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return str(path)


def test_narrowed_byte_copy_stays_pieces_and_merged_tensor_selects_a_box(tmp_path):
    fused = torch.randn(3, 4, 2)  # [E, 2I, H]
    a, b = _file(tmp_path, "a", fused[:2]), _file(tmp_path, "b", fused[2:])  # two ZeRO partitions
    plain = TensorPlan("fused", (3, 4, 2), "F32", [[Piece(a, 0, 16, "F32"), Piece(b, 0, 8, "F32")]])
    # expert 1, up half: elements [1*8 + 4, 1*8 + 8)
    up1 = plain.narrowed("experts.1.up", (2, 2), 12)
    assert up1.is_byte_copy and up1.parts == [[Piece(a, 48, 4, "F32")]] and up1.hub_source == "fused"
    # A tensor-parallel merge along dim 1 (two slices [3, 2, 2]): each half of an expert is a box inside one
    # slice, so it is that slice's bytes alone (never the merged tensor assembled, then cut).
    left, right = _file(tmp_path, "l", fused[:, :2]), _file(tmp_path, "r", fused[:, 2:])
    merged = TensorPlan("fused", (3, 4, 2), "F32", [[Piece(left, 0, 12, "F32")], [Piece(right, 0, 12, "F32")]],
                        cat_dim=1, part_shapes=[(3, 2, 2), (3, 2, 2)])
    with MappedFiles() as files:
        for e in range(3):
            for half in range(2):
                t = merged.narrowed(f"experts.{e}.{half}", (2, 2), e * 8 + half * 4)
                assert t.elem_range is None and t.is_byte_copy
                assert t.flat_pieces() == [Piece((left, right)[half], e * 16, 4, "F32")]
                assert torch.equal(torch_tensor(t, files), fused[e, 2 * half:2 * half + 2])
        whole = merged.narrowed("e1", (4, 2), 8)  # both slices' rows of expert 1: two chunks, 8 elements read
        assert whole.elem_range is None and sum(p.numel for part in whole.parts for p in part) == 8
        assert torch.equal(torch_tensor(whole, files), fused[1])
        assert torch.equal(torch_tensor(plain.narrowed("e2", (4, 2), 16), files), fused[2])
        # Not a box (half of one row and half of the next): the element range of the merged tensor, as before.
        odd = merged.narrowed("odd", (2,), 1)
        assert odd.elem_range == (1, 3) and torch.equal(torch_tensor(odd, files), fused.reshape(-1)[1:3])


def test_live_tensors_of_a_plain_moe_model_equal_save_pretrained(tmp_path):
    from families import model_class
    from safetensors.torch import load_file

    from hf_ckpt_integrations.integrations._dist import write_distributed
    from hf_ckpt_integrations.sources.live import live_tensors

    torch.manual_seed(0)
    model = model_class("mixtral")(_tiny("mixtral"))
    model.save_pretrained(tmp_path / "ref")
    write_distributed(live_tensors(model), tmp_path / "out")
    want, got = load_file(tmp_path / "ref" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in got


def test_tied_group_is_written_under_the_name_save_pretrained_keeps():
    from hf_ckpt_integrations.convert.hub_layout import tied_renames

    model = meta_model(_tiny("gpt2"))
    # An engine that recorded the head first (lm_head stored, wte its alias): save_pretrained keeps wte.
    assert tied_renames(model, {"transformer.wte.weight": "lm_head.weight"}) == {
        "lm_head.weight": "transformer.wte.weight"}
    assert tied_renames(model, {"lm_head.weight": "transformer.wte.weight"}) == {}
