"""DeepSpeed layouts other than ZeRO's own optimizer, on synthetic metadata (milliseconds): no ZeRO
(stage 0, the module weights whole), BF16_Optimizer's padded partitions, tied names found by shared
storage, every name written without a config, and tensors a checkpoint does not hold. The same
layouts from real engine runs: tests/sources/deepspeed/test_deepspeed_configs.py."""

import pytest
import torch

from hf_ckpt_integrations import export_checkpoint, inspect_checkpoint, verify_checkpoint
from hf_ckpt_integrations.api import check_missing
from hf_ckpt_integrations.errors import CheckpointError
from hf_ckpt_integrations.formats.torch_files import StorageRef, TensorRef
from hf_ckpt_integrations.plan import ExportPlan
from hf_ckpt_integrations.sources.deepspeed import describe
from hf_ckpt_integrations.sources.deepspeed.bf16_optimizer import bf16_fragments, order_from_mappings
from hf_ckpt_integrations.sources.deepspeed.stage0 import optimizer_kind, tied_names
from helpers import export_refused, load_safetensors


# -- BF16_Optimizer arithmetic ------------------------------------------------------------------------

def test_bf16_partitions_keep_their_padding_on_the_last_rank():
    # 3 + 5 + 4 = 12 elements, aligned to 2*dp = 4 -> 12 (no padding) with dp 2: partitions of 6.
    assert bf16_fragments([3, 5, 4], 6, 2, 0) == [[(0, 0, 3)], [(0, 3, 3), (1, 0, 2)], [(1, 2, 4)]]
    # 3 + 5 = 8 elements over dp 3: aligned to 6*2 = 12, partitions of 4 each saved whole, 4 padding.
    assert bf16_fragments([3, 5], 4, 3, 4) == [[(0, 0, 3)], [(0, 3, 1), (1, 0, 4)]]
    # The padding may span ranks (a tiny group): nothing of a parameter lands in it.
    assert bf16_fragments([1], 2, 4, 7) == [[(0, 0, 1)]]


@pytest.mark.parametrize("numels, size, dp, pad", [([3, 5], 4, 3, 0), ([3, 5], 4, 2, 1), ([3], 2, 2, -1)])
def test_bf16_partitions_that_do_not_add_up_are_refused(numels, size, dp, pad):
    with pytest.raises(ValueError, match="partitions hold"):
        bf16_fragments(numels, size, dp, pad)


def test_flat_order_from_the_recorded_mappings():
    # rank 0 holds a (whole) and the start of b; rank 1 the rest of b and c; dict order is not trusted.
    recs = [{"b": (1, 3), "a": (3, 0)}, {"c": (4, 2), "b": (2, 0)}]
    assert order_from_mappings(recs) == ["a", "b", "c"]


# -- stage 0: what the files record ------------------------------------------------------------------

def _ref(key, offset=0, shape=(2, 3), dtype="F32"):
    return TensorRef(StorageRef("/x/mp_rank_00_model_states.pt", key, dtype, 64, 0), offset, shape,
                     (shape[1], 1) if len(shape) == 2 else (1,))


def test_tied_names_are_views_of_one_storage():
    module = {"embed.weight": _ref("0"), "block.weight": _ref("1"), "head.weight": _ref("0"),
              "other.weight": _ref("0", offset=6)}
    assert tied_names(module) == {"head.weight": "embed.weight"}


@pytest.mark.parametrize("opt, kind", [(None, "none"), ({"state": {}, "param_groups": []}, "torch optimizer"),
                                       ({"fp32_groups": []}, "FP16_UnfusedOptimizer"),
                                       ({"fp32_groups_flat": []}, "FP16_Optimizer"),
                                       ({"single_partition_of_fp32_groups": []}, "BF16_Optimizer")])
def test_stage0_optimizer_named_from_its_recorded_keys(opt, kind):
    assert optimizer_kind({"optimizer": opt}) == kind


def test_messages_describe_the_checkpoint_as_recorded():
    assert describe(0, "torch optimizer", None) == "ZeRO stage 0 (torch optimizer), no optimizer partition files"
    assert describe(1, "BF16_Optimizer", 2) == "BF16_Optimizer, ZeRO stage 1, 2 data-parallel rank files"


# -- a stage-0 save written by torch.save as DeepSpeed writes it --------------------------------------

class _Tied(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.embed = torch.nn.Embedding(7, 4).to(dtype)
        self.block = torch.nn.Linear(4, 4).to(dtype)
        self.head = torch.nn.Linear(4, 7, bias=False).to(dtype)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))


def _stage0_save(root, model, *, stage=0, param_shapes=None):
    tag = root / "global_step1"
    tag.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    torch.save({"module": model.state_dict(), "buffer_names": ["scale"], "optimizer": {"state": {}, "param_groups": []},
                "param_shapes": param_shapes, "frozen_param_shapes": None, "shared_params": None,
                "frozen_param_fragments": None, "dp_world_size": 2, "mp_world_size": 1,
                "ds_config": {"zero_optimization": {"stage": stage}}, "ds_version": "0.19.8"},
               tag / "mp_rank_00_model_states.pt")
    return root


def test_stage0_exports_every_name_of_a_module_without_config(tmp_path):
    torch.manual_seed(0)
    model = _Tied()
    src = _stage0_save(tmp_path / "src", model)
    info = inspect_checkpoint(src)
    assert (info["zero_stage"], info["optimizer"], info["dp_size"]) == (0, "torch optimizer", 2)
    export_checkpoint(src, tmp_path / "hf", weights_only=True)
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    want = model.state_dict()
    assert set(out) == set(want)  # head.weight written too: load_state_dict(strict=True) works
    for n, t in want.items():
        assert torch.equal(out[n], t), n
    _Tied().load_state_dict(out, strict=True)


def test_stage0_16bit_module_is_refused_naming_its_optimizer(tmp_path):
    model = _Tied(torch.bfloat16)  # its buffer stays fp32
    src = _stage0_save(tmp_path / "src", model)
    assert inspect_checkpoint(src)["dtype_required"]["dtype"] == "bf16"  # inspect describes it
    line = export_refused(src, tmp_path / "hf")
    assert "ZeRO stage 0 (torch optimizer)" in line and "--dtype bf16" in line, line
    export_refused(src, tmp_path / "hf", "--dtype", "fp32")
    export_checkpoint(src, tmp_path / "hf16", dtype="bf16", weights_only=True)  # the suggested way works
    out = load_safetensors(tmp_path / "hf16" / "model.safetensors")
    assert all(torch.equal(out[n], t.to(out[n].dtype)) for n, t in model.state_dict().items())
    assert out["embed.weight"].dtype == torch.bfloat16
    assert verify_checkpoint(tmp_path / "hf16", src).ok


def test_zero_save_without_its_optimizer_files_is_an_incomplete_copy(tmp_path):
    src = _stage0_save(tmp_path / "src", _Tied(), stage=2, param_shapes=[{"block.weight": [4, 4]}])
    line = export_refused(src, tmp_path / "hf")
    assert "records ZeRO stage 2" in line and "no *_optim_states.pt" in line, line


# -- tensors the checkpoint does not hold -------------------------------------------------------------

def _plan(**detail):
    return ExportPlan(engine="deepspeed", source="/x", tag=None, tensors=[], detail=dict(detail))


def test_missing_tensors_refused_naming_them_and_the_way_on():
    with pytest.raises(CheckpointError) as e:
        check_missing(_plan(missing_tensors=["a.weight", "b.weight"], exclude_frozen_parameters=True), "/src", False)
    msg = str(e.value)
    assert "a.weight, b.weight" in msg and "allow_missing=True" in msg and "exclude_frozen_parameters=True" in msg


def test_missing_tensors_allowed_with_a_note():
    plan = _plan(missing_tensors=["a.weight"])
    check_missing(plan, "/src", True)
    assert any("a.weight" in n for n in plan.notes)
    check_missing(_plan(), "/src", False)  # nothing missing: nothing to say


def test_config_model_tensors_the_checkpoint_lacks_are_returned_a_missing_layer_is_refused(tmp_path):
    """A left-out parameter of a layer the checkpoint holds is a missing tensor (listed, refused by the
    export front end); a whole layer the checkpoint lacks means config.json is another model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_ckpt_integrations.errors import LayoutError
    from hf_ckpt_integrations.convert.config_fit import check_fits

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert check_fits(model, shapes, tmp_path) == []
    held = {n: s for n, s in shapes.items() if n not in ("model.embed_tokens.weight",
                                                         "model.layers.0.self_attn.q_proj.weight")}
    assert sorted(check_fits(model, held, tmp_path)) == ["model.embed_tokens.weight",
                                                         "model.layers.0.self_attn.q_proj.weight"]
    one_layer = {n: s for n, s in shapes.items() if ".layers.1." not in n}
    with pytest.raises(LayoutError, match="the model has model.layers.1."):
        check_fits(model, one_layer, tmp_path)
