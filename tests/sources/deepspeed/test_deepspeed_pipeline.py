"""DeepSpeed PipelineModule saves (GPT-NeoX's layout: 2 stages x TP 2, or x DP 2; ZeRO-1 / BF16_Optimizer)
exported to HF: the export equals the fp32 masters the engine itself holds, gathered by the engine
script under HF names, and HF ``GPTNeoXForCausalLM`` on the export gives the pipeline's own logits.
Row-parallel biases follow the model's residual: summed over TP ranks with the parallel residual,
one checked copy with the sequential one."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import assert_refused, export, export_refused, hf_ckpt, load_safetensors, read_export

pytestmark = pytest.mark.engine

# case -> (tp, dtype, residual); each is a 4-rank run of tests/engines/ds_pipe_train.py (conftest CASES)
PIPE_CASES = {"pipe-tp2-fp32-par": (2, "fp32", "parallel"), "pipe-tp2-bf16-seq": (2, "bf16", "sequential"),
              "pipe-dp2-fp32-seq": (1, "fp32", "sequential"), "pipe-tp2-fp32-z0-par": (2, "fp32", "parallel")}


def _reference(run, kind="master"):
    out = {}
    for f in sorted((run / "reference").glob(f"{kind}-stage*.safetensors")):
        out.update(load_safetensors(f))
    return out


@pytest.mark.parametrize("case", sorted(PIPE_CASES))
def test_export_is_the_gathered_masters_under_hf_names(engine_ckpt, tmp_path, case):
    run = engine_ckpt(case)
    dst = tmp_path / "hf"
    export(run / "ckpt", dst, config=run / "config")
    got, want = read_export(dst), _reference(run)
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], ref), name
    r = hf_ckpt("verify", dst, "--against", run / "ckpt", "--config", run / "config")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.parametrize("case", sorted(PIPE_CASES))
def test_hf_logits_are_the_pipelines(engine_ckpt, tmp_path, case):
    from transformers import GPTNeoXForCausalLM

    tp, dtype, residual = PIPE_CASES[case]
    run = engine_ckpt(case)
    dst = tmp_path / "hf"
    export(run / "ckpt", dst, "--dtype", dtype, config=run / "config")
    want = load_safetensors(run / "reference" / "logits.safetensors")["logits"]
    ids = _probe(run)
    model = GPTNeoXForCausalLM.from_pretrained(dst, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
    # TP adds partial products in another order than one matmul: fp32 agrees to rounding; bf16 to its precision.
    tol = 2e-5 if dtype == "fp32" else 2e-2  # measured: 3e-7 and 5e-3 of the largest logit; wrong biases: 7e-2
    assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())


def _probe(run):
    import sys

    import common

    return common.fixed_batch(99, rank=0, vocab_size=1002)


def test_the_other_residual_rule_gives_other_logits(engine_ckpt, tmp_path):
    """The row-bias rule is what makes the logits right: exported under the opposite residual (one
    copy instead of the sum), HF's logits leave the pipeline's by far."""

    run = engine_ckpt("pipe-tp2-fp32-par")
    cfg = tmp_path / "cfg"
    shutil.copytree(run / "config", cfg)
    c = json.loads((cfg / "config.json").read_text())
    c["use_parallel_residual"] = False
    (cfg / "config.json").write_text(json.dumps(c))
    dst = tmp_path / "hf"
    r = export(run / "ckpt", dst, "--config", cfg)
    got = read_export(dst)
    want = _reference(run)
    name = "gpt_neox.layers.0.attention.dense.bias"
    assert torch.equal(got[name] * 2, want[name])  # one copy where the model adds two


def test_inspect_shows_stages_tp_dp_layers_and_rules(engine_ckpt):
    run = engine_ckpt("pipe-tp2-fp32-par")
    r = hf_ckpt("inspect", run / "ckpt", "--config", run / "config", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert (info["pp_size"], info["tp_size"], info["dp_size"]) == (2, 2, 1)
    assert info["layer_stage"] == {"0": 0, "2": 0, "3": 1, "5": 1, "6": 1}
    rules = {t["name"]: (t["rule"], t["reduce"], t["cat_dim"], t["replicas"]) for t in info["tensors"]}
    assert rules["gpt_neox.layers.0.attention.dense.weight"][2] == 1
    assert rules["gpt_neox.layers.0.attention.dense.bias"][1] == "sum"
    assert rules["gpt_neox.layers.0.input_layernorm.weight"][3] == 1  # one copy, the other checked


def test_without_a_config_the_native_names_are_exported(engine_ckpt, tmp_path):
    """No config, no name map: the native names, merged, with a note; TP slices no rule covers are
    refused naming the --tp-rule to pass (a dimension is never guessed)."""
    run = engine_ckpt("pipe-dp2-fp32-seq")
    src = tmp_path / "src"
    shutil.copytree(run / "ckpt", src)
    dst = tmp_path / "hf"
    r = export(src, dst, "--weights-only")
    assert "native pipeline names" in r.stderr + r.stdout
    got = read_export(dst)
    want = _reference(run)
    assert len(got) == len(want)
    assert torch.equal(got["2.attention.query_key_value.weight"], want["gpt_neox.layers.0.attention.query_key_value.weight"])
    assert torch.equal(got["6.final_linear.weight"], want["embed_out.weight"])

    tp = tmp_path / "tp"
    shutil.copytree(engine_ckpt("pipe-tp2-fp32-par") / "ckpt", tp)
    export_refused(tp, tmp_path / "hf2", match="pass --tp-rule '0.word_embeddings.weight=0'")


def test_a_swapped_tp_layer_file_is_refused(engine_ckpt, tmp_path):
    """The masters are proven against the layer files: TP rank files swapped are named, not merged."""
    run = engine_ckpt("pipe-tp2-fp32-par")
    src = tmp_path / "src"
    shutil.copytree(run / "ckpt", src)
    tag = next(p for p in src.iterdir() if p.is_dir())
    a, b = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    tmp = tag / "x"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    dst = tmp_path / "hf"
    assert_refused(hf_ckpt("export", src, dst, "--config", run / "config"), match="does not match the model's own weights",
                   dst=dst)


def test_a_user_name_map_renames_and_a_name_it_misses_is_refused(engine_ckpt, tmp_path):
    """--source-option name_map=FILE (a fork's names, a conversion rules file): its names are written; a
    parameter no rule matches is refused, named."""
    from hf_ckpt_integrations.sources.deepspeed import pipeline

    run = engine_ckpt("pipe-dp2-fp32-seq")
    builtin = json.loads((Path(pipeline.__file__).parent / "rules" / "gpt_neox.json").read_text())
    builtin["rules"] = [dict(r, to="lm_head_of_my_fork.weight") if "final_linear" in r["match"] else r
                        for r in builtin["rules"]]
    mine = tmp_path / "map.json"
    mine.write_text(json.dumps(builtin))
    dst = tmp_path / "hf"
    r = export(run / "ckpt", dst, "--source-option", f"name_map={mine}", "--weights-only")
    got = read_export(dst)
    assert torch.equal(got["lm_head_of_my_fork.weight"], _reference(run)["embed_out.weight"])
    builtin["rules"] = [r for r in builtin["rules"] if r["match"] != r"(?P<layer>\d+)\.norm\.weight"]
    mine.write_text(json.dumps(builtin))
    export_refused(run / "ckpt", tmp_path / "hf2", "--weights-only", "--source-option", f"name_map={mine}",
                   match="parameter 5.norm.weight matches no rule")


def test_a_config_that_does_not_fit_the_mapped_names_is_refused(engine_ckpt, tmp_path):
    """The mapped names and shapes must be what save_pretrained of the config's model writes: a config
    of another depth is refused, not written as a directory that loads with missing weights."""
    run = engine_ckpt("pipe-dp2-fp32-seq")
    cfg = tmp_path / "cfg"
    shutil.copytree(run / "config", cfg)
    c = json.loads((cfg / "config.json").read_text())
    c["num_hidden_layers"] = 3
    (cfg / "config.json").write_text(json.dumps(c))
    export_refused(run / "ckpt", tmp_path / "hf", "--config", cfg,
                   match="gpt_neox.layers.2.attention.dense.bias missing")
