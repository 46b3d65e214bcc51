"""One contract for every failure: a bad option or argument is one ``error:`` line and exit 2, the API
raises only CheckpointError subclasses, an internal error is exit 3 with a traceback only under
``--debug``; and what must export is not refused (a plain Trainer checkpoint, a read-only source, no
DeepSpeed installed). The CLI in subprocesses on engine checkpoints.
"""

import shutil
import subprocess
import sys

import pytest
import torch

from helpers import assert_refused, export, hf_ckpt, leftovers, load_safetensors, tree_digest


# ---------------------------------------------------------------- 4. one contract for every failure

def test_bad_options_and_arguments_give_one_error_line(z2_trainer, tmp_path):
    dst = tmp_path / "out"
    digest = tree_digest(z2_trainer)
    for args, match in [(["--max-shard-size", "banana"], "banana"), (["--max-shard-size", "0"], "not a size"),
                        (["--workers", "0"], "--workers 0"), (["--workers", "x"], "--workers"),
                        (["--dtype", "fp8"], "fp8"), (["--no-such-flag"], "--no-such-flag"),
                        (["--tag", "a\nb\x1b[31m"], "not a tag name")]:
        line = assert_refused(hf_ckpt("export", z2_trainer, dst, *args), match=match, dst=dst, src=z2_trainer, digest=digest)
        assert "\x1b" not in line
    assert_refused(hf_ckpt("export"), match="required")
    assert hf_ckpt().returncode == 0  # nothing asked: the help (tests/cli/test_cli_front_door.py)
    assert_refused(hf_ckpt("frobnicate"), match="frobnicate")
    assert_refused(hf_ckpt("verify", dst), match="--against")


def test_api_raises_only_checkpoint_errors_for_bad_options(z2_trainer, tmp_path):
    from hf_ckpt_integrations import export_checkpoint
    from hf_ckpt_integrations.errors import CheckpointError

    for kwargs in [{"dtype": "fp8"}, {"dtype": torch.int8}, {"max_shard_size": "banana"},
                   {"max_shard_size": -1}, {"workers": 0}, {"tag": 2}]:
        with pytest.raises(CheckpointError):
            export_checkpoint(z2_trainer, tmp_path / "out", **kwargs)
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_internal_error_is_exit_3_with_traceback_only_under_debug(z2_trainer, tmp_path, monkeypatch, capsys):
    """A bug (here: a planner that raises RuntimeError) is one ``error:`` line and exit 3."""
    from hf_ckpt_integrations import cli, sources

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(sources, "build_plan", broken)
    assert cli.main(["export", str(z2_trainer), str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: internal error (RuntimeError: simulated bug)")
    for argv in (["--debug", "export", str(z2_trainer), str(tmp_path / "out")],
                 ["export", str(z2_trainer), str(tmp_path / "out"), "--debug"]):
        assert cli.main(argv) == 3
        err = capsys.readouterr().err
        assert "Traceback" in err and len([x for x in err.splitlines() if x.startswith("error:")]) == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 7. false refusals

def test_plain_trainer_checkpoint_exports_bitwise(engine_ckpt, tmp_path):
    """A Trainer ``checkpoint-N`` without DeepSpeed: its optimizer.pt, rng_state.pth (numpy inside)
    and training_args.bin are not weights and are not unpickled; the export is model.safetensors."""
    ckpt = engine_ckpt("trainer-plain") / "run" / "checkpoint-2"
    assert {"optimizer.pt", "rng_state.pth", "training_args.bin", "scheduler.pt"} <= {p.name for p in ckpt.iterdir()}
    before = tree_digest(ckpt)
    dst = tmp_path / "out"
    export(ckpt, dst, "--quiet")
    want, got = load_safetensors(ckpt / "model.safetensors"), load_safetensors(dst / "model.safetensors")
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert (dst / "config.json").exists() and (dst / "generation_config.json").exists()
    assert hf_ckpt("verify", dst, "--against", ckpt).returncode == 0
    r = hf_ckpt("inspect", ckpt)
    assert r.returncode == 0 and "optimizer.pt" not in r.stdout, r.stderr
    assert tree_digest(ckpt) == before


def test_export_works_without_deepspeed_or_torch_imports(engine_ckpt, tmp_path):
    """The offline exporter never needs DeepSpeed; the fp32 byte copy itself never imports torch.
    (With a config.json on transformers 5 the *plan* imports transformers to derive the Hub layout,
    docs/performance.md; without one the whole export is torch-free.)"""
    case = engine_ckpt("z3-fp32")
    for config in (True, False):
        dst = tmp_path / f"out-{config}"
        args = [str(case / "ckpt"), str(dst), "--quiet"] + (["--config", str(case / "config")] if config
                                                             else ["--weights-only"])
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


def test_read_only_source_and_no_config_refusal(engine_ckpt, tmp_path):
    """A read-only source exports; with no config.json anywhere the export is refused naming --config
    (from_pretrained could not load it), unless --weights-only asks for the weights alone."""
    case = engine_ckpt("z2-fp32")
    src = tmp_path / "ro"
    shutil.copytree(case / "ckpt", src)
    for p in [src, *src.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        assert_refused(hf_ckpt("export", src, tmp_path / "out", "--quiet"), match=("--config", "--weights-only"),
                       dst=tmp_path / "out")
        r = export(src, tmp_path / "out", "--quiet", "--weights-only")
        r = hf_ckpt("export", src, tmp_path / "out2", "--quiet", "--config", case / "config" / "config.json")
        assert r.returncode == 0 and (tmp_path / "out2" / "config.json").is_file(), r.stderr
    finally:
        for p in [src, *src.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
