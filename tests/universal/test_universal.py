"""Seed 001: universal checkpoints survive a TP / DP size change once the merge rules are recorded."""

import json

import pytest

from conftest import ENGINES, torchrun
from hf_ckpt_integrations import export_checkpoint
from hf_ckpt_integrations.sources.deepspeed.allowlist import load as load_rank_file
from hf_ckpt_integrations.integrations.deepspeed import derive_universal_checkpoint_info
from hf_ckpt_integrations.convert.tp_rules import hf_plans_for
from helpers import hf_ckpt

pytestmark = pytest.mark.engine


def _losses(case):
    return json.loads((case / "run.json").read_text())


@pytest.mark.parametrize("layout", ["tp", "dp"])
def test_resume_at_tp1_dp1_matches_uninterrupted_run(layout, engine_ckpt):
    trained = _losses(engine_ckpt(f"uc-{layout}-helper"))
    assert trained["ds_to_universal_rc"] == 0
    resumed = _losses(engine_ckpt(f"uc-{layout}-helper-resume"))
    assert resumed["expected"] == trained["losses"][2:]
    assert resumed["losses"] == pytest.approx(resumed["expected"], rel=1e-5, abs=1e-6)


def test_without_the_helper_the_layernorm_is_concatenated(engine_ckpt, tmp_path):
    """Seed 001's failure, reproduced: a bare record lets ds_to_universal concatenate replicas."""
    naive = engine_ckpt("uc-tp-naive")
    assert _losses(naive)["ds_to_universal_rc"] == 0
    log = tmp_path / "resume.log"
    with pytest.raises(RuntimeError):
        torchrun(ENGINES / "ds_universal.py", 1, [tmp_path / "out", "resume", "--from", str(naive)], log=log)
    text = log.read_text()
    assert "input_layernorm.weight" in text and "full param numel 128 != tensor slice numel 64" in text


def test_universal_export_is_bitwise_the_pre_conversion_export(engine_ckpt, tmp_path):
    case = engine_ckpt("uc-tp-helper")
    config = str(case / "config")
    export_checkpoint(case / "ckpt", tmp_path / "uc", tag="global_step2_universal", config=config)
    export_checkpoint(case / "ckpt", tmp_path / "pre", tag="global_step2", config=config)
    a, b = (tmp_path / "uc" / "model.safetensors").read_bytes(), (tmp_path / "pre" / "model.safetensors").read_bytes()
    assert a == b
    r = hf_ckpt("verify", tmp_path / "uc", "--against", case / "ckpt" / "global_step2_universal")
    assert r.returncode == 0, r.stdout + r.stderr


def test_derived_info_classifies_like_autotp(engine_ckpt):
    """Our record, derived from shapes and the HF tp plan, sorts every parameter of AutoTP's own
    split into the same category as the record DeepSpeed's AutoTP wrote."""
    case = engine_ckpt("autotp-z1")
    states = load_rank_file(case / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt")
    autotp = states["universal_checkpoint_info"]
    local = {n: tuple(s) for g in states["param_shapes"] for n, s in g.items()}
    plans, full, embeddings = hf_plans_for(str(case / "config"))
    ours = derive_universal_checkpoint_info(local, full, tp_plans=plans, embeddings=embeddings, vocab_size=1001)

    def category(info, name):
        import re

        for key in ("tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns",
                    "vocabulary_parameter_patterns"):
            if any(re.search(p, name) for p in info.get(key, [])):
                return key
        return "dim 0"

    assert {n: category(ours, n) for n in local} == {n: category(autotp, n) for n in local}
    assert ours["original_vocab_size"] == autotp["original_vocab_size"] == 1001
    assert ours["universal_checkpoint_version"] == autotp["universal_checkpoint_version"]


def test_derive_refuses_an_ambiguous_split():
    with pytest.raises(ValueError, match="cannot tell the split dim"):
        derive_universal_checkpoint_info({"w": (2, 2)}, {"w": (4, 4)})
