"""Where an export may write (``guards.check_destination``, ``commit.SiblingSwap``): never the source,
a directory holding it or one inside it, nor the config directory; ``--overwrite`` replaces only an
earlier export (a flat directory of files). Each refusal leaves the source and the destination as
they were. On a private copy of a committed DeepSpeed checkpoint, through the API: no engine run.
"""

import os

import pytest

from helpers import leftovers, tree_digest

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
    assert _reason(err, dst).startswith("already exists; choose a new directory or pass --overwrite"), str(err)


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
