"""What an export or a save creates, and where: never outside its destination, never through a
name someone planted, never removing what is not its own (docs/reliability.md, "What the writer
creates and how").

Sources are the committed DeepSpeed fixtures (tests/fixtures/deepspeed/, no engine launch) and
tiny synthetic PEFT/HF directories; the CLI runs in a subprocess, the strategies in process.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, assert_refused, export, hf_ckpt, leftovers, tree_digest

from hf_ckpt_integrations import _staging, commit
from hf_ckpt_integrations.api import export_checkpoint
from hf_ckpt_integrations.commit import MergeIntoCheckpoint, SiblingSwap
from hf_ckpt_integrations.errors import DestinationError
from hf_ckpt_integrations.orchestrator import write
from hf_ckpt_integrations.plan import ExportPlan, LivePiece, TensorPlan

FIXTURE = REPO / "tests" / "fixtures" / "deepspeed" / "0.18.9" / "zero2"


@pytest.fixture
def case(tmp_path):
    """A private copy of a ZeRO-2 save: ``case/ckpt`` (the source), ``case/config.json``."""
    shutil.copytree(FIXTURE, tmp_path / "case")
    return tmp_path / "case"


def _fingerprint(path):
    st = os.stat(path)
    return Path(path).read_bytes(), st.st_mtime_ns, st.st_size


# ---------------------------------------------------------------- names planted beside the destination


@pytest.mark.parametrize("how", ["symlink", "hardlink"])
def test_planted_lock_is_refused_and_never_written(case, how):
    """A link at ``.<dst>.hfckpt-lock`` to a file of the source: the export refuses naming the lock,
    and the file keeps its bytes and mtime (it was truncated to the exporter's pid, exit 0)."""
    victim = case / "ckpt" / "latest"
    before = _fingerprint(victim)
    lock = case / ".out.hfckpt-lock"
    if how == "symlink":
        lock.symlink_to(victim)
    else:
        os.link(victim, lock)
    line = assert_refused(export(case / "ckpt", case / "out", config=case, ok=False), match=(str(lock), "not the lock file hf-ckpt makes"))
    assert ("symbolic link" if how == "symlink" else "hard link") in line
    assert _fingerprint(victim) == before
    assert not (case / "out").exists() and os.path.lexists(lock)


def test_entries_named_like_staging_are_left_alone(case, tmp_path):
    """``.<dst>.hfckpt-tmp-*`` entries without our owner marker — links to the source, a flat
    directory — stay as they are (a warning names them); the export still succeeds."""
    victim = case / "ckpt" / "latest"
    before, digest = _fingerprint(victim), tree_digest(case / "ckpt")
    (case / ".out.hfckpt-tmp-1-ab").symlink_to(case / "ckpt" / "global_step2")
    (case / ".out.hfckpt-tmp-2-cd").symlink_to(victim)
    flat = case / ".out.hfckpt-tmp-3-ef"
    flat.mkdir()
    (flat / "notes.txt").write_text("mine")
    r = export(case / "ckpt", case / "out", config=case)
    assert "left as it is (it has no valid owner marker of hf-ckpt)" in r.stderr
    assert os.path.islink(case / ".out.hfckpt-tmp-1-ab") and os.path.islink(case / ".out.hfckpt-tmp-2-cd")
    assert (flat / "notes.txt").read_text() == "mine"
    assert _fingerprint(victim) == before and tree_digest(case / "ckpt") == digest


@pytest.mark.parametrize("where", ["marker", "staging"])
def test_planted_at_our_next_name_is_skipped(case, monkeypatch, where):
    """Someone who guessed the next nonce plants a link at the owner marker's or the staging
    directory's name: neither is followed or removed; the writer draws another name."""
    victim = case / "ckpt" / "latest"
    before = _fingerprint(victim)
    nonces = iter(["feedfeedfeedfeed", "0123456789abcdef"])
    monkeypatch.setattr(_staging, "_nonce", lambda: next(nonces))  # the owner markers' nonces
    planted = case / f".out.hfckpt-tmp-{os.getpid()}-feedfeedfeedfeed"
    planted = planted.with_name(planted.name + ".owner") if where == "marker" else planted
    planted.symlink_to(victim if where == "marker" else case / "ckpt" / "global_step2")
    export_checkpoint(case / "ckpt", case / "out", config=case)
    assert (case / "out" / "model.safetensors").is_file()
    assert os.path.islink(planted) and _fingerprint(victim) == before
    assert leftovers(case) == [planted.name]


@pytest.mark.parametrize("name, refused", [("model.safetensors", True), ("config.json", False)])
def test_planted_link_inside_staging_is_not_written_through(case, monkeypatch, name, refused):
    """A link appears inside the staging directory (a racing process) at a shard's or a copied
    config's name, pointing at a file of the source: the shard is refused (its file must be new),
    the config copy replaces the link; the file of the source keeps its bytes and mtime."""
    victim = case / "ckpt" / "global_step2" / "mp_rank_00_model_states.pt"
    before = _fingerprint(victim)
    begin = SiblingSwap.begin

    def begin_then_plant(self):
        staging = begin(self)
        os.symlink(victim, os.path.join(staging, name))
        return staging

    monkeypatch.setattr(SiblingSwap, "begin", begin_then_plant)
    if refused:
        with pytest.raises(DestinationError, match="File exists"):
            export_checkpoint(case / "ckpt", case / "out", config=case)
        assert not (case / "out").exists()
    else:
        export_checkpoint(case / "ckpt", case / "out", config=case)
        assert not os.path.islink(case / "out" / name)
        assert json.loads((case / "out" / name).read_text())["model_type"] == "llama"
    assert _fingerprint(victim) == before and leftovers(case) == []


def test_source_named_like_a_staging_directory_survives(case):
    """The source is a flat tag directory named ``.out.hfckpt-tmp-123`` beside the destination:
    the export reads it and leaves it whole (it was removed as a stale staging directory)."""
    src = case / ".out.hfckpt-tmp-123"
    shutil.copytree(case / "ckpt" / "global_step2", src)
    digest = tree_digest(src)
    export(src, case / "out", config=case)
    assert tree_digest(src) == digest and (case / "out" / "model.safetensors").is_file()


# ---------------------------------------------------------------- leftovers of our own writers

_CRASH = textwrap.dedent("""
    import os, sys, time
    from hf_ckpt_integrations.commit import SiblingSwap
    s = SiblingSwap(sys.argv[1])
    staging = s.begin()
    with open(os.path.join(staging, "model.safetensors"), "wb") as fh:
        fh.write(b"partial")
    s._lock.release()  # another writer may start; the staging directory and its marker stay
    print(staging, flush=True)
    if sys.argv[2] == "die":
        os._exit(0)  # killed: nothing removed
    time.sleep(600)
""")


def _writer(dst, how):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-c", _CRASH, str(dst), how], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)


def test_staging_of_a_dead_writer_is_removed(case):
    proc = _writer(case / "out", "die")
    staging = proc.stdout.readline().strip()
    assert proc.wait(timeout=60) == 0
    assert os.path.isdir(staging) and os.path.isfile(staging + commit.OWNER_SUFFIX)
    export(case / "ckpt", case / "out", config=case)
    assert leftovers(case) == []


def test_staging_of_a_live_writer_is_kept(case):
    proc = _writer(case / "out", "live")
    try:
        staging = proc.stdout.readline().strip()
        assert os.path.isdir(staging)
        r = export(case / "ckpt", case / "out", config=case)
        assert "still runs" in r.stderr and Path(staging).name in r.stderr
        assert (Path(staging) / "model.safetensors").read_bytes() == b"partial"
        assert os.path.isfile(staging + commit.OWNER_SUFFIX)
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- one destination guard


def _peft_dirs(tmp_path):
    """A tiny LoRA checkpoint (``src``), its adapter config alone in ``cfg`` (beside a file of the
    user's), and a base model ``base`` it merges into."""
    import torch
    from safetensors.torch import save_file

    src, cfg, base = (tmp_path / n for n in ("src", "cfg", "base"))
    for d in (src, cfg, base):
        d.mkdir()
    lora = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.default.weight"
    save_file({lora.format("A"): torch.ones(4, 8), lora.format("B"): torch.ones(8, 4)}, src / "model.safetensors",
              metadata={"format": "pt"})
    (cfg / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "target_modules": ["q_proj"]}))
    (cfg / "notes.txt").write_text("mine")
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8)}, base / "model.safetensors",
              metadata={"format": "pt"})
    # A config the base's one tensor can stand for (config.json is checked against the checkpoint
    # before the merge is planned): one layer of hidden size 8.
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "num_key_value_heads": 2,
                                                  "vocab_size": 16}))
    return src, cfg, base


@pytest.mark.parametrize("kind", ["model config", "adapter config"])
def test_destination_is_the_config_directory(case, tmp_path, kind):
    """``--overwrite`` with DST = the ``--config`` directory: refused naming it, the directory as it
    was (an adapter export replaced it, the user's other files gone)."""
    if kind == "model config":
        src, cfg = case / "ckpt", tmp_path / "cfg"
        cfg.mkdir()
        shutil.copy(case / "config.json", cfg / "config.json")
        (cfg / "notes.txt").write_text("mine")
    else:
        src, cfg, _ = _peft_dirs(tmp_path)
    digest = tree_digest(cfg)
    assert_refused(hf_ckpt("export", src, cfg, "--config", cfg, "--overwrite"), match=(str(cfg), "config directory"))
    assert tree_digest(cfg) == digest and leftovers(tmp_path) == []


def test_destination_inside_the_base_model_is_refused(tmp_path):
    """A base whose config.json fits its weights (the config-fit check passes), so the refusal is the
    destination guard's."""
    from tiny_adapters import build

    base, src, _ = build(tmp_path)
    digest = tree_digest(base)
    assert_refused(hf_ckpt("export", src, base / "merged", "--config", src, "--merge-adapters", "--base", base),
                   match=("lies inside", str(base)), dst=base / "merged")
    assert tree_digest(base) == digest


# ---------------------------------------------------------------- save-time merges into checkpoint-N


def _tensors():
    a = np.arange(12, dtype=np.float32)
    read = LivePiece(lambda lo, hi, writer, dtype: iter([memoryview(a.tobytes())]), 0, 12, "F32")
    return ExportPlan("test", "synthetic", None, [TensorPlan("w", (3, 4), "F32", [[read]], kind="live", out_dtype="F32")])


def _victim(tmp_path):
    """A directory of someone else's files, with a journal naming one of them."""
    v = tmp_path / "victim"
    v.mkdir()
    (v / "model.safetensors").write_bytes(b"not yours")
    (v / ".hfckpt-commit.json").write_text(json.dumps({"files": ["model.safetensors"], "replace_existing": True}))
    return v


@pytest.mark.parametrize("planted", ["link to a directory", "unmarked directory", "journal naming ../"])
def test_merge_into_checkpoint_touches_only_its_own_staging(tmp_path, planted):
    """What sits at ``checkpoint-N/.hfckpt-tmp-weights`` is rolled forward or removed only when our
    owner marker says a dead writer of ours left it: a link (followed, it moved another directory's
    files into the checkpoint), an unmarked directory (removed) or a journal naming paths outside
    it are refused, and nothing moves."""
    d = tmp_path / "checkpoint-4"
    d.mkdir()
    staging = d / commit.STAGING_NAME
    victim = _victim(tmp_path)
    if planted == "link to a directory":
        staging.symlink_to(victim)
    elif planted == "unmarked directory":
        shutil.copytree(victim, staging)
    else:  # our marker, a dead writer's, but a journal that leads out of the staging directory
        crashed = MergeIntoCheckpoint(d)
        crashed.begin()
        crashed._release()
        (staging / ".hfckpt-commit.json").write_text(json.dumps({"files": ["../../victim/model.safetensors"],
                                                                  "replace_existing": True}))
    before = tree_digest(tmp_path)
    with pytest.raises(DestinationError, match="not a staging directory hf-ckpt left"):
        write(_tensors(), MergeIntoCheckpoint(d))
    assert tree_digest(tmp_path) == before
    assert (victim / "model.safetensors").read_bytes() == b"not yours"
