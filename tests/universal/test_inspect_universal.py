"""`hf-ckpt inspect --universal`: what `hf-ckpt universal` would write, from the universal writer's
own plan (committed checkpoints of real DeepSpeed engines, no engine run)."""

import json

import pytest

from helpers import REPO, hf_ckpt
from hf_ckpt_integrations.universal_writer import plan_universal, universal_summary

FIXTURES = REPO / "tests" / "fixtures" / "deepspeed"


@pytest.mark.parametrize("case,merge", [("0.14.4/zero2-replica", "replicas: one copy, the others checked"),
                                        ("0.18.9/zero3", "one copy")])
def test_inspect_shows_the_universal_plan(case, merge):
    src, config = FIXTURES / case / "ckpt", FIXTURES / case
    r = hf_ckpt("inspect", src, "--config", config, "--universal", "--json")
    assert r.returncode == 0, r.stderr
    shown = json.loads(r.stdout)["universal"]
    plan, states, _ = plan_universal(str(src), config=str(config))
    assert shown == json.loads(json.dumps(universal_summary(plan, states)))
    assert shown["optimizer_states"] == ["exp_avg", "exp_avg_sq", "step"]
    assert {p["merge"] for p in shown["parameters"]} == {merge}
    assert all(p["states"] == ["fp32", "exp_avg", "exp_avg_sq", "step"] for p in shown["parameters"])
    text = hf_ckpt("inspect", src, "--config", config, "--universal")
    assert text.returncode == 0, text.stderr
    lines = [ln for ln in text.stdout.splitlines() if ln.startswith("universal")]
    n = len(shown["parameters"])
    assert lines[0].split(None, 1)[1] == f"{n} parameter(s) x fp32 + exp_avg, exp_avg_sq, step"
    assert lines[1].split()[1:3] == [str(n), "by"] and merge in lines[1]


def test_inspect_without_the_flag_shows_no_universal_plan():
    src = FIXTURES / "0.18.9" / "zero3"
    r = hf_ckpt("inspect", src / "ckpt", "--config", src, "--json")
    assert r.returncode == 0 and "universal" not in json.loads(r.stdout)


def test_inspect_universal_of_an_hf_directory_is_refused(committed_zero2, tmp_path):
    hf = tmp_path / "hf"
    assert hf_ckpt("export", committed_zero2 / "ckpt", hf, "--config", committed_zero2).returncode == 0
    r = hf_ckpt("inspect", hf, "--universal")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "DeepSpeed ZeRO save" in r.stderr, r.stderr
