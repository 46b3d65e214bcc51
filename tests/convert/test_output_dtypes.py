"""Output dtypes: every path writes what ``from_pretrained(masters, dtype=X).save_pretrained()`` writes.

The rule (:mod:`hf_ckpt_integrations.dtype_rule`) is checked on plain data first (milliseconds),
then against transformers itself: tiny DeepSeek-V3, GLM-4-MoE (routers kept fp32 by
``_keep_in_fp32_modules_strict`` in bf16 and fp16) and T5 (``wo`` kept fp32 by
``_keep_in_fp32_modules`` in fp16) models are saved in fp32 ("the masters"), and the export of that
directory, offline and from the live model, must hold the same names, dtypes and bytes as
transformers' own load-in-X-then-save, with the config.json dtype it records. Runs under both
environments (transformers 5 in .venv, 4.51 in .venv-cai: there only the classes it has).
"""

import json
import os

import pytest
import torch

from hf_ckpt_integrations.dtype_rule import KeepFp32, kept_reason, output_dtype, request, trained_dtype
from hf_ckpt_integrations.formats.config import transformers_major
from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan, decide_dtypes

DSV3 = KeepFp32((), ("e_score_correction_bias", "gate.weight"), "search", "DeepseekV3ForCausalLM")
T5 = KeepFp32(("wo",), (), "search", "T5ForConditionalGeneration")


# --- the rule on plain data -------------------------------------------------------------------

def test_strict_modules_stay_fp32_in_bf16_and_fp16_only():
    for requested in ("BF16", "F16"):
        assert output_dtype("model.layers.1.mlp.gate.weight", "F32", requested, DSV3) == "F32"
        assert output_dtype("model.layers.1.mlp.gate.e_score_correction_bias", "F32", requested, DSV3) == "F32"
        assert output_dtype("model.layers.1.mlp.experts.gate_up_proj", "F32", requested, DSV3) == requested
    assert output_dtype("model.layers.1.mlp.gate.weight", "BF16", "F32", DSV3) == "F32"  # fp32: everything is


def test_non_strict_modules_stay_fp32_in_fp16_only():
    name = "encoder.block.0.layer.1.DenseReluDense.wo.weight"
    assert output_dtype(name, "F32", "F16", T5) == "F32"
    assert output_dtype(name, "F32", "BF16", T5) == "BF16"
    assert kept_reason(name, "F16", T5) == "T5ForConditionalGeneration._keep_in_fp32_modules: 'wo'"


def test_no_request_keeps_each_stored_dtype_and_integers_never_change():
    assert output_dtype("x.gate.weight", "BF16", None, DSV3) == "BF16"
    assert output_dtype("x.gate.weight", "I64", "BF16", DSV3) == "I64"
    assert output_dtype("x.gate.weight", "BF16", "BF16", None) == "BF16"


def test_matching_follows_the_installed_release():
    # transformers 5: the glob is searched anywhere in the name; 4.x: whole dotted components.
    search = KeepFp32(("wo",), (), "search")
    components = KeepFp32(("wo",), (), "components")
    assert output_dtype("model.word_embeddings.weight", "F32", "F16", search) == "F32"
    assert output_dtype("model.word_embeddings.weight", "F32", "F16", components) == "F16"
    assert output_dtype("block.wo.weight", "F32", "F16", components) == "F32"
    assert output_dtype("wo", "F32", "F16", components) == "F32"


def test_each_paths_default_is_an_input():
    assert request("bf16", training="fp16", masters=True) == "BF16"  # asked for
    assert request(None, training="bf16", masters=True) == "BF16"  # the Trainer callback: training dtype
    assert request(None, masters=True) == "F32"  # offline: the fp32 masters
    assert request(None) is None  # live hooks: each tensor as trained


def test_trained_dtype_ignores_the_fp32_kept_modules():
    class Tiny(torch.nn.Module):
        _keep_in_fp32_modules_strict = {"gate.weight"}

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2).to(torch.bfloat16)
            self.gate = torch.nn.Linear(2, 2, bias=False)

    assert trained_dtype(Tiny()) == "bf16"
    t = Tiny()
    t.proj.bias.data = t.proj.bias.data.float()  # an fp32 tensor the class does not keep: mixed
    assert trained_dtype(t) is None


def _plan(t, **kw):
    return ExportPlan("x", "src", None, [t], **kw)


def test_a_kept_tensor_planned_from_16bit_module_weights_comes_from_the_masters():
    masters = [Piece("optim.pt", 64, 4, "F32")]
    module = [Piece("model.pt", 8, 4, "BF16")]
    t = TensorPlan("model.layers.1.mlp.gate.weight", (2, 2), "BF16", [module], kind="module",
                   module_check=([masters], [module]))
    plan = decide_dtypes(_plan(t, dtypes={"master": "F32", "module": "BF16"}), "bf16", DSV3)
    assert (t.out_dtype, t.src_dtype, t.kind, t.parts) == ("F32", "F32", "master", [masters])
    assert not [n for n in plan.notes if "upcast" in n]


def test_a_kept_tensor_without_masters_is_upcast_and_a_note_says_so():
    t = TensorPlan("model.layers.1.mlp.gate.weight", (2, 2), "BF16", [[Piece("w.safetensors", 8, 4, "BF16")]],
                   kind="module")
    plan = decide_dtypes(_plan(t, dtypes={"module": "BF16"}), "bf16", DSV3)
    assert t.out_dtype == "F32" and t.src_dtype == "BF16"
    assert any("upcast" in n and t.name in n for n in plan.notes)
    assert plan.kept_fp32()["tensors"] == [{"name": t.name, "when": ["bf16", "fp16"], "from": "upcast from BF16",
                                            "why": "DeepseekV3ForCausalLM._keep_in_fp32_modules_strict: "
                                                   "'gate.weight'"}]


# --- against transformers: load the masters in X, save, compare -----------------------------

def _families():
    import transformers as tf

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=101, max_position_embeddings=64)
    out = {}
    if hasattr(tf, "DeepseekV3ForCausalLM"):  # dense layer 0, MoE layer 1 (router + correction bias)
        out["deepseek_v3"] = lambda: (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **small, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8))
    if hasattr(tf, "Glm4MoeForCausalLM"):
        out["glm4_moe"] = lambda: (tf.Glm4MoeForCausalLM, tf.Glm4MoeConfig(
            **small, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=1, head_dim=8))
    out["t5"] = lambda: (tf.T5ForConditionalGeneration, tf.T5Config(
        d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=101, decoder_start_token_id=0))
    return out


FAMILIES = _families()
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module")
def masters(tmp_path_factory):
    """family -> (model class, the fp32 masters directory save_pretrained wrote)."""
    root = tmp_path_factory.mktemp("masters")
    out = {}
    for family, make in FAMILIES.items():
        cls, cfg = make()
        torch.manual_seed(0)
        model = cls(cfg)
        with torch.no_grad():  # no constant tensor (a zero bias) hides a wrong source of bytes
            for p in model.state_dict().values():
                if p.is_floating_point():
                    p.copy_(torch.randn_like(p))
        model.save_pretrained(root / family)
        out[family] = (cls, root / family)
    return out


def _reference(masters, family, dtype, root):
    """transformers' own answer: from_pretrained(masters, dtype).save_pretrained()."""
    cls, d = masters[family]
    ref = root / f"ref-{family}-{dtype}"
    if not ref.exists():
        kw = {"dtype": DTYPES[dtype]} if (transformers_major() or 0) >= 5 else {"torch_dtype": DTYPES[dtype]}
        cls.from_pretrained(d, **kw).save_pretrained(ref)
    return ref


def _tensors(d):
    """name -> (dtype, bytes) of every tensor of the HF directory ``d``."""
    from safetensors import safe_open

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as h:
                for k in h.keys():
                    t = h.get_tensor(k)
                    out[k] = (str(t.dtype), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


def _config_dtype(d):
    cfg = json.loads((d / "config.json").read_text())
    return cfg.get("dtype", cfg.get("torch_dtype"))


def _assert_same(ours, ref):
    a, b = _tensors(ours), _tensors(ref)
    assert sorted(a) == sorted(b), "tensor names differ"
    dtypes = {n: (a[n][0], b[n][0]) for n in a if a[n][0] != b[n][0]}
    assert not dtypes, f"dtypes differ from transformers' load-then-save (ours, theirs): {dtypes}"
    assert [n for n in a if a[n][1] != b[n][1]] == [], "bytes differ"
    assert _config_dtype(ours) == _config_dtype(ref), "config.json records another dtype"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_offline_export_is_transformers_load_then_save(family, dtype, masters, tmp_path_factory):
    from hf_ckpt_integrations import export_checkpoint

    root = tmp_path_factory.getbasetemp()
    ours = root / f"ours-{family}-{dtype}"
    export_checkpoint(masters[family][1], ours, dtype=dtype, overwrite=True)
    ref = _reference(masters, family, dtype, root)
    _assert_same(ours, ref)
    fp32 = {n for n, (d, _) in _tensors(ref).items() if d == "torch.float32"}
    if dtype != "fp32":  # the kept tensors are the masters, bitwise
        stored = _tensors(masters[family][1])
        assert all(_tensors(ours)[n][1] == stored[n][1] for n in fp32)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_live_save_is_transformers_load_then_save(family, masters, tmp_path_factory):
    """The live source (the Accelerate hook's): an fp32 model written in fp16."""
    from hf_ckpt_integrations.integrations._dist import write_config_on_rank0, write_distributed
    from hf_ckpt_integrations.sources.live import live_tensors

    cls, d = masters[family]
    root = tmp_path_factory.getbasetemp()
    ours = root / f"live-{family}"
    model = cls.from_pretrained(d)
    plan = live_tensors(model, dtype="fp16")
    write_distributed(plan, ours)
    write_config_on_rank0(model, ours, plan)
    _assert_same(ours, _reference(masters, family, "fp16", root))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inspect_lists_what_a_16bit_export_keeps_in_fp32(family, masters, tmp_path_factory):
    from hf_ckpt_integrations import inspect_checkpoint

    root = tmp_path_factory.getbasetemp()
    keep = inspect_checkpoint(masters[family][1])["keep_fp32"]
    for dtype in ("bf16", "fp16"):
        ref = _tensors(_reference(masters, family, dtype, root))
        assert {t["name"] for t in keep["tensors"] if dtype in t["when"]} == \
            {n for n, (d, _) in ref.items() if d == "torch.float32"}
    assert all(t["why"].startswith(keep["model_class"] + "._keep_in_fp32_modules") for t in keep["tensors"])


def test_default_shard_size_is_the_installed_save_pretrained_default():
    import inspect

    from huggingface_hub.serialization._base import parse_size_to_int
    from transformers import PreTrainedModel

    from hf_ckpt_integrations.cli import export_command_parser
    from hf_ckpt_integrations.writer import check_max_shard_size

    default = inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default
    assert check_max_shard_size(None) == parse_size_to_int(default)
    assert export_command_parser().parse_args(["a", "b"]).max_shard_size is None
    assert "save_pretrained" in export_command_parser().format_help()


@pytest.mark.engine
def test_trainer_callback_under_bf16_zero2_keeps_the_routers_as_fp32_masters(engine_ckpt):
    """A tiny DeepSeek-V3 trained in bf16 under ZeRO-2 with the callback at its default dtype (the
    training dtype): checkpoint-2/ equals from_pretrained(masters, dtype=bf16).save_pretrained() —
    the routers fp32 and bitwise the engine's fp32 masters, where the Trainer's own bf16 save and the
    16-bit module weights the copy path reads hold them in bf16."""
    if not hasattr(__import__("transformers"), "DeepseekV3ForCausalLM"):
        pytest.skip("no DeepSeek-V3 in this transformers")
    case = engine_ckpt("fam-cb-deepseek_v3-z2-bf16")
    ckpt = case / "run" / "checkpoint-2"
    _assert_same(ckpt, case / "reference" / "hf-bf16")
    got, masters = _tensors(ckpt), _tensors(case / "reference" / "hf")
    kept = {n for n, (d, _) in got.items() if d == "torch.float32"}
    if (transformers_major() or 0) >= 5:  # 4.51's DeepSeek-V3 keeps nothing in fp32
        assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"} <= kept
    assert all(got[n][1] == masters[n][1] for n in kept)
