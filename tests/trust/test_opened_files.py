"""Every file a source or an option opens is checked as the config guards check theirs
(guards.open_regular / check_inside): a regular file, opened non-blocking (a FIFO is refused, never
waited on), bounded where it is small metadata, and inside the checkpoint's tree (a link leading out
of it is refused: another file's bytes would be mixed into the export silently). Exit 2, one
``error:`` line naming the file, nothing written. No engine run."""

import json
import os
import shutil

import pytest
import torch

from helpers import assert_refused, export, export_refused, hf_ckpt, tree_digest

HANG = 120  # a FIFO read blocks forever: the subprocess is killed (the test fails) instead of hanging the suite


def _hf_src(tmp_path, fmt="bin"):
    src = tmp_path / "src"
    src.mkdir()
    sd = {"a.weight": torch.arange(12, dtype=torch.float32).view(3, 4), "b.weight": torch.ones(2, 2)}
    if fmt == "bin":
        torch.save(sd, src / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src, sd


def test_a_fifo_name_map_is_refused_not_waited_on(tmp_path):
    src, _ = _hf_src(tmp_path)
    fifo = tmp_path / "map.json"
    os.mkfifo(fifo)
    r = hf_ckpt("export", src, tmp_path / "out", "--source-option", f"name_map={fifo}", timeout=HANG)
    assert_refused(r, match=(str(fifo), "not a regular file"), dst=tmp_path / "out")


def test_a_name_map_that_is_a_directory_or_too_large_is_refused(tmp_path):
    src, _ = _hf_src(tmp_path)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2**20 + 10) + b"{}")
    for value, match in ((tmp_path, "not a regular file"), (big, "more than")):
        r = hf_ckpt("export", src, tmp_path / "out", "--source-option", f"name_map={value}", timeout=HANG)
        assert_refused(r, match=(str(value), match), dst=tmp_path / "out")


@pytest.mark.parametrize("fmt, name", [("bin", "pytorch_model.bin"), ("st", "model.safetensors")])
def test_a_fifo_weight_file_is_refused_not_waited_on(tmp_path, fmt, name):
    src, _ = _hf_src(tmp_path, fmt)
    (src / name).unlink()
    os.mkfifo(src / name)
    before = tree_digest(src)
    r = hf_ckpt("export", src, tmp_path / "out", timeout=HANG)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr
    assert tree_digest(src) == before and not (tmp_path / "out").exists()


def test_a_fifo_index_is_refused_not_waited_on(tmp_path):
    src, _ = _hf_src(tmp_path, "st")
    os.rename(src / "model.safetensors", src / "model-00001-of-00001.safetensors")
    os.mkfifo(src / "model.safetensors.index.json")
    r = hf_ckpt("export", src, tmp_path / "out", timeout=HANG)
    assert_refused(r, dst=tmp_path / "out")


def test_verify_refuses_a_fifo_config_in_dst(tmp_path):
    src, _ = _hf_src(tmp_path)
    assert hf_ckpt("export", src, tmp_path / "out", "--weights-only").returncode == 0
    os.mkfifo(tmp_path / "out" / "config.json")
    r = hf_ckpt("verify", tmp_path / "out", "--against", src, timeout=HANG)
    assert r.returncode == 2 and "config.json" in r.stderr and "not a regular file" in r.stderr, r.stderr


def test_a_fifo_adapter_config_is_refused_not_waited_on(tmp_path):
    src = tmp_path / "adapter"
    src.mkdir()
    from safetensors.torch import save_file

    save_file({"base_model.model.q.lora_A.weight": torch.ones(2, 4), "base_model.model.q.lora_B.weight": torch.ones(4, 2)},
              str(src / "adapter_model.safetensors"), metadata={"format": "pt"})
    os.mkfifo(src / "adapter_config.json")
    r = hf_ckpt("export", src, tmp_path / "out", timeout=HANG)
    assert r.returncode == 2 and r.stderr.count("error:") == 1, r.stderr


def test_a_weight_file_linked_from_outside_the_source_is_refused(tmp_path):
    src, _ = _hf_src(tmp_path, "st")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(src / "model.safetensors", outside)
    (src / "model.safetensors").symlink_to(outside)
    export_refused(src, tmp_path / "out", match=("model.safetensors", "outside", "symbolic link"))


def test_a_hub_cache_snapshot_reads_its_blobs(tmp_path):
    """The Hugging Face cache links a snapshot's files into the repository's blobs/: that is its tree."""
    from helpers import load_safetensors

    repo = tmp_path / "models--x--y"
    _, sd = _hf_src(tmp_path, "st")
    (repo / "blobs").mkdir(parents=True)
    shutil.move(tmp_path / "src" / "model.safetensors", repo / "blobs" / "0123abcd")
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/0123abcd")
    r = export(snap, tmp_path / "out", "--weights-only")
    assert all(load_safetensors(tmp_path / "out" / "model.safetensors")[k].equal(v) for k, v in sd.items())


@pytest.fixture
def universal_src(committed_zero2, tmp_path):
    work = committed_zero2
    uc = tmp_path / "uc"
    r = hf_ckpt("universal", work / "ckpt", uc, "--config", work)
    assert r.returncode == 0, r.stderr
    shutil.copy(work / "config.json", uc / "config.json")
    return uc


@pytest.mark.parametrize("content", ["weights", "garbage"])
def test_universal_entry_linked_from_outside_is_refused(universal_src, tmp_path, content):
    """A zero/<param>/ entry that is a link to a directory outside SRC was read and exported (exit 0).
    Refused before anything of it is read: what lies outside is never parsed (``garbage``)."""
    uc = universal_src
    zero = uc / "zero"
    victim = sorted(p.name for p in zero.iterdir() if p.is_dir())[0]
    outside = tmp_path / "outside" / victim
    outside.parent.mkdir()
    shutil.move(zero / victim, outside)
    if content == "garbage":
        (outside / "fp32.pt").write_bytes(b"not a torch file")
    (zero / victim).symlink_to(outside, target_is_directory=True)
    export_refused(uc, tmp_path / "out", match=(victim, "outside", "symbolic link"))


def test_universal_entry_linked_inside_is_read(universal_src, tmp_path):
    """A link that stays inside the checkpoint is part of it."""
    uc = universal_src
    zero = uc / "zero"
    victim = sorted(p.name for p in zero.iterdir() if p.is_dir())[0]
    shutil.move(zero / victim, uc / "moved")
    (zero / victim).symlink_to(uc / "moved", target_is_directory=True)
    r = export(uc, tmp_path / "out")


@pytest.mark.parametrize("damage", ["removed", "fifo"])
def test_universal_parameter_without_its_entry_is_refused(universal_src, tmp_path, damage):
    """A parameter the model states record whose zero/<name>/fp32.pt is gone (or a FIFO) was left out
    of an export without a config, exit 0."""
    uc = universal_src
    os.remove(uc / "config.json")
    entry = uc / "zero" / "lm_head.weight"
    shutil.rmtree(entry)
    if damage == "fifo":
        entry.mkdir()
        os.mkfifo(entry / "fp32.pt")
    r = hf_ckpt("export", uc, tmp_path / "out", timeout=HANG)
    assert_refused(r, match=("lm_head.weight/fp32.pt", "missing or not a regular file"), dst=tmp_path / "out")
