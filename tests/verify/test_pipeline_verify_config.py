"""`hf-ckpt verify DST --against SRC` of a pipeline export without --config: a pipeline save keeps no
HF config beside it (GPT-NeoX keeps its YAML), and the HF names come from one, so verify reads the
config.json the export wrote into DST (a config beside the source, or --config, still comes first)."""

import json

import pytest

from helpers import hf_ckpt

pytestmark = pytest.mark.engine


def test_verify_takes_the_exports_own_config(engine_ckpt, tmp_path):
    from hf_ckpt_integrations import export_checkpoint, verify_checkpoint

    run = engine_ckpt("pipe-tp2-fp32-par")
    dst = tmp_path / "hf"
    export_checkpoint(run / "ckpt", dst, config=str(run / "config"))
    v = hf_ckpt("verify", dst, "--against", run / "ckpt")
    assert v.returncode == 0 and "28 tensors bitwise equal" in v.stdout, v.stdout[-2000:] + v.stderr[-2000:]
    # It is DST's config that decides: flipped to the sequential residual, the summed row-parallel
    # biases no longer match what that config says they are.
    c = json.loads((dst / "config.json").read_text())
    c["use_parallel_residual"] = False
    (dst / "config.json").write_text(json.dumps(c))
    report = verify_checkpoint(dst, run / "ckpt")
    assert not report.ok and any("attention.dense.bias" in d for d in report.differences), report.differences
