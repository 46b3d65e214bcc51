"""PEFT/LoRA adapters: peft's names, save time (Trainer callback, accelerator.save_model) under
ZeRO-3 (gather flag off and on) and ZeRO-2, offline export / inspect / verify, --merge-adapters.

Engine cases (``peft-*`` in conftest): a real Trainer + DeepSpeed run on 2 ranks with a peft LoRA
model; references are the engine's own adapter parameters gathered inside each save and the PEFT
model's logits at that moment. Runs on both transformers lines (.venv and .venv-cai).
"""

import json
import shutil

import pytest
import torch

from helpers import assert_refused, export, hf_ckpt, load_safetensors

peft = pytest.importorskip("peft")

CASES = {"peft-z3": "default", "peft-z3-gather": "mine", "peft-z2": "default"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


# ---------------------------------------------------------------- fast: names, scale, refusals


def _tiny_peft(adapter="default", **lora):
    import common
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(common.tiny_llama_config())
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", **lora), adapter_name=adapter)


@pytest.mark.parametrize("adapter, lora", [
    ("default", {"target_modules": ["q_proj", "v_proj"]}),
    ("mine", {"target_modules": ["q_proj", "down_proj"], "modules_to_save": ["lm_head"]}),
    ("default", {"target_modules": ["embed_tokens", "o_proj"]}),
])
def test_save_name_is_peft_state_dict_name(adapter, lora):
    """Our rename of the trainable parameters' names == the keys of peft's get_peft_model_state_dict
    (what PeftModel.save_pretrained writes): adapter infix dropped, modules_to_save under the
    module's own name, lora_embedding_* without .weight; frozen base and copies left out."""
    from peft import get_peft_model_state_dict

    from hf_ckpt_integrations.sources.peft import adapter_names_in, save_name

    model = _tiny_peft(adapter, **lora)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapter_names_in(trainable) == [adapter]
    ours = {save_name(n, adapter) for n in trainable}
    theirs = set(get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False))
    assert None not in ours and ours == theirs
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(save_name(n, adapter) is None for n in frozen)


def test_lora_scale_follows_peft():
    from hf_ckpt_integrations.peft_merge import lora_scale

    cfg = {"r": 4, "lora_alpha": 8, "rank_pattern": {"v_proj": 2}, "alpha_pattern": {"layers.1.q_proj": 3}}
    assert lora_scale(cfg, "model.layers.0.self_attn.q_proj") == (4, 2.0)
    assert lora_scale(cfg, "model.layers.0.self_attn.v_proj") == (2, 4.0)
    assert lora_scale(cfg, "model.layers.1.q_proj") == (4, 0.75)
    assert lora_scale({**cfg, "use_rslora": True}, "model.layers.0.self_attn.q_proj") == (4, 4.0)


def _synthetic_adapter_plan(tmp_path, shapes, cfg=None):
    from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan
    from hf_ckpt_integrations.sources.peft import adapter_plan

    blob = tmp_path / "blob.bin"
    blob.write_bytes(b"\0" * 4096)
    tensors = [TensorPlan(n, s, "F32", [[Piece(str(blob), 0, int(torch.tensor(s).prod()), "F32")]]) for n, s in shapes]
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg or {"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    plan = ExportPlan("deepspeed", str(tmp_path), None, tensors)
    return adapter_plan(plan, str(tmp_path))


def test_empty_adapter_is_refused(tmp_path):
    """The known ZeRO-3 bug's shape: adapter tensors read from partitioned parameters are
    zero-size. Such an adapter is refused, never written."""
    from hf_ckpt_integrations.errors import LayoutError

    with pytest.raises(LayoutError, match="has no elements"):
        _synthetic_adapter_plan(tmp_path, [("base_model.model.q.lora_A.default.weight", (0,)),
                                           ("base_model.model.q.lora_B.default.weight", (0,))])
    plan = _synthetic_adapter_plan(tmp_path, [("base_model.model.q.lora_A.default.weight", (4, 8)),
                                              ("base_model.model.q.lora_B.default.weight", (8, 4))])
    assert [t.name for t in plan.tensors] == ["base_model.model.q.lora_A.weight", "base_model.model.q.lora_B.weight"]
    assert plan.adapter["peft_type"] == "LORA" and plan.adapter["r"] == 4


def test_full_model_beside_an_adapter_config_is_not_taken_for_an_adapter(tmp_path):
    """An adapter_config.json in the parent directory (an output dir of an earlier PEFT run) does
    not turn a checkpoint without adapter tensors into an (empty) adapter."""
    from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan
    from hf_ckpt_integrations.sources.peft import adapter_plan

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (tmp_path / "checkpoint-1").mkdir()
    t = TensorPlan("model.layers.0.self_attn.q_proj.weight", (1,), "F32", [[Piece("x", 0, 1, "F32")]])
    plan = adapter_plan(ExportPlan("deepspeed", str(tmp_path / "checkpoint-1"), None, [t]),
                        str(tmp_path / "checkpoint-1"))
    assert plan.adapter is None and [t.name for t in plan.tensors] == ["model.layers.0.self_attn.q_proj.weight"]


def test_lora_tensors_without_adapter_config_are_refused(tmp_path):
    from hf_ckpt_integrations.errors import LayoutError
    from hf_ckpt_integrations.plan import ExportPlan, Piece, TensorPlan
    from hf_ckpt_integrations.sources.peft import adapter_plan

    t = TensorPlan("base_model.model.q.lora_A.default.weight", (1,), "F32", [[Piece("x", 0, 1, "F32")]])
    with pytest.raises(LayoutError, match="no adapter_config.json; pass --config"):
        adapter_plan(ExportPlan("deepspeed", str(tmp_path), None, [t]), str(tmp_path))


# ---------------------------------------------------------------- engine runs


def _ckpts(case):
    return sorted((case / "run").glob("checkpoint-*"))


def _adapter_dir(ckpt, adapter):
    return ckpt if adapter == "default" else ckpt / adapter


def _missing_adapter_keys(model, directory, adapter):
    result = model.load_adapter(str(directory), adapter_name="check")
    return [k for k in result.missing_keys if ".check" in k and ("lora_" in k or "modules_to_save" in k)]


def _logits(model):
    import common

    model.eval()
    with torch.no_grad():
        return model(input_ids=common.probe_input()).logits


def _base(case):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(case / "base")



@pytest.mark.engine
@pytest.mark.parametrize("name", list(CASES))
def test_callback_writes_exactly_the_engine_adapter(engine_ckpt, name):
    """Every checkpoint-N: adapter_config.json + a non-empty adapter_model.safetensors bitwise equal
    to the adapter gathered from the engine inside the save; no model*.safetensors anywhere."""
    case, adapter = engine_ckpt(name), CASES[name]
    assert [c.name for c in _ckpts(case)] == ["checkpoint-2", "checkpoint-4"]
    for ckpt in _ckpts(case):
        out = _adapter_dir(ckpt, adapter)
        for d in (ckpt, out):
            assert not [n for n in WEIGHT_FILES if (d / n).exists()], sorted(p.name for p in d.iterdir())
            assert not list(d.glob(".hfckpt*"))
        ref = load_safetensors(case / "reference" / ckpt.name / "adapter.safetensors")
        got = load_safetensors(out / "adapter_model.safetensors")
        assert sorted(got) == sorted(ref) and len(got) >= 8
        for k in ref:
            assert got[k].numel() > 0 and got[k].shape == ref[k].shape, k  # the empty-adapter bug
            assert torch.equal(got[k], ref[k]), k
        cfg = json.loads((out / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["inference_mode"] is True


@pytest.mark.engine
@pytest.mark.parametrize("name", list(CASES))
def test_peft_from_pretrained_loads_checkpoint_with_equal_logits(engine_ckpt, name):
    from peft import PeftModel

    case, adapter = engine_ckpt(name), CASES[name]
    for ckpt in _ckpts(case):
        model = PeftModel.from_pretrained(_base(case), str(_adapter_dir(ckpt, adapter)))
        ref = load_safetensors(case / "reference" / ckpt.name / "logits.safetensors")["logits"]
        assert torch.equal(_logits(model), ref)
        assert _missing_adapter_keys(model, _adapter_dir(ckpt, adapter), adapter) == []


@pytest.mark.engine
@pytest.mark.parametrize("name", list(CASES))
def test_accelerate_save_model_writes_the_adapter_dir(engine_ckpt, name):
    """accelerator.save_model(PeftModel) with the hooks: the adapter only (no base gathered)."""
    case, adapter = engine_ckpt(name), CASES[name]
    out = _adapter_dir(case / "acc", adapter)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    got = load_safetensors(out / "adapter_model.safetensors")
    ref = load_safetensors(case / "reference" / "checkpoint-4" / "adapter.safetensors")
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].numel() > 0 and torch.equal(got[k], ref[k]), k


@pytest.mark.engine
@pytest.mark.parametrize("name", list(CASES))
def test_export_writes_adapter_dir_and_verify_compares_it(engine_ckpt, name, tmp_path):
    case = engine_ckpt(name)
    ckpt = case / "run" / "checkpoint-4"
    r = hf_ckpt("inspect", ckpt)
    assert r.returncode == 0, r.stderr
    assert "adapter     LORA r=4 alpha=8" in r.stdout and "targets     q_proj, v_proj" in r.stdout, r.stdout
    dst = tmp_path / "adapter"
    r = export(ckpt, dst)
    assert sorted(p.name for p in dst.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    got = load_safetensors(dst / "adapter_model.safetensors")
    ref = load_safetensors(case / "reference" / "checkpoint-4" / "adapter.safetensors")
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    r = hf_ckpt("verify", dst, "--against", ckpt)
    assert r.returncode == 0 and f"ok: {len(ref)} tensors" in r.stdout, (r.stdout, r.stderr)
    # A changed value is a difference (exit 1).
    from safetensors.torch import save_file

    first = sorted(got)[0]
    got[first] = got[first] + 1
    save_file(got, str(dst / "adapter_model.safetensors"), metadata={"format": "pt"})
    r = hf_ckpt("verify", dst, "--against", ckpt)
    assert r.returncode == 1 and first in r.stdout


@pytest.mark.engine
@pytest.mark.parametrize("name", ["peft-z3", "peft-z2"])
def test_merge_equals_peft_merge_and_unload(engine_ckpt, name, tmp_path):
    """Bitwise for untouched tensors (and modules_to_save copies), within 1e-6 for merged ones;
    loads with from_pretrained and gives the PEFT model's logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from hf_ckpt_integrations import export_checkpoint

    case = engine_ckpt(name)
    ckpt = case / "run" / "checkpoint-4"
    dst = tmp_path / "merged"
    report = export_checkpoint(ckpt, dst, merge_adapters=True, base=str(case / "base"))
    assert len(report["merged"]) == 4  # q_proj, v_proj in 2 layers
    ref = PeftModel.from_pretrained(_base(case), str(ckpt)).merge_and_unload().state_dict()
    got = load_safetensors(dst / "model.safetensors")
    assert sorted(got) == sorted(ref)
    merged = set(report["merged"])
    for k in ref:
        if k in merged:
            assert (got[k] - ref[k]).abs().max() <= 1e-6, k
            assert not torch.equal(got[k], load_safetensors(case / "base" / "model.safetensors")[k]), k
        else:
            assert torch.equal(got[k], ref[k]), k
    if name == "peft-z2":
        assert report["replaced"] == ["lm_head.weight"]
    model = LlamaForCausalLM.from_pretrained(dst)
    logits = load_safetensors(case / "reference" / "checkpoint-4" / "logits.safetensors")["logits"]
    torch.testing.assert_close(_logits(model), logits, rtol=0, atol=1e-4)
    assert (dst / "config.json").exists()


@pytest.mark.engine
def test_merge_takes_base_from_adapter_config_else_refuses(engine_ckpt, tmp_path):
    case = engine_ckpt("peft-z3")
    ckpt = case / "run" / "checkpoint-4"
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    # The cached run was built in a directory since renamed: base_model_name_or_path is gone.
    cfg["base_model_name_or_path"] = str(tmp_path / "nowhere")
    bad = tmp_path / "bad-cfg"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    r = hf_ckpt("export", ckpt, tmp_path / "m0", "--merge-adapters", "--config", bad)
    assert_refused(r, match="pass --base DIR", dst=tmp_path / "m0")
    good = tmp_path / "good-cfg"
    good.mkdir()
    cfg["base_model_name_or_path"] = str(case / "base")
    (good / "adapter_config.json").write_text(json.dumps(cfg))
    r = export(ckpt, tmp_path / "m1", "--merge-adapters", "--config", good)
    r2 = export(ckpt, tmp_path / "m2", "--merge-adapters", "--base", case / "base")
    assert (tmp_path / "m1" / "model.safetensors").read_bytes() == (tmp_path / "m2" / "model.safetensors").read_bytes()
    # --base without --merge-adapters, and a non-LoRA adapter, are refused with one error line.
    assert_refused(hf_ckpt("export", ckpt, tmp_path / "m3", "--base", case / "base"), match="--merge-adapters",
                   dst=tmp_path / "m3")
    ia3 = tmp_path / "ia3-cfg"
    ia3.mkdir()
    (ia3 / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    assert_refused(hf_ckpt("export", ckpt, tmp_path / "m4", "--merge-adapters", "--config", ia3),
                   match="merges LoRA adapters only", dst=tmp_path / "m4")
    shutil.rmtree(tmp_path / "m1")
