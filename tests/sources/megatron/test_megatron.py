"""Megatron-Core checkpoints -> HF (hf_ckpt_integrations/sources/megatron/, issue 37).

Engine case ``megatron`` (tests/engines/megatron_train.py): real Megatron-Core 0.16.1 GPTModel saves on
CPU/gloo, one 4-rank launch: TP 2, PP 2, TP 2 x PP 2, DP 4, a tied TP 2 Llama, a TP 2 Qwen2 (q/k/v biases),
Mixtral-like and Qwen2-MoE models at TP 2 x EP 2 (4 experts, top-2), a TP 2 GPT (LayerNorm, biases, learned
positions: exported as GPTBigCode) and PP 2 x VPP 2 (interleaved), each in the torch_dist
and the legacy ``mp_rank_*`` layout, beside Megatron's own fp32 logits on a fixed input. Every export
loads with ``from_pretrained`` and gives those logits; both layouts export to the same bytes (and DP 4 / TP 2
saved again with the distributed optimizer export the same bytes as without it); ``verify``
passes; hostile or lying files are refused by name.

Fast: the box selection against numpy slicing; detection leaves verl's rank files alone.
"""

import importlib.util
import json
import pickle
import shutil

import numpy as np
import pytest
import torch

from helpers import export_refused, hf_ckpt, load_safetensors
from hf_ckpt_integrations.plan import Chunk, Piece
from hf_ckpt_integrations.sources import megatron, registry
from hf_ckpt_integrations.sources.megatron.layout import GlobalTensor
from hf_ckpt_integrations.sources.megatron.rules import select_box

# Never imported here (other tests check the package imports no Megatron): only looked for.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                reason="megatron-core (requirements/main.txt) builds the engine case")

LAYOUTS = ("tp2", "pp2", "tp2pp2", "dp4", "tp2-tied", "tp2-qwen2")  # Llama-like; MoE, GPT and VPP have their own tests
FORMATS = ("torch_dist", "legacy")
ITER = "iter_0000001"


# ---------------------------------------------------------------- fast: box selection, detection


def _tensor_in_file(tmp_path, shape, chunk_boxes):
    """A global arange of ``shape`` stored chunk by chunk (each chunk row-major) in one file."""
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    path = tmp_path / "data.bin"
    chunks, blob = [], b""
    for off, sz in chunk_boxes:
        part = full[tuple(slice(o, o + s) for o, s in zip(off, sz))]
        chunks.append(Chunk((Piece(str(path), len(blob), part.size, "F32"),), off, sz))
        blob += part.tobytes()
    path.write_bytes(blob)
    return full, GlobalTensor("t", shape, "F32", chunks)


def _materialise(box_shape, chunks):
    out = np.full(box_shape, np.nan, dtype=np.float32)
    for c in chunks:
        data = b"".join(open(p.path, "rb").read()[p.offset:p.offset + 4 * p.numel] for p in c.pieces)
        out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = \
            np.frombuffer(data, dtype=np.float32).reshape(c.sizes)
    return out


@pytest.mark.parametrize("lo,hi", [((0, 0, 0), (4, 8, 6)), ((1, 2, 0), (2, 7, 6)), ((2, 0, 1), (4, 8, 5)),
                                   ((3, 5, 3), (4, 6, 4)), ((0, 3, 0), (4, 5, 6))])
def test_select_box_is_numpy_slicing(tmp_path, lo, hi):
    # a stacked [L=4, 8, 6] tensor split like Megatron's: layers 2 + 2 (PP), rows 4 + 4 (TP), cols 3 + 3
    boxes = [((l0, r0, c0), (2, 4, 3)) for l0 in (0, 2) for r0 in (0, 4) for c0 in (0, 3)]
    full, t = _tensor_in_file(tmp_path, (4, 8, 6), boxes)
    got = _materialise(tuple(h - l for l, h in zip(lo, hi)), select_box(t, lo, hi))
    assert np.array_equal(got, full[tuple(slice(l, h) for l, h in zip(lo, hi))])


def test_verl_rank_files_are_not_megatron(tmp_path):
    # verl's checkpoint root also names its step in latest_checkpointed_iteration.txt
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    actor = tmp_path / "global_step_2" / "actor"
    actor.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, actor / "model_world_size_1_rank_0.pt")
    assert not megatron.detect(str(tmp_path))
    assert registry.find_source(str(tmp_path)).NAME != "megatron"


# ---------------------------------------------------------------- engine: real Megatron-Core saves


@pytest.fixture(scope="module")
def case(engine_ckpt):
    return engine_ckpt("megatron")


@pytest.fixture(scope="module")
def exports(case, tmp_path_factory):
    """``(layout, format) -> exported dir`` (each exported once per module, through the API)."""
    from hf_ckpt_integrations import export_checkpoint

    root, done = tmp_path_factory.mktemp("megatron-exports"), {}

    def get(lay, fmt):
        if (lay, fmt) not in done:
            out = root / f"{lay}-{fmt}"
            export_checkpoint(str(case / lay / fmt), str(out))
            done[(lay, fmt)] = out
        return done[(lay, fmt)]
    return get


def _gives_megatrons_logits(case, out, lay):
    """The export at ``out`` loads with ``from_pretrained`` (no key missing, unexpected or of another
    shape) and gives Megatron's own fp32 logits on the reference input; its model and config.json."""
    from transformers import AutoModelForCausalLM

    ref = torch.load(case / lay / "reference" / "logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert logits.shape == ref["logits"].shape
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=2e-6)
    return model, json.loads((out / "config.json").read_text())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lay", LAYOUTS)
def test_export_gives_megatrons_logits(case, exports, lay, fmt):
    _, cfg = _gives_megatrons_logits(case, exports(lay, fmt), lay)  # config derived from the saved args
    assert cfg["vocab_size"] == 1001 and cfg["num_hidden_layers"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["tie_word_embeddings"] is lay.endswith("-tied")
    assert cfg["model_type"] == ("qwen2" if lay.endswith("-qwen2") else "llama")
    if lay.endswith("-qwen2"):  # the q/k/v biases (trained one step: not all zero) are in the export
        sd = load_safetensors(exports(lay, fmt) / "model.safetensors")
        assert sd["model.layers.0.self_attn.k_proj.bias"].shape == (32,)  # 2 query groups x 16
        assert sd["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


@pytest.mark.parametrize("lay", LAYOUTS)
def test_both_layouts_export_the_same_bytes(exports, lay):
    a, b = (exports(lay, fmt) / "model.safetensors" for fmt in FORMATS)
    assert a.read_bytes() == b.read_bytes()
    assert ("lm_head.weight" in load_safetensors(a)) is not lay.endswith("-tied")


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_and_inspect(case, exports, fmt):
    src = case / "tp2pp2" / fmt
    r = hf_ckpt("verify", exports("tp2pp2", fmt), "--against", src)
    assert r.returncode == 0, r.stderr[-2000:]
    r = hf_ckpt("inspect", src / ITER, "--json")  # the iteration directory given directly
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout)
    d = info
    assert (d["format"], d["iteration"], d["tp_size"], d["pp_size"], d["dp_size"], d["ep_size"]) == \
        (fmt, 1, 2, 2, 1, 1)
    assert info["padding_removed"]["model.embed_tokens.weight"] == [1024, 1001]


def _copy(case, lay, fmt, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(case / lay / fmt, src)
    return src


def test_config_mismatch_is_refused_naming_both_values(case, exports, tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    cfg = json.loads((exports("tp2", "torch_dist") / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    export_refused(case / "tp2" / "torch_dist", tmp_path / "out", "--config", cfg_dir,
                   match=("num_key_value_heads is 4", "args give 2"))


def test_without_common_pt_the_config_stands_for_the_args(case, exports, tmp_path):
    # Megatron-Core 0.17+ writes no common.pt; a 0.16.1 save without it stands in (0.17 needs Python >= 3.12)
    src = _copy(case, "tp2", "torch_dist", tmp_path)
    (src / ITER / "common.pt").unlink()
    export_refused(src, tmp_path / "out", match=("no common.pt", "--config"))
    r = hf_ckpt("export", src, tmp_path / "out", "--config", exports("tp2", "torch_dist"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (exports("tp2", "torch_dist") / "model.safetensors").read_bytes()


def test_saveplan_with_an_unknown_global_is_refused(case, tmp_path):
    src = _copy(case, "tp2", "torch_dist", tmp_path)
    meta = src / ITER / ".metadata"
    data = meta.read_bytes()
    assert data.count(b"\x8c\x08SavePlan") == 1
    meta.write_bytes(data.replace(b"\x8c\x08SavePlan", b"\x8c\x08SavePlaX"))
    export_refused(src, tmp_path / "out", match=(".metadata", "SavePlaX", "not on the allowlist"))


def test_shard_offset_past_the_tensor_is_refused(case, tmp_path):
    src = _copy(case, "tp2", "torch_dist", tmp_path)
    meta_path = src / ITER / ".metadata"
    with open(meta_path, "rb") as fh:
        md = pickle.load(fh)  # the test's own trusted copy: real torch classes
    entry = md.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"]
    c = entry.chunks[-1]
    entry.chunks[-1] = type(c)(offsets=torch.Size([c.offsets[0], c.offsets[1], 100]), sizes=c.sizes)
    with open(meta_path, "wb") as fh:
        pickle.dump(md, fh)
    export_refused(src, tmp_path / "out", match=(".metadata", "decoder.layers.mlp.linear_fc2.weight"))


def test_missing_distcp_file_is_refused(case, tmp_path):
    src = _copy(case, "tp2", "torch_dist", tmp_path)
    (src / ITER / "__1_0.distcp").unlink()
    export_refused(src, tmp_path / "out", match=("__1_0.distcp", "missing"))


def test_legacy_file_with_a_wrong_tp_shape_is_refused(case, tmp_path):
    src = _copy(case, "tp2", "legacy", tmp_path)
    path = src / ITER / "mp_rank_01" / "model_optim_rng.pt"
    obj = torch.load(path, weights_only=False)  # the test's own trusted copy
    key = "decoder.layers.2.self_attention.linear_qkv.weight"
    obj["model"][key] = obj["model"][key][:48].clone()
    torch.save(obj, path)
    export_refused(src, tmp_path / "out", match=("mp_rank_01", key, "[48, 64]", "[64, 64]"))


def test_legacy_missing_rank_directory_is_refused(case, tmp_path):
    src = _copy(case, "tp2pp2", "legacy", tmp_path)
    shutil.rmtree(src / ITER / "mp_rank_01_001")
    export_refused(src, tmp_path / "out", match=("mp_rank_01_001", "missing"))


@pytest.mark.parametrize("text,match", [
    (b"\x00\x13garbage", ("latest_checkpointed_iteration.txt", "not an iteration number", "iter_0000001")),
    (b"7", ("latest_checkpointed_iteration.txt", "names iteration 7", "iter_0000007", "iter_0000001")),
])
def test_corrupt_or_lying_latest_file_is_refused_naming_it(case, tmp_path, text, match):
    # not "no checkpoint found there": the save dir holds iter_NNNNNNN/, the file that points into it is wrong
    src = _copy(case, "tp2", "torch_dist", tmp_path)
    (src / "latest_checkpointed_iteration.txt").write_bytes(text)
    export_refused(src, tmp_path / "out", match=match)
    r = hf_ckpt("inspect", src)
    assert r.returncode == 2 and match[1] in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------- MoE: a Mixtral-like model at TP 2 x EP 2

MOE = "tp2ep2-mixtral"  # 4 experts, top-2, SequentialMLP; legacy files mp_rank_TT_EEE
# the same + q/k/v biases, a gated shared expert, softmax before top-k (norm_topk_prob false)
MOE_LAYOUTS = (MOE, "tp2ep2-qwen2moe")


def _moe_args(**extra):
    return {"num_experts": 4, "moe_router_topk": 2, "normalization": "RMSNorm", "swiglu": True,
            "position_embedding_type": "rope", "tensor_model_parallel_size": 2, **extra}


@pytest.mark.parametrize("extra,match", [
    ({"moe_shared_expert_intermediate_size": 64}, "a shared expert but args.moe_shared_expert_gate off"),
    ({"moe_router_score_function": "sigmoid"}, "moe_router_score_function='sigmoid'"),
    ({"moe_router_pre_softmax": True}, "moe_router_pre_softmax=True"),
    ({"moe_layer_freq": [1, 0, 1, 0]}, "moe_layer_freq=[1, 0, 1, 0]: dense layers"),
    ({"moe_grouped_gemm": True}, "moe_grouped_gemm=True: grouped-GEMM"),
    ({"expert_tensor_parallel_size": 1}, "expert_tensor_parallel_size=1 != tensor_model_parallel_size=2"),
])
def test_moe_variants_hf_mixtral_cannot_hold_are_refused_naming_the_argument(extra, match):
    assert megatron.family(_moe_args()) == "mixtral"
    assert megatron.family(_moe_args(moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
                                     moe_router_pre_softmax=True, add_qkv_bias=True)) == "qwen2_moe"
    with pytest.raises(Exception, match=match.replace("[", r"\[").replace("]", r"\]")):
        megatron.family(_moe_args(**extra))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lay", MOE_LAYOUTS)
def test_moe_export_gives_megatrons_logits(case, exports, lay, fmt):
    _, cfg = _gives_megatrons_logits(case, exports(lay, fmt), lay)  # config derived from the saved args
    if lay == MOE:
        assert (cfg["model_type"], cfg["architectures"], cfg["num_local_experts"], cfg["num_experts_per_tok"],
                cfg["intermediate_size"], cfg["vocab_size"]) == ("mixtral", ["MixtralForCausalLM"], 4, 2, 128, 1001)
    else:
        assert (cfg["model_type"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                cfg["shared_expert_intermediate_size"], cfg["norm_topk_prob"], cfg["qkv_bias"]) == \
            ("qwen2_moe", 4, 2, 128, 64, False, True)


@pytest.mark.parametrize("lay", MOE_LAYOUTS)
def test_moe_export_is_what_save_pretrained_writes(exports, tmp_path, lay):
    """Both layouts give the same bytes, and those are a real ``save_pretrained`` of the loaded model
    (transformers 5 fuses the experts in memory and splits them back into per-expert names on save)."""
    from transformers import AutoModelForCausalLM

    a, b = (exports(lay, fmt) / "model.safetensors" for fmt in FORMATS)
    assert a.read_bytes() == b.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(exports(lay, "torch_dist"), dtype=torch.float32)
    model.save_pretrained(tmp_path / "resaved")
    ours, theirs = load_safetensors(a), load_safetensors(tmp_path / "resaved" / "model.safetensors")
    assert {k: (v.dtype, v.shape) for k, v in ours.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    gate = "block_sparse_moe.experts.{}.w1" if lay == MOE else "mlp.experts.{}.gate_proj"
    w1 = [ours[f"model.layers.1.{gate.format(e)}.weight"] for e in range(4)]
    assert all(not torch.equal(w1[0], w) for w in w1[1:])  # four distinct experts (EP ranks 0 and 1)
    if lay != MOE:
        assert ours["model.layers.2.mlp.shared_expert_gate.weight"].shape == (1, 64)


def test_moe_inspect_shows_expert_parallelism(case):
    r = hf_ckpt("inspect", case / MOE / "legacy" / ITER, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    assert (d["format"], d["tp_size"], d["ep_size"], d["family"], d["rank_files"]) == ("legacy", 2, 2, "mixtral", 4)


def test_moe_legacy_missing_expert_rank_file_is_refused(case, tmp_path):
    src = _copy(case, MOE, "legacy", tmp_path)
    shutil.rmtree(src / ITER / "mp_rank_01_001")
    export_refused(src, tmp_path / "out", match=("mp_rank_01_001", "missing", "EP 2"))


def test_moe_legacy_ep_files_disagreeing_are_refused(case, tmp_path):
    # EP rank 1's TP-0 file lost its second local expert in every layer: 3 experts where args say 4
    src = _copy(case, MOE, "legacy", tmp_path)
    path = src / ITER / "mp_rank_00_001" / "model_optim_rng.pt"
    obj = torch.load(path, weights_only=False)  # the test's own trusted copy
    obj["model"] = {k: v for k, v in obj["model"].items() if ".local_experts.1." not in k}
    torch.save(obj, path)
    export_refused(src, tmp_path / "out", match=("mp_rank_00_001", "1 local experts", "other EP ranks' files 2"))


def test_moe_config_with_other_expert_count_is_refused(exports, case, tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    cfg = json.loads((exports(MOE, "torch_dist") / "config.json").read_text())
    cfg["num_experts_per_tok"] = 1
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    export_refused(case / MOE / "torch_dist", tmp_path / "out", "--config", cfg_dir,
                   match=("num_experts_per_tok is 1", "args give 2"))


# ---------------------------------------------------------------- GPT (LayerNorm, biases, learned positions): gpt37


GPT_LAYOUTS = ("tp2-gpt", "gpt-mqa")  # MHA at TP 2; MQA (one query group) at TP 1 x DP 4


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lay", GPT_LAYOUTS)
def test_gpt_export_is_gptbigcode_with_megatrons_logits(case, exports, lay, fmt):
    model, cfg = _gives_megatrons_logits(case, exports(lay, fmt), lay)  # config derived from the saved args
    assert type(model).__name__ == "GPTBigCodeForCausalLM"
    mqa = lay == "gpt-mqa"
    assert (cfg["model_type"], cfg["n_layer"], cfg["n_embd"], cfg["n_inner"], cfg["n_head"], cfg["n_positions"],
            cfg["vocab_size"], cfg["multi_query"], cfg["activation_function"], cfg["tie_word_embeddings"]) == \
        ("gpt_bigcode", 4, 64, 96, 4, 128, 1001, mqa, "gelu", True)
    sd = load_safetensors(exports(lay, fmt) / "model.safetensors")
    assert sd["transformer.wpe.weight"].shape == (128, 64) and "lm_head.weight" not in sd
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == ((64 + 2 * 16) if mqa else 3 * 64, 64)
    for name in ("transformer.h.3.attn.c_attn.bias", "transformer.h.0.attn.c_proj.bias", "transformer.h.1.mlp.c_fc.bias",
                 "transformer.h.2.mlp.c_proj.bias", "transformer.h.0.ln_1.bias", "transformer.ln_f.bias"):
        assert sd[name].abs().sum() > 0, name  # trained one step: the biases are the saved ones, not zeros
    r = hf_ckpt("verify", exports(lay, fmt), "--against", case / lay / fmt)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("lay", GPT_LAYOUTS)
def test_gpt_both_layouts_export_the_same_bytes(exports, lay):
    a, b = (exports(lay, fmt) / "model.safetensors" for fmt in FORMATS)
    assert a.read_bytes() == b.read_bytes()


def _gpt_config_dir(exports, tmp_path, **change):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir(parents=True)
    cfg = json.loads((exports("tp2-gpt", "torch_dist") / "config.json").read_text())
    cfg.update(change)
    (cfg_dir / "config.json").write_text(json.dumps(cfg))
    return cfg_dir


def test_gpt_given_config_is_checked_and_stands_for_missing_args(case, exports, tmp_path):
    bad = _gpt_config_dir(exports, tmp_path / "a", activation_function="gelu_pytorch_tanh")
    export_refused(case / "tp2-gpt" / "torch_dist", tmp_path / "out", "--config", bad,
                   match=("config.json", "activation_function is 'gelu_pytorch_tanh'", "erf GELU"))
    bad = _gpt_config_dir(exports, tmp_path / "b", n_inner=128)
    export_refused(case / "tp2-gpt" / "legacy", tmp_path / "out", "--config", bad,
                   match=("n_inner is 128", "args give 96"))
    src = _copy(case, "tp2-gpt", "torch_dist", tmp_path)  # 0.17+ stand-in: no common.pt, the config holds the args
    (src / ITER / "common.pt").unlink()
    r = hf_ckpt("export", src, tmp_path / "out", "--config", exports("tp2-gpt", "torch_dist"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (exports("tp2-gpt", "torch_dist") / "model.safetensors").read_bytes()


def _edit_legacy(src, fn):
    for path in sorted((src / ITER).glob("mp_rank_*/model_optim_rng.pt")):
        obj = torch.load(path, weights_only=False)  # the test's own trusted copy
        fn(obj)
        torch.save(obj, path)


def test_gpt_with_query_groups_is_refused_by_name(case, tmp_path):
    src = _copy(case, "tp2-gpt", "legacy", tmp_path)

    def gqa(obj):
        obj["args"].group_query_attention, obj["args"].num_query_groups = True, 2
    _edit_legacy(src, gqa)
    export_refused(src, tmp_path / "out", match=("GPT save", "args.num_query_groups is 2", "GPTBigCode"))


def test_gpt_with_an_unmapped_tensor_is_refused_by_name(case, tmp_path):
    # a GPT save carrying q/k norms (qk_layernorm) that its args do not admit: GPTBigCode has nowhere to put them
    src = _copy(case, "tp2-gpt", "legacy", tmp_path)

    def qk_norm(obj):
        for layer in range(4):
            obj["model"][f"decoder.layers.{layer}.self_attention.q_layernorm.weight"] = torch.ones(16)
    _edit_legacy(src, qk_norm)
    export_refused(src, tmp_path / "out", match=("decoder.layers.self_attention.q_layernorm.weight",))


# ---------------------------------------------------------------- the distributed optimizer: gpt37

DISTOPT = {"dp4": "dp_reshardable", "tp2": "fully_reshardable"}  # megatron_train.DISTOPT


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lay", sorted(DISTOPT))
def test_distributed_optimizer_save_exports_the_plain_saves_bytes(case, exports, lay, fmt):
    # the same weights saved with Megatron's DistributedOptimizer: torch_dist's optimizer.* entries (dp_reshardable
    # buckets / fully_reshardable per-tensor state) and legacy's distrib_optim.pt are not read, and change no byte
    src = case / lay / f"{fmt}-distopt"
    assert (exports(lay, f"{fmt}-distopt") / "model.safetensors").read_bytes() == \
        (exports(lay, fmt) / "model.safetensors").read_bytes()
    assert (exports(lay, f"{fmt}-distopt") / "config.json").read_bytes() == (exports(lay, fmt) / "config.json").read_bytes()
    r = hf_ckpt("inspect", src, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout)
    assert info["distributed_optimizer"] is True
    if fmt == "torch_dist":
        assert info["optimizer_sharding"] == DISTOPT[lay] and info["optimizer_tensors"] > 0
    else:
        assert info["distrib_optim_files"] == (2 if lay == "tp2" else 1)
    assert any("distributed optimizer" in n and "not read" in n for n in info["notes"]), info["notes"]


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


def test_distrib_optim_pt_is_never_opened(case, exports, tmp_path):
    # a distrib_optim.pt that would run code if unpickled: the export neither opens it nor changes
    src = _copy(case, "dp4", "legacy-distopt", tmp_path)
    marker = tmp_path / "ran"
    torch.save({"buckets_coalesced": _RunsCode(marker)}, src / ITER / "mp_rank_00" / "distrib_optim.pt")
    r = hf_ckpt("export", src, tmp_path / "out")
    assert r.returncode == 0, r.stderr[-2000:]
    assert not marker.exists()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == \
        (exports("dp4", "legacy") / "model.safetensors").read_bytes()


def test_optimizer_state_pickling_code_is_refused_by_name(case, tmp_path):
    # model_optim_rng.pt's own "optimizer" entry (the distributed optimizer's state_dict()) is parsed with the
    # rest of the file by the restricted unpickler: a global off the allowlist is refused, naming the file
    src = _copy(case, "dp4", "legacy-distopt", tmp_path)
    marker = tmp_path / "ran"
    path = src / ITER / "mp_rank_00" / "model_optim_rng.pt"
    obj = torch.load(path, weights_only=False)  # the test's own trusted copy
    obj["optimizer"]["grad_scaler"] = _RunsCode(marker)
    torch.save(obj, path)
    export_refused(src, tmp_path / "out", match=("mp_rank_00/model_optim_rng.pt", "system", "not on the allowlist"))
    assert not marker.exists()


# ---------------------------------------------------------------- virtual pipeline (interleaved) stages: gpt37


@pytest.mark.parametrize("fmt", FORMATS)
def test_virtual_pipeline_save_gives_megatrons_logits(case, exports, fmt):
    # PP 2 x VPP 2, 4 layers: stage 0 holds layers 0 and 2 (model0, model1), stage 1 layers 1 and 3; the layers are
    # untrained and random, so the logits prove the order (placing each stage's chunks together would not give them)
    _gives_megatrons_logits(case, exports("pp2-vpp2", fmt), "pp2-vpp2")
    r = hf_ckpt("inspect", case / "pp2-vpp2" / fmt, "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout)
    assert (info["pp_size"], info["vpp_size"], info["dp_size"]) == (2, 2, 2)
    r = hf_ckpt("verify", exports("pp2-vpp2", fmt), "--against", case / "pp2-vpp2" / fmt)
    assert r.returncode == 0, r.stderr[-2000:]


def test_virtual_pipeline_layouts_export_the_same_bytes(exports):
    a, b = (exports("pp2-vpp2", fmt) / "model.safetensors" for fmt in FORMATS)
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("hostile", ["chunk-missing", "args-lie"])
def test_virtual_pipeline_legacy_mismatch_is_refused_by_name(case, tmp_path, hostile):
    src = _copy(case, "pp2-vpp2", "legacy", tmp_path)
    path = src / ITER / "mp_rank_00_001" / "model_optim_rng.pt"
    if hostile == "chunk-missing":  # a file of another (non-interleaved) save, or one cut short
        obj = torch.load(path, weights_only=False)  # the test's own trusted copy
        del obj["model1"]
        torch.save(obj, path)
        match = ("mp_rank_00_001", "holds 1 model chunk(s)", "2")
    else:
        def lie(obj):
            obj["args"].virtual_pipeline_model_parallel_size = 4
        _edit_legacy(src, lie)
        match = ("2 virtual-pipeline model chunk(s)", "args.virtual_pipeline_model_parallel_size is 4")
    export_refused(src, tmp_path / "out", match=match)
