"""Megatron-Core checkpoints -> HF (hf_ckpt_integrations/sources/megatron/, issue 37).

Engine case ``megatron`` (tests/engines/megatron_train.py): real Megatron-Core 0.16.1 GPTModel saves on
CPU/gloo, one 4-rank launch: TP 2, PP 2, TP 2 x PP 2, DP 4, a tied TP 2 Llama and a TP 2 Qwen2 (q/k/v biases), each in the torch_dist
and the legacy ``mp_rank_*`` layout, beside Megatron's own fp32 logits on a fixed input. Every export
loads with ``from_pretrained`` and gives those logits; both layouts export to the same bytes; ``verify``
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

LAYOUTS = ("tp2", "pp2", "tp2pp2", "dp4", "tp2-tied", "tp2-qwen2")
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lay", LAYOUTS)
def test_export_gives_megatrons_logits(case, exports, lay, fmt):
    from transformers import AutoModelForCausalLM

    ref = torch.load(case / lay / "reference" / "logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(exports(lay, fmt), dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    assert logits.shape == ref["logits"].shape
    torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=2e-6)
    cfg = json.loads((exports(lay, fmt) / "config.json").read_text())  # derived from the saved args
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
