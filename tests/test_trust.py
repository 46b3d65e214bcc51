"""Trust at the front door (issue 13, classes 1, 4, 5, 6, 7; docs/reliability.md).

Hostile or careless input never costs the user data, never reaches the terminal as a traceback or
as a file's contents, never runs code, and a plain Trainer checkpoint is not refused: the CLI in a
subprocess on real engine checkpoints (``tests/conftest.py``), the API called directly.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import REPO, assert_refused, hf_ckpt, leftovers, load_safetensors, tree_digest

pytestmark = pytest.mark.engine

TAG = "global_step2"
SECRET = "BEGIN-PRIVATE-KEY-do-not-share-4f1c"


@pytest.fixture
def z2(engine_ckpt, tmp_path):
    """A private copy of the ZeRO-2 case with its config.json beside it (a Trainer-like layout)."""
    case = engine_ckpt("z2-fp32")
    src = tmp_path / "work" / "src"
    shutil.copytree(case / "ckpt", src)
    shutil.copy(case / "config" / "config.json", src / "config.json")
    return src


@pytest.fixture
def secret(tmp_path):
    p = tmp_path / "id_rsa"
    p.write_text(SECRET + "\n")
    return p


# ---------------------------------------------------------------- 1. data loss

def _dst_cases(src):
    """name -> (destination as passed, cwd): each one is the source, holds it, or lies inside it."""
    link = src.parent / "link-to-src"
    link.symlink_to(src)
    return {"the source": (src, REPO), "its parent": (src.parent, REPO), "an ancestor": (src.parent.parent, REPO),
            "an empty string (cwd holds the source)": ("", src.parent), "'.' inside the source": (".", src),
            "a link to the source": (link, REPO), "inside the source": (src / "hf", REPO),
            "inside its tag dir": (src / TAG / "hf", REPO)}


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_destination_that_is_holds_or_lies_in_the_source_is_refused(z2, overwrite):
    """Today ``export SRC SRC --overwrite`` (or SRC's parent, or "" from an unset variable) swapped
    the source out and deleted it. Every spelling is refused before anything is written."""
    cases = _dst_cases(z2)
    before, listing = tree_digest(z2), sorted(os.listdir(z2.parent))
    for name, (dst, cwd) in cases.items():
        r = hf_ckpt("export", z2, dst, "--quiet", *overwrite, cwd=cwd)
        line = assert_refused(r)
        assert "source" in line or "empty path" in line, (name, line)
        assert tree_digest(z2) == before and sorted(os.listdir(z2.parent)) == listing, name
        assert leftovers(z2.parent) == [] and leftovers(z2) == [], name
    assert hf_ckpt("verify", _export_ok(z2, z2.parent.parent / "ok"), "--against", z2).returncode == 0


def _export_ok(src, dst, *extra):
    r = hf_ckpt("export", src, dst, "--quiet", *extra)
    assert r.returncode == 0, r.stderr
    return dst


def test_config_dir_as_destination_is_refused(z2, engine_ckpt, tmp_path):
    config = tmp_path / "config"
    shutil.copytree(engine_ckpt("z2-fp32") / "config", config)
    before = tree_digest(config)
    assert_refused(hf_ckpt("export", z2, config, "--config", config, "--overwrite"), match="config directory")
    assert tree_digest(config) == before


def test_api_and_parallel_writer_refuse_the_source_too(z2, monkeypatch):
    """The check lives in the writer's commit strategy (SiblingSwap), so every path gets it, not only the CLI."""
    from hf_ckpt_integrations import export_checkpoint
    from hf_ckpt_integrations.errors import DestinationError
    from hf_ckpt_integrations.parallel import write_plan_parallel
    from hf_ckpt_integrations.sources import build_plan

    before = tree_digest(z2)
    with pytest.raises(DestinationError, match="is the source"):
        export_checkpoint(z2, z2, overwrite=True)
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(DestinationError, match="contains the source"):
        write_plan_parallel(build_plan(z2), z2.parent, overwrite=True, quiet=True)
    assert tree_digest(z2) == before


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_overwrite_replaces_only_an_export(z2, tmp_path):
    """--overwrite on a directory holding a subdirectory (a save dir, a home, a project) is refused."""
    dst = tmp_path / "project"
    (dst / "src").mkdir(parents=True)
    (dst / "src" / "train.py").write_text("print('mine')\n")
    before = tree_digest(dst)
    line = assert_refused(hf_ckpt("export", z2, dst, "--overwrite"), match="holds a subdirectory")
    assert "--overwrite replaces only an export" in line
    assert tree_digest(dst) == before and leftovers(tmp_path) == []


def test_destination_symlink_is_resolved_and_nothing_stale_is_left(z2, tmp_path):
    """A destination that is a link to an earlier export: the export replaces the link's target,
    the link stays a link, and no temp entry is left next to either (today the swapped-out link
    was left behind as ``.link.hfckpt-tmp-PID``)."""
    real = _export_ok(z2, tmp_path / "exports" / "v1", "--dtype", "bf16")
    link = tmp_path / "current"
    link.symlink_to(real)
    _export_ok(z2, link, "--overwrite")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert load_safetensors(real / "model.safetensors")["lm_head.weight"].dtype == torch.float32
    assert leftovers(tmp_path) == [] and leftovers(real.parent) == []


def test_stale_sibling_removal_touches_only_what_a_writer_makes(z2, tmp_path):
    """Under the lock, ``.<dst>.hfckpt-tmp-*`` siblings are removed only when they are files, links
    (the link, never its target) or flat directories; anything else stays."""
    dst = tmp_path / "out"
    keep = tmp_path / ".out.hfckpt-tmp-1" / "nested"
    keep.mkdir(parents=True)
    (keep / "precious.txt").write_text("keep me")
    target = tmp_path / "target"
    target.mkdir()
    (target / "file").write_text("keep me too")
    (tmp_path / ".out.hfckpt-tmp-2").symlink_to(target)
    flat = tmp_path / ".out.hfckpt-tmp-3"
    flat.mkdir()
    (flat / "model.safetensors").write_bytes(b"partial")
    _export_ok(z2, dst)
    assert (keep / "precious.txt").read_text() == "keep me"
    assert (target / "file").read_text() == "keep me too"
    assert not os.path.lexists(tmp_path / ".out.hfckpt-tmp-2") and not flat.exists()


# ---------------------------------------------------------------- 4. one contract for every failure

def test_bad_options_and_arguments_give_one_error_line(z2, tmp_path):
    dst = tmp_path / "out"
    digest = tree_digest(z2)
    for args, match in [(["--max-shard-size", "banana"], "banana"), (["--max-shard-size", "0"], "not a size"),
                        (["--workers", "0"], "--workers 0"), (["--workers", "x"], "--workers"),
                        (["--dtype", "fp8"], "fp8"), (["--no-such-flag"], "--no-such-flag"),
                        (["--tag", "a\nb\x1b[31m"], "not a tag name")]:
        line = assert_refused(hf_ckpt("export", z2, dst, *args), match=match, dst=dst, src=z2, digest=digest)
        assert "\x1b" not in line
    assert_refused(hf_ckpt("export"), match="required")
    assert_refused(hf_ckpt(), match="required")
    assert_refused(hf_ckpt("frobnicate"), match="frobnicate")
    assert_refused(hf_ckpt("verify", dst), match="--against")


def test_api_raises_only_checkpoint_errors_for_bad_options(z2, tmp_path):
    from hf_ckpt_integrations import export_checkpoint
    from hf_ckpt_integrations.errors import CheckpointError

    for kwargs in [{"dtype": "fp8"}, {"dtype": torch.bfloat16}, {"max_shard_size": "banana"},
                   {"max_shard_size": -1}, {"workers": 0}, {"tag": 2}]:
        with pytest.raises(CheckpointError):
            export_checkpoint(z2, tmp_path / "out", **kwargs)
        assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("content, match", [(b"\0" * 16, "16 NUL bytes"), (b"", "holds nothing"),
                                            (b"glob\nal\x1b[2J", "not a tag name"),
                                            (b"../../etc", "not a tag name"), (b"\xff\xfe", "not UTF-8")])
def test_broken_latest_file(z2, tmp_path, content, match):
    """What a crash leaves (NULs, nothing), terminal escapes and paths: one line, content escaped."""
    (z2 / "latest").write_bytes(content)
    dst = tmp_path / "out"
    line = assert_refused(hf_ckpt("export", z2, dst), match=match, dst=dst)
    assert "\x1b" not in line and "\0" not in line


@pytest.mark.parametrize("name", ["latest", "config.json"])
def test_latest_or_config_linked_to_a_secret_is_never_echoed(z2, tmp_path, secret, name):
    """Today a ``latest`` linked to a private key printed the key in the error message."""
    (z2 / name).unlink()
    (z2 / name).symlink_to(secret)
    dst = tmp_path / "out"
    r = hf_ckpt("export", z2, dst) if name == "latest" else hf_ckpt("export", z2, dst, "--config", z2)
    line = assert_refused(r, match="symbolic link" if name == "latest" else "outside", dst=dst)
    assert SECRET not in r.stderr + r.stdout, line


@pytest.mark.parametrize("content, match", [("[]", "JSON list"), ("null", "JSON null"), ("not json", "unreadable"),
                                            ('{"tie_word_embeddings": ', "unreadable")])
def test_config_json_that_is_not_an_object(z2, tmp_path, content, match):
    (z2 / "config.json").write_text(content)
    dst = tmp_path / "out"
    assert_refused(hf_ckpt("export", z2, dst), match=match, dst=dst)


def _set(path, mutate):
    sd = torch.load(path, weights_only=False)
    mutate(sd)
    torch.save(sd, path)


_WRONG_TYPES = {
    "param_shapes of strings": ("mp_rank_00_model_states.pt", lambda sd: sd.__setitem__("param_shapes", ["x"])),
    "buffer_names an int": ("mp_rank_00_model_states.pt", lambda sd: sd.__setitem__("buffer_names", 5)),
    "shared_params an int": ("mp_rank_00_model_states.pt", lambda sd: sd.__setitem__("shared_params", 3)),
    "frozen_param_shapes a str": ("mp_rank_00_model_states.pt",
                                  lambda sd: sd.__setitem__("frozen_param_shapes", "abc")),
    "group_paddings a str": ("zero_pp_rank_0_mp_rank_00_optim_states.pt",
                             lambda sd: sd["optimizer_state_dict"].__setitem__("group_paddings", "ab")),
}


@pytest.mark.parametrize("case", sorted(_WRONG_TYPES))
def test_wrong_typed_metadata_fields(z2, tmp_path, case):
    """Each of these raised TypeError/AttributeError/ValueError from the planner (a traceback)."""
    fname, mutate = _WRONG_TYPES[case]
    _set(z2 / TAG / fname, mutate)
    dst = tmp_path / "out"
    digest = tree_digest(z2)
    assert_refused(hf_ckpt("export", z2, dst), dst=dst, src=z2, digest=digest)
    assert_refused(hf_ckpt("inspect", z2))


def test_unknown_model_type_and_auto_map_never_import_code(engine_ckpt, tmp_path):
    """A tensor-parallel checkpoint whose config names remote code: transformers used to prompt on
    stdin (a traceback without a terminal). Now no code is imported; the user is asked for --tp-rule."""
    case = engine_ckpt("tp-z2")
    config = tmp_path / "config"
    shutil.copytree(case / "config", config)
    marker = tmp_path / "PWNED"
    (config / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n")
    cfg = json.loads((config / "config.json").read_text())
    cfg.update(model_type="evil-nonesuch", auto_map={"AutoConfig": "evil.EvilConfig",
                                                     "AutoModelForCausalLM": "evil.EvilModel"})
    (config / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "out"
    assert_refused(hf_ckpt("export", case / "ckpt", dst, "--config", config), match="--tp-rule", dst=dst)
    assert not marker.exists()


@pytest.fixture
def hf_export(z2, tmp_path):
    """An HF directory (three shards and an index) exported from the ZeRO-2 case."""
    return _export_ok(z2, tmp_path / "hf", "--max-shard-size", "300KB")


def _header_file(path, header, data=b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_hf_dir_inputs_that_crashed(hf_export, tmp_path):
    """F8 dtypes, a list as weight_map, a weight_map naming ../ paths, and .safetensors files that are
    not: one error line each (all were tracebacks)."""
    index = hf_export / "model.safetensors.index.json"
    shard = hf_export / "model-00002-of-00003.safetensors"
    pristine = tmp_path / "pristine"
    shutil.copytree(hf_export, pristine)

    def case(mutate, match):
        shutil.rmtree(hf_export)
        shutil.copytree(pristine, hf_export)
        mutate()
        dst = tmp_path / "out"
        assert_refused(hf_ckpt("export", hf_export, dst), match=match, dst=dst)

    def weight_map(value):
        d = json.loads(index.read_text())
        d["weight_map"] = value(d["weight_map"])
        index.write_text(json.dumps(d))

    case(lambda: weight_map(list), "'weight_map' is not a mapping")
    weight_map(list)  # verify reads the export side the same way
    assert_refused(hf_ckpt("verify", hf_export, "--against", hf_export.parent / "work" / "src"),
                   match=str(hf_export))
    case(lambda: weight_map(lambda m: {k: "../../" + v for k, v in m.items()}), "not a file name")
    case(lambda: _header_file(shard, [1, 2]), str(hf_export))
    case(lambda: _header_file(shard, {"a": {"dtype": "F32", "shape": "x", "data_offsets": [0, 4]}}, b"1234"),
         str(hf_export))
    case(lambda: shard.write_bytes((2**40).to_bytes(8, "little") + b"x" * 64), str(shard))

    def f8():
        from safetensors.torch import save_file

        for p in hf_export.glob("model*"):
            p.unlink()
        save_file({"w": torch.zeros(4, dtype=torch.float8_e4m3fn)}, str(hf_export / "model.safetensors"))
    case(f8, str(hf_export))


def test_internal_error_is_exit_3_with_traceback_only_under_debug(z2, tmp_path, monkeypatch, capsys):
    """A bug (here: a planner that raises RuntimeError) is one ``error:`` line and exit 3."""
    from hf_ckpt_integrations import cli, sources

    def broken(*args, **kwargs):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(sources, "build_plan", broken)
    assert cli.main(["export", str(z2), str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: internal error (RuntimeError: simulated bug)")
    for argv in (["--debug", "export", str(z2), str(tmp_path / "out")],
                 ["export", str(z2), str(tmp_path / "out"), "--debug"]):
        assert cli.main(argv) == 3
        err = capsys.readouterr().err
        assert "Traceback" in err and len([x for x in err.splitlines() if x.startswith("error:")]) == 1
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 5. signals

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_like_ctrl_c(z2, tmp_path, sig):
    """Caught mid-write (SIGSTOP while its staging directory exists), sent ``sig``, then resumed:
    it removes its staging directory and lock, exits 128+sig with one error line."""
    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_ckpt_integrations", "export", str(z2), str(dst), "--max-shard-size", "8KB",
           "--quiet"]
    for attempt in range(5):  # an attempt whose export finished before the SIGSTOP proves nothing: again
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        caught = False
        try:
            deadline = time.monotonic() + 120
            while not any(".hfckpt-tmp-" in n for n in leftovers(tmp_path)) and proc.poll() is None:
                assert time.monotonic() < deadline, "the export never created its staging directory"
                time.sleep(0.002)
            proc.send_signal(signal.SIGSTOP)
            caught = proc.poll() is None and any(".hfckpt-tmp-" in n for n in leftovers(tmp_path))
            if caught:
                proc.send_signal(sig)
        finally:
            proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=120)
        if caught:
            break
        shutil.rmtree(dst, ignore_errors=True)
    assert caught, "the export always finished before it could be stopped"
    lines = err.splitlines()
    assert proc.returncode == 128 + sig, (proc.returncode, err)
    assert len(lines) == 1 and lines[0].startswith(f"error: stopped by {signal.Signals(sig).name}"), err
    assert not dst.exists() and leftovers(tmp_path) == []


# ---------------------------------------------------------------- 6. exfiltration

def test_config_files_linked_out_of_the_tree_are_not_copied(z2, tmp_path, secret):
    """A ``tokenizer.json`` linked to a private key was copied into the export (which users upload).
    Now it is skipped with one ``warning:`` line; a link that stays inside the tree is copied."""
    (z2 / "tokenizer.json").symlink_to(secret)
    (z2 / "vocab").mkdir()
    (z2 / "vocab" / "merges.txt").write_text("a b\n")
    (z2 / "merges.txt").symlink_to(z2 / "vocab" / "merges.txt")
    dst = tmp_path / "out"
    r = hf_ckpt("export", z2, dst, "--quiet")
    assert r.returncode == 0, r.stderr
    warnings = r.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "tokenizer.json" in warnings[0], r.stderr
    assert not (dst / "tokenizer.json").exists()
    assert (dst / "merges.txt").read_text() == "a b\n" and not (dst / "merges.txt").is_symlink()
    assert all(SECRET.encode() not in p.read_bytes() for p in dst.iterdir())


# ---------------------------------------------------------------- 7. false refusals

def test_plain_trainer_checkpoint_exports_bitwise(engine_ckpt, tmp_path):
    """A Trainer ``checkpoint-N`` without DeepSpeed: its optimizer.pt, rng_state.pth (numpy inside)
    and training_args.bin are not weights and are not unpickled; the export is model.safetensors."""
    ckpt = engine_ckpt("trainer-plain") / "run" / "checkpoint-2"
    assert {"optimizer.pt", "rng_state.pth", "training_args.bin", "scheduler.pt"} <= {p.name for p in ckpt.iterdir()}
    before = tree_digest(ckpt)
    dst = _export_ok(ckpt, tmp_path / "out")
    want, got = load_safetensors(ckpt / "model.safetensors"), load_safetensors(dst / "model.safetensors")
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert (dst / "config.json").exists() and (dst / "generation_config.json").exists()
    assert hf_ckpt("verify", dst, "--against", ckpt).returncode == 0
    r = hf_ckpt("inspect", ckpt)
    assert r.returncode == 0 and "optimizer.pt" not in r.stdout, r.stderr
    assert tree_digest(ckpt) == before


def test_pipeline_parallel_checkpoint_is_named(tmp_path):
    """``PipelineModule`` saves (layer files beside per-stage rank files) are named, not reported as a
    mix of saves. A layout of file names is enough: it is refused before any file is read."""
    tag = tmp_path / "pp" / TAG
    tag.mkdir(parents=True)
    (tmp_path / "pp" / "latest").write_text(TAG)
    names = ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt",
             "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt",
             *(f"layer_{i:02d}-model_00-model_states.pt" for i in range(4))]
    for n in names:
        (tag / n).write_bytes(b"")
    dst = tmp_path / "out"
    assert_refused(hf_ckpt("export", tmp_path / "pp", dst), match="pipeline-parallel", dst=dst)


def test_zero2_model_states_in_a_zero3_tag(engine_ckpt, tmp_path):
    """A ZeRO-2 ``mp_rank_00_model_states.pt`` copied into a ZeRO-3 tag: named as two saves mixed
    (it was a TypeError traceback)."""
    src = tmp_path / "src"
    shutil.copytree(engine_ckpt("z3-fp32") / "ckpt", src)
    shutil.copy(engine_ckpt("z2-fp32") / "ckpt" / TAG / "mp_rank_00_model_states.pt", src / TAG)
    dst = tmp_path / "out"
    digest = tree_digest(src)
    assert_refused(hf_ckpt("export", src, dst, "--config", engine_ckpt("z3-fp32") / "config"),
                   match="files from different saves are mixed", dst=dst, src=src, digest=digest)
