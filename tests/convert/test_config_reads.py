"""One export, one read of config.json: every pass (tied weights, the Hub layout and its meta
model, the fp32-kept modules, the TP merge rules) takes the config from the export's
``PlanContext``, which reads and validates it once (``guards.read_config``)."""

import shutil

import pytest

from hf_ckpt_integrations import export_checkpoint, guards, inspect_checkpoint
from helpers import REPO

FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "0.19.8" / "zero2-palign"


@pytest.fixture
def reads(monkeypatch, tmp_path):
    """The directories whose config.json was read, in order (an empty answer cache: every derivation runs)."""
    monkeypatch.setenv("HF_CKPT_CACHE", str(tmp_path / "answer-cache"))
    seen = []
    real = guards.read_config
    monkeypatch.setattr(guards, "read_config", lambda d: seen.append(d) or real(d))
    return seen


def _checkpoint(tmp_path):
    shutil.copytree(FIXTURE / "ckpt", tmp_path / "ckpt")
    shutil.copy(FIXTURE / "config.json", tmp_path / "ckpt" / "config.json")
    return tmp_path / "ckpt"


def test_inspect_reads_the_config_once(tmp_path, reads):
    """inspect also shows the fp32-kept modules of the config's class (for every dtype): from the
    plan's one read, not a second one."""
    info = inspect_checkpoint(_checkpoint(tmp_path))
    assert info["keep_fp32"] is not None  # the lists were derived, from that read
    assert len(reads) == 1, reads


@pytest.mark.engine
def test_a_tensor_parallel_export_reads_the_config_once(engine_ckpt, tmp_path, reads):
    """Two model-parallel ranks merged by the HF tp plan of the config's class: the rules' meta model
    is built from the export's one read (bf16: the fp32-kept modules too)."""
    case = engine_ckpt("autotp-z2")
    export_checkpoint(case / "ckpt", tmp_path / "hf", config=str(case / "config"), dtype="bf16")
    assert len(reads) == 1, reads
