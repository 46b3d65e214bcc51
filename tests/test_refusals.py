"""Bad input gets one clear `error:` line and exit 2; nothing is written; the source is unchanged."""

import os
import shutil
import sys

import pytest
import torch

from helpers import export_refused, hf_ckpt

pytestmark = pytest.mark.engine


@pytest.fixture
def z2(engine_ckpt, tmp_path):
    """A private copy of the ZeRO-2 case (tests may damage it)."""
    case = engine_ckpt("z2-fp32")
    src = tmp_path / "src"
    shutil.copytree(case / "ckpt", src)
    return src, case / "config"


def _tag(src):
    return src / "global_step2"


def _export_refused(src, tmp_path, *extra, match):
    return export_refused(src, tmp_path / "out", *extra, match=match)


def _optim(src, rank=0):
    return _tag(src) / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def test_zero_byte_file(z2, tmp_path):
    src, config = z2
    _optim(src).write_bytes(b"")
    line = _export_refused(src, tmp_path, "--config", config, match="empty file")
    assert str(_optim(src)) in line


def test_truncated_zip(z2, tmp_path):
    src, config = z2
    data = _optim(src, 1).read_bytes()
    _optim(src, 1).write_bytes(data[: len(data) // 2])
    _export_refused(src, tmp_path, "--config", config, match=str(_optim(src, 1)))


def test_not_a_torch_checkpoint(z2, tmp_path):
    src, config = z2
    _optim(src).write_text("hello, I am a text file\n")
    _export_refused(src, tmp_path, "--config", config, match="not a torch zip checkpoint")


def test_missing_rank_file(z2, tmp_path):
    src, config = z2
    _optim(src, 1).unlink()
    _export_refused(src, tmp_path, "--config", config, match="partition_count")


def test_latest_names_a_missing_tag(z2, tmp_path):
    src, config = z2
    (src / "latest").write_text("global_step999")
    _export_refused(src, tmp_path, "--config", config, match="global_step999")


def test_tag_that_does_not_exist(z2, tmp_path):
    src, config = z2
    _export_refused(src, tmp_path, "--config", config, "--tag", "nope", match="tag 'nope' does not exist")


def test_swapped_rank_files_refused_by_recorded_offsets(z2, tmp_path):
    src, config = z2
    a, b = _optim(src, 0), _optim(src, 1)
    tmp = a.with_suffix(".tmp")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    _export_refused(src, tmp_path, "--config", config, match="param_slice_mappings")


def test_destination_exists(z2, tmp_path):
    src, config = z2
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = hf_ckpt("export", src, dst, "--config", config)
    assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
    assert (dst / "keep.txt").read_text() == "mine"
    r = hf_ckpt("export", src, dst, "--config", config, "--overwrite", "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("kind", ["os.system", "builtins.eval", "unknown class"])
def test_malicious_pickle_refused_and_never_run(z2, tmp_path, kind):
    src, config = z2
    marker = tmp_path / "pwned"
    if kind == "os.system":
        payload = _Payload(marker)
    elif kind == "builtins.eval":
        payload = _EvalPayload(marker)
    else:
        payload = _Unknown()
    # A real optimizer file with one extra entry that runs code when unpickled by torch.load.
    obj = {"optimizer_state_dict": {"zero_stage": 2, "x": payload}}
    torch.save(obj, _optim(src))
    line = _export_refused(src, tmp_path, "--config", config, match="refused for safety")
    assert "corrupt" not in line
    assert not marker.exists(), "the payload ran"
    r = hf_ckpt("inspect", src)
    assert r.returncode == 2 and "refused for safety" in r.stderr
    assert not marker.exists()


class _EvalPayload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import builtins

        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


class _Unknown:
    pass


def test_export_works_without_deepspeed_or_torch_imports(engine_ckpt, tmp_path):
    """The offline exporter never needs DeepSpeed; the fp32 byte copy itself never imports torch.
    (With a config.json on transformers 5 the *plan* imports transformers to derive the Hub layout,
    docs/performance.md; without one the whole export is torch-free.)"""
    import subprocess

    case = engine_ckpt("z3-fp32")
    for config in (True, False):
        dst = tmp_path / f"out-{config}"
        args = [str(case / "ckpt"), str(dst), "--quiet"] + (["--config", str(case / "config")] if config else [])
        code = (
            "import sys\n"
            "sys.modules['deepspeed'] = None  # importing deepspeed now raises ImportError\n"
            "from hf_ckpt_integrations.cli import main\n"
            f"rc = main(['export', *{args!r}])\n"
            f"assert {config!r} or 'torch' not in sys.modules, 'torch was imported on the byte-copy path'\n"
            "sys.exit(rc)\n"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert (dst / "model.safetensors").exists()
        assert hf_ckpt("verify", dst, "--against", case / "ckpt").returncode == 0


def test_read_only_source_and_no_config_warning(engine_ckpt, tmp_path):
    case = engine_ckpt("z2-fp32")
    src = tmp_path / "ro"
    shutil.copytree(case / "ckpt", src)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        r = hf_ckpt("export", src, tmp_path / "out", "--quiet")
        assert r.returncode == 0, r.stderr
        assert "warning:" in r.stderr and "--config" in r.stderr
    finally:
        for p in [src, *src.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
