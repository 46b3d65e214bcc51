"""What a new user types first: help that names every input kind, options spelled as transformers,
torch and DeepSpeed users spell them, and messages that name only options the command has.

Fast: the CLI's parser and ``main([...])`` in process, or ``python -m hf_ckpt_integrations`` in a
subprocess, on tiny synthetic DeepSpeed saves (benchmarks/synth_ckpt.py); no engine run.
"""

import ast
import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, assert_refused, export, hf_ckpt
from hf_ckpt_integrations import cli, export_checkpoint
from hf_ckpt_integrations.errors import CheckpointError
from hf_ckpt_integrations.supported_inputs import INPUTS, markdown_table

sys.path.insert(0, str(REPO / "benchmarks"))
from synth_ckpt import make_checkpoint  # noqa: E402

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9](?!\w)")  # not torchrun's --nproc_per_node


def _commands():
    parser = cli.build_parser()
    return {name: {o for a in p._actions for o in a.option_strings} for name, p in parser.commands.items()}


@pytest.fixture(scope="module")
def ds_save(tmp_path_factory):
    """A tiny ZeRO-2 save of 2 ranks with its config.json (a DeepSpeed save dir)."""
    src = tmp_path_factory.mktemp("synth") / "ckpt"
    make_checkpoint(src, stage=2, dp=2, layers=1, hidden=8, vocab=40, heads=2, kv_heads=1)
    return src


@pytest.fixture
def no_config_save(ds_save, tmp_path):
    """The same save without any config.json."""
    src = tmp_path / "noconf"
    shutil.copytree(ds_save, src)
    (src / "config.json").unlink()
    return src


# ------------------------------------------------------------------ one table of input kinds

def test_every_input_kind_is_in_help_readme_and_docs():
    for name in ("export", "inspect"):
        text = cli.build_parser().commands[name].format_help()
        for k in INPUTS:
            assert k.kind in text, (name, k.kind)
    assert markdown_table("docs/") in (REPO / "README.md").read_text(), "README's Supported inputs table is stale"
    assert "<!-- supported-inputs -->" in (REPO / "docs" / "inputs.md").read_text()
    for k in INPUTS:
        assert (REPO / "docs" / k.page).is_file(), k.page
    kinds = " ".join(k.kind + k.looks_like for k in INPUTS)
    for needed in ("DCP", "verl", "SkyRL", "Accelerate", "universal", "HF directory", "PEFT", "pipeline",
                   "ColossalAI", "legacy torch.save", "checkpoint-N", "tag dir"):
        assert needed in kinds + " ".join(k.written_by for k in INPUTS), needed


def test_missing_source_points_to_the_table(tmp_path):
    line = assert_refused(hf_ckpt("inspect", tmp_path / "nope"), match="does not exist")
    assert "hf-ckpt export --help" in line


# ------------------------------------------------------------------ sizes, dtypes, config, version

@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("5GiB", 5 * 2**30),
                                       ("500MiB", 500 * 2**20), ("5000000", 5_000_000), (5_000_000, 5_000_000)])
def test_max_shard_size_as_save_pretrained_takes_it_and_byte_counts(text, size):
    from hf_ckpt_integrations.writer import check_max_shard_size

    assert check_max_shard_size(text) == size


def test_byte_count_shard_size_exports(ds_save, tmp_path):
    r = export(ds_save, tmp_path / "out", "--max-shard-size", "5000", "--quiet")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # 5000 bytes: several shards


@pytest.mark.parametrize("name,short", [("float32", "fp32"), ("float", "fp32"), ("bfloat16", "bf16"),
                                        ("float16", "fp16"), ("half", "fp16"), ("bf16", "bf16")])
def test_torch_dtype_names_in_the_cli(name, short):
    assert cli.build_parser().parse_args(["export", "a", "b", "--dtype", name]).dtype == short


def test_torch_dtype_objects_in_the_api(ds_save, tmp_path):
    import torch
    from safetensors import safe_open

    export_checkpoint(ds_save, tmp_path / "out", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    with pytest.raises(CheckpointError, match="unknown dtype"):
        export_checkpoint(ds_save, tmp_path / "out2", dtype=torch.int8)


def test_config_may_be_the_file_or_its_directory(no_config_save, ds_save, tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    shutil.copy(ds_save / "config.json", conf / "config.json")
    for i, given in enumerate([conf / "config.json", conf]):
        r = export(no_config_save, tmp_path / f"out{i}", "--config", given, "--quiet")
        assert (tmp_path / f"out{i}" / "config.json").is_file()
    (conf / "other.json").write_text("{}")
    assert_refused(hf_ckpt("export", no_config_save, tmp_path / "out9", "--config", conf / "other.json"),
                   match="config.json", dst=tmp_path / "out9")


def test_version_and_bare_command(capsys):
    from hf_ckpt_integrations import __version__

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hf-ckpt {__version__}"
    r = hf_ckpt()
    assert r.returncode == 0 and r.stderr == "" and "usage: hf-ckpt" in r.stdout and "export" in r.stdout


# ------------------------------------------------------------------ messages that match behaviour

def test_unknown_option_points_to_the_command_help(tmp_path):
    for command in (["export", "a", "b"], ["inspect", "a"], ["verify", "a", "--against", "b"], ["universal", "a", "b"]):
        line = assert_refused(hf_ckpt(*command, "--no-such-flag"), match="--no-such-flag")
        assert f"(see hf-ckpt {command[0]} --help)" in line


def test_existing_destination_names_the_option_as_the_caller_spells_it(ds_save, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    line = assert_refused(hf_ckpt("export", ds_save, dst), match="already exists")
    assert "--overwrite" in line and "overwrite=True" not in line
    with pytest.raises(CheckpointError) as e:
        export_checkpoint(ds_save, dst)
    assert "overwrite=True" in str(e.value) and "--overwrite" not in str(e.value)


def test_universal_onto_an_existing_destination_names_no_missing_option(z2_trainer, tmp_path):
    """Engine checkpoint (cached z2-fp32): the synthetic saves hold no optimizer states to resume from."""
    dst = tmp_path / "uc"
    dst.mkdir()
    line = assert_refused(hf_ckpt("universal", z2_trainer, dst), match="already exists")
    assert "overwrite" not in line and "remove it" in line


def test_no_config_is_refused_unless_weights_only(no_config_save, tmp_path):
    line = assert_refused(hf_ckpt("export", no_config_save, tmp_path / "out"), match="--config",
                          dst=tmp_path / "out")
    assert "--weights-only" in line
    with pytest.raises(CheckpointError, match=r"config=PATH.*weights_only=True"):
        export_checkpoint(no_config_save, tmp_path / "out")
    r = hf_ckpt("export", no_config_save, tmp_path / "out", "--weights-only")
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (tmp_path / "out" / "config.json").exists()
    export_checkpoint(no_config_save, tmp_path / "api", weights_only=True)


def test_trainer_output_dir_names_its_newest_checkpoint(ds_save, tmp_path):
    out = tmp_path / "output_dir"
    for step in (2, 4, 10):
        shutil.copytree(ds_save, out / f"checkpoint-{step}")
    (out / "runs").mkdir()
    line = assert_refused(hf_ckpt("export", out, tmp_path / "hf"), match=str(out / "checkpoint-10"))
    assert "output_dir" in line and len(line) < 300, line
    assert_refused(hf_ckpt("inspect", out), match="checkpoint-10")


def test_every_flag_a_message_names_exists_in_the_cli():
    """Static walk: every ``--flag`` in a string of the package (and every ``option("name")``) is an
    option of a command; those in modules only one command reaches are options of that command."""
    commands = _commands()
    top = {o for a in cli.build_parser()._actions for o in a.option_strings}
    everywhere = set().union(top, *commands.values())
    only = {"universal_writer.py": {"universal"}, "peft_merge.py": {"export"}, "export.py": {"export"}}
    named = []
    for path in sorted((REPO / "hf_ckpt_integrations").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # prose, not messages
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                named += [(path, f) for f in FLAG.findall(node.value)]
            elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "option" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                named.append((path, "--" + node.args[0].value.replace("_", "-")))
    assert len(named) > 20
    for path, flag in named:
        assert flag in everywhere, f"{path.relative_to(REPO)} names {flag}, which no hf-ckpt command has"
        for command in only.get(path.name, ()):
            assert flag in commands[command], f"{path.relative_to(REPO)} names {flag}; hf-ckpt {command} lacks it"


@pytest.mark.parametrize("argv,setup", [
    (["export", "{src}", "{dst}"], "dst"),
    (["export", "{noconf}", "{dst}"], None), (["export", "{src}", "{dst}", "--base", "x"], None),
    (["export", "{src}", "{dst}", "--max-shard-size", "lots"], None), (["export", "{src}", "{dst}", "--workers", "0"], None),
    (["export", "{src}", "{dst}", "--merge-adapters"], None), (["inspect", "{outdir}"], None),
    (["universal", "{outdir}", "{dst}"], None), (["verify", "{dst}", "--against", "{outdir}"], "dst"),
    (["export", "{src}", "{dst}", "--config", "{src}/latest"], None),
    (["inspect", "{src}", "--source-option", "nope=1"], None),
])
def test_refusals_name_only_options_of_their_command(argv, setup, ds_save, no_config_save, tmp_path):
    """Dynamic walk: each refusal's ``error:`` line names only flags its own command has."""
    outdir = tmp_path / "output_dir"
    shutil.copytree(ds_save, outdir / "checkpoint-3")
    paths = {"src": ds_save, "dst": tmp_path / "dst", "noconf": no_config_save, "outdir": outdir}
    if setup == "dst":
        paths["dst"].mkdir()
    args = [a.format(**paths) for a in argv]
    _names_only_its_options(argv[0], assert_refused(hf_ckpt(*args)))


def _names_only_its_options(command, line):
    flags = set(FLAG.findall(line))
    assert flags <= _commands()[command], (line, flags - _commands()[command])


def test_universal_refusals_name_only_its_options(z2_trainer, tmp_path):
    dst = tmp_path / "dst"
    for args in (["--config", z2_trainer / "latest"], ["--tp-rule", "x"], ["--tag", "nope"]):
        _names_only_its_options("universal", assert_refused(hf_ckpt("universal", z2_trainer, dst, *args)))
    dst.mkdir()
    _names_only_its_options("universal", assert_refused(hf_ckpt("universal", z2_trainer, dst)))


# ------------------------------------------------------------------ progress and summary

def _on_a_terminal(*args):
    """Run the CLI with stderr on a pseudo-terminal; return (exit code, what the terminal got)."""
    import fcntl
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([sys.executable, "-m", "hf_ckpt_integrations", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "TQDM_MININTERVAL": "0"})
    os.close(slave)
    got = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    proc.wait(timeout=300)
    os.close(master)
    return proc.returncode, got.decode(errors="replace")


def _shows_progress(args, desc):
    code, term = _on_a_terminal(*args)
    assert code == 0, term
    assert desc in term and "%|" in term, (args[0], term[-500:])


def test_export_and_verify_show_progress_on_a_terminal_only(ds_save, tmp_path):
    hf = tmp_path / "hf"
    _shows_progress(["export", ds_save, hf], "export")
    _shows_progress(["verify", hf, "--against", ds_save], "verifying")
    r = hf_ckpt("verify", hf, "--against", ds_save)  # a pipe: no bar
    assert r.returncode == 0 and r.stderr == "", r.stderr


def test_universal_and_its_verify_show_progress_on_a_terminal(z2_trainer, tmp_path):
    uc = tmp_path / "uc"
    _shows_progress(["universal", z2_trainer, uc], "writing")
    _shows_progress(["verify", uc, "--against", z2_trainer], "verifying")


def test_export_summary_time_is_the_command_time(monkeypatch, capsys, tmp_path):
    """The summary's seconds include planning (a first run fills the Hub-layout cache), not only the write."""
    import time

    from hf_ckpt_integrations import api

    clock = iter(range(0, 1000, 7))  # each reading of the clock: 7 s later
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(clock)))
    monkeypatch.setattr(api, "export_checkpoint", lambda *a, **k: {
        "destination": "out", "shards": 1, "tensor_bytes": 10, "bytes_on_disk": 20, "seconds": 0.58, "notes": []})
    assert cli.main(["export", str(tmp_path), str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "7.00 s (6.42 s planning, 0.58 s writing)" in out, out


# ------------------------------------------------------------------ demo and notebooks

def test_demo_prints_step_lines_off_a_terminal_and_runs_export_loud():
    sys.path.insert(0, str(REPO / "demo"))
    import run_demo

    tree = ast.parse((REPO / "demo" / "run_demo.py").read_text())
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert "--quiet" not in strings
    lines = []
    steps = run_demo.Steps(3, tty=False, echo=lines.append)
    steps.start("train")
    steps.done()
    steps.start("export")
    assert lines == ["[1/3] train ...", "[2/3] export ..."]


def test_notebook_outputs_stay_out_of_git():
    """`make notebooks` runs them headless into build/notebooks/ (ignored); the notebooks' own work
    folders (nb_*) are ignored wherever jupyter runs them."""
    assert "notebooks:" in (REPO / "Makefile").read_text()
    for path in ("notebooks/nb_doctor/x", "build/notebooks/doctor.ipynb"):
        r = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert r.returncode == 0, f"{path} is not ignored"
