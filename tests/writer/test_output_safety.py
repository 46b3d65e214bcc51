"""Where an export may write (``guards.check_destination``, ``commit.SiblingSwap``): never the source,
a directory holding it or one inside it, nor the config directory; ``--overwrite`` replaces only an
earlier export (a flat directory of files). Each refusal leaves the source and the destination as
they were. On a private copy of a committed DeepSpeed checkpoint, through the API: no engine run.
"""

import os
import shutil

import pytest
import torch

from helpers import REPO, assert_refused, export, hf_ckpt, leftovers, load_safetensors, tree_digest

from conftest import SECRET

from hf_ckpt_integrations import api
from hf_ckpt_integrations.errors import DestinationError


def _reason(err, dst) -> str:
    """The reason after the destination's name: which check refused (the path may hold any word)."""
    text = str(err)
    assert text.startswith(f"{dst}: "), text
    return text[len(f"{dst}: "):]


def _refused(src, dst, *, config=None, overwrite=False, watch=None):
    """Export ``src`` to ``dst`` is refused with a DestinationError; ``watch`` (default: the source)
    is byte for byte unchanged. Returns the error."""
    watch = watch or src
    before = tree_digest(watch)
    existed = os.path.lexists(dst) if dst else True
    with pytest.raises(DestinationError) as e:
        api.export_checkpoint(src, dst, config=config, overwrite=overwrite)
    assert tree_digest(watch) == before
    if dst and not existed:
        assert not os.path.lexists(dst)
    return e.value


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("where, reason", [
    ("the source", "is the source"), ("its parent", "contains the source"), ("an ancestor", "contains the source"),
    ("a link to the source", "is the source"), ("inside the source", "lies inside the source"),
    ("inside its tag dir", "lies inside the source")])
def test_destination_that_is_holds_or_lies_in_the_source(committed_zero2, overwrite, where, reason):
    src = committed_zero2 / "ckpt"
    (committed_zero2.parent / "link").symlink_to(src)
    dst = {"the source": src, "its parent": committed_zero2, "an ancestor": committed_zero2.parent,
           "a link to the source": committed_zero2.parent / "link", "inside the source": src / "hf",
           "inside its tag dir": src / "global_step2" / "hf"}[where]
    err = _refused(src, dst, overwrite=overwrite, watch=committed_zero2)
    assert _reason(err, dst).startswith(reason), str(err)
    if where == "a link to the source":
        assert f"(it resolves to {src})" in str(err)
    assert leftovers(os.path.dirname(os.path.realpath(dst))) == []


@pytest.mark.parametrize("overwrite", [False, True])
def test_source_named_through_a_link_is_still_the_source(committed_zero2, overwrite):
    """Paths are compared resolved on both sides: the real source as destination, the source read
    through a link to it."""
    real, link = committed_zero2 / "ckpt", committed_zero2.parent / "via-link"
    link.symlink_to(real)
    err = _refused(link, real, overwrite=overwrite, watch=committed_zero2, config=committed_zero2)
    assert _reason(err, real).startswith("is the source"), str(err)


@pytest.mark.parametrize("overwrite", [False, True])
def test_config_directory_as_destination(committed_zero2, tmp_path, overwrite):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_bytes((committed_zero2 / "config.json").read_bytes())
    err = _refused(committed_zero2 / "ckpt", cfg, config=cfg, overwrite=overwrite, watch=cfg)
    assert _reason(err, cfg).startswith("is or contains the config directory"), str(err)


def test_empty_destination_is_the_working_directory(committed_zero2):
    err = _refused(committed_zero2 / "ckpt", "", watch=committed_zero2)
    assert str(err).startswith("the destination is an empty path"), str(err)


def test_existing_destination_needs_overwrite(committed_zero2, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"earlier")
    err = _refused(committed_zero2 / "ckpt", dst, watch=tmp_path)
    # raised through the API: the option as a keyword (the CLI says --overwrite)
    assert _reason(err, dst).startswith("already exists; choose a new directory or pass overwrite=True"), str(err)


def test_overwrite_refuses_a_file(committed_zero2, tmp_path):
    dst = tmp_path / "out"
    dst.write_bytes(b"not an export")
    err = _refused(committed_zero2 / "ckpt", dst, overwrite=True, watch=tmp_path)
    assert _reason(err, dst).startswith("exists and is not a directory"), str(err)


@pytest.mark.parametrize("depth", [1, 2])
def test_overwrite_refuses_a_directory_holding_a_subdirectory(committed_zero2, tmp_path, depth):
    """A save dir, a home or the working directory: never what an export is, never replaced."""
    dst = tmp_path / "out"
    sub = dst / "sub" / "deeper" if depth == 2 else dst / "sub"
    sub.mkdir(parents=True)
    (sub / "keep.txt").write_text("mine")
    (dst / "model.safetensors").write_bytes(b"earlier")
    err = _refused(committed_zero2 / "ckpt", dst, overwrite=True, watch=tmp_path)
    assert _reason(err, dst).startswith("holds a subdirectory (sub), so it is not an earlier export"), str(err)


def test_overwrite_replaces_an_earlier_export_whole(committed_zero2, tmp_path):
    src, dst = committed_zero2 / "ckpt", tmp_path / "out"
    api.export_checkpoint(src, dst)
    (dst / "stale.safetensors").write_bytes(b"from an earlier export")
    before = tree_digest(committed_zero2)
    api.export_checkpoint(src, dst, overwrite=True)
    assert not (dst / "stale.safetensors").exists()
    assert api.verify_checkpoint(dst, src).ok
    assert tree_digest(committed_zero2) == before and leftovers(tmp_path) == []


TAG = "global_step2"


def test_destination_exists(z2, tmp_path):
    src, config = z2
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = hf_ckpt("export", src, dst, "--config", config)
    assert r.returncode == 2 and "already exists" in r.stderr and "--overwrite" in r.stderr
    assert (dst / "keep.txt").read_text() == "mine"
    r = export(src, dst, "--config", config, "--overwrite", "--quiet")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]


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
def test_destination_that_is_holds_or_lies_in_the_source_is_refused(z2_trainer, overwrite):
    """Today ``export SRC SRC --overwrite`` (or SRC's parent, or "" from an unset variable) swapped
    the source out and deleted it. Every spelling is refused before anything is written."""
    cases = _dst_cases(z2_trainer)
    before, listing = tree_digest(z2_trainer), sorted(os.listdir(z2_trainer.parent))
    for name, (dst, cwd) in cases.items():
        r = hf_ckpt("export", z2_trainer, dst, "--quiet", *overwrite, cwd=cwd)
        line = assert_refused(r)
        assert "source" in line or "empty path" in line, (name, line)
        assert tree_digest(z2_trainer) == before and sorted(os.listdir(z2_trainer.parent)) == listing, name
        assert leftovers(z2_trainer.parent) == [] and leftovers(z2_trainer) == [], name
    export(z2_trainer, z2_trainer.parent.parent / "ok", "--quiet")
    assert hf_ckpt("verify", z2_trainer.parent.parent / "ok", "--against", z2_trainer).returncode == 0


def test_config_dir_as_destination_is_refused(z2_trainer, engine_ckpt, tmp_path):
    config = tmp_path / "config"
    shutil.copytree(engine_ckpt("z2-fp32") / "config", config)
    before = tree_digest(config)
    assert_refused(hf_ckpt("export", z2_trainer, config, "--config", config, "--overwrite"), match="config directory")
    assert tree_digest(config) == before


def test_api_and_parallel_writer_refuse_the_source_too(z2_trainer, monkeypatch):
    """The check lives in the writer's commit strategy (SiblingSwap), so every path gets it, not only the CLI."""
    from hf_ckpt_integrations import export_checkpoint
    from hf_ckpt_integrations.errors import DestinationError
    from hf_ckpt_integrations.parallel import write_plan_parallel
    from hf_ckpt_integrations.sources import build_plan

    before = tree_digest(z2_trainer)
    with pytest.raises(DestinationError, match="is the source"):
        export_checkpoint(z2_trainer, z2_trainer, overwrite=True)
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(DestinationError, match="contains the source"):
        write_plan_parallel(build_plan(z2_trainer), z2_trainer.parent, overwrite=True, quiet=True)
    assert tree_digest(z2_trainer) == before


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_overwrite_replaces_only_an_export(z2_trainer, tmp_path):
    """--overwrite on a directory holding a subdirectory (a save dir, a home, a project) is refused."""
    dst = tmp_path / "project"
    (dst / "src").mkdir(parents=True)
    (dst / "src" / "train.py").write_text("print('mine')\n")
    before = tree_digest(dst)
    line = assert_refused(hf_ckpt("export", z2_trainer, dst, "--overwrite"), match="holds a subdirectory")
    assert "--overwrite replaces only an export" in line
    assert tree_digest(dst) == before and leftovers(tmp_path) == []


def test_destination_symlink_is_resolved_and_nothing_stale_is_left(z2_trainer, tmp_path):
    """A destination that is a link to an earlier export: the export replaces the link's target,
    the link stays a link, and no temp entry is left next to either (today the swapped-out link
    was left behind as ``.link.hfckpt-tmp-PID``)."""
    real = tmp_path / "exports" / "v1"
    export(z2_trainer, real, "--quiet", "--dtype", "bf16")
    link = tmp_path / "current"
    link.symlink_to(real)
    export(z2_trainer, link, "--quiet", "--overwrite")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert load_safetensors(real / "model.safetensors")["lm_head.weight"].dtype == torch.float32
    assert leftovers(tmp_path) == [] and leftovers(real.parent) == []


def test_stale_sibling_removal_touches_only_what_a_writer_makes(z2_trainer, tmp_path):
    """Under the lock, ``.<dst>.hfckpt-tmp-*`` siblings without hf-ckpt's owner marker all stay:
    a directory with a subdirectory, a link (and its target), a flat directory (tests/
    test_output_paths.py: what a dead writer of ours left is removed)."""
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
    export(z2_trainer, dst, "--quiet")
    assert (keep / "precious.txt").read_text() == "keep me"
    assert (target / "file").read_text() == "keep me too"
    assert os.path.islink(tmp_path / ".out.hfckpt-tmp-2") and (flat / "model.safetensors").read_bytes() == b"partial"


# ---------------------------------------------------------------- 6. exfiltration

def test_config_files_linked_out_of_the_tree_are_not_copied(z2_trainer, tmp_path, secret):
    """A ``tokenizer.json`` linked to a private key was copied into the export (which users upload).
    Now it is skipped with one ``warning:`` line; a link that stays inside the tree is copied."""
    (z2_trainer / "tokenizer.json").symlink_to(secret)
    (z2_trainer / "vocab").mkdir()
    (z2_trainer / "vocab" / "merges.txt").write_text("a b\n")
    (z2_trainer / "merges.txt").symlink_to(z2_trainer / "vocab" / "merges.txt")
    dst = tmp_path / "out"
    r = export(z2_trainer, dst, "--quiet")
    warnings = r.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "tokenizer.json" in warnings[0], r.stderr
    assert not (dst / "tokenizer.json").exists()
    assert (dst / "merges.txt").read_text() == "a b\n" and not (dst / "merges.txt").is_symlink()
    assert all(SECRET.encode() not in p.read_bytes() for p in dst.iterdir())
