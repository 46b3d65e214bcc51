"""``begin()`` of each commit strategy undoes every step it made when a later one fails (ENOSPC,
out of inodes, any OSError): no lock file, owner marker, staging directory or parent directory of
ours is left, and the export exits 2. Injected failures at every call, then a real tiny tmpfs."""

import errno
import json
import os
import subprocess

import pytest
import torch

from helpers import hf_ckpt
from hf_ckpt_integrations import _staging, commit
from hf_ckpt_integrations.errors import DestinationError


def _everything(root):
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, fs in os.walk(root) for n in ds + fs)


class _FailAt:
    """Wraps ``fn``: its ``n``-th call raises OSError(ENOSPC)."""

    def __init__(self, fn, n):
        self.fn, self.n, self.calls = fn, n, 0

    def __call__(self, *a, **k):
        self.calls += 1
        if self.calls == self.n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.fn(*a, **k)


_STEPS = [(os, "mkdir"), (os, "open"), (os, "write"), (os, "ftruncate"), (json, "dump"), (os, "listdir")]


@pytest.mark.parametrize("strategy", ["swap", "merge"])
@pytest.mark.parametrize("step", _STEPS, ids=lambda s: f"{s[0].__name__}.{s[1]}")
def test_begin_undoes_each_step_when_the_next_fails(tmp_path, monkeypatch, strategy, step):
    module, attr = step
    real = getattr(module, attr)
    failed = 0
    for n in range(1, 40):
        make = (lambda: commit.SiblingSwap(tmp_path / "a" / "b" / "out")) if strategy == "swap" else \
            (lambda: commit.MergeIntoCheckpoint(tmp_path / "a" / "b" / "ckpt"))
        s = make()
        injected = _FailAt(real, n)
        monkeypatch.setattr(module, attr, injected)
        try:
            s.begin()
        except DestinationError as e:
            monkeypatch.setattr(module, attr, real)
            assert "no space left" in str(e), e
            assert _everything(tmp_path) == [], f"call {n} of {attr} failed: left {_everything(tmp_path)}"
            assert not _staging._LIVE_NONCES
            failed += 1
            continue
        finally:
            monkeypatch.setattr(module, attr, real)
        s.abort()
        if injected.calls < n:  # begin ran through without reaching the n-th call: every step was tried
            break
        # (the n-th call failed and begin rightly took it in its stride: a marker it could not read)
        for d in (tmp_path / "a",):
            subprocess.run(["rm", "-rf", str(d)], check=True)
    assert strategy == "merge" and attr == "listdir" or failed, f"begin never calls {attr}"


def _mount_tmpfs(path, opts):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "none", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode}); needs root")


@pytest.fixture
def tiny_src(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    torch.save({"a.weight": torch.arange(64, dtype=torch.float32).view(8, 8)}, src / "pytorch_model.bin")
    return src


# nr_inodes counts the tmpfs root: 1 fails the lock file, 2 the owner marker, 3 the staging
# directory (the case that left the marker), 4 the first shard; size=4k (one page) fails the
# marker's write after the lock's pid took the page.
@pytest.mark.parametrize("opts", ["size=1m,nr_inodes=1", "size=1m,nr_inodes=2", "size=1m,nr_inodes=3",
                                  "size=1m,nr_inodes=4", "size=4k,nr_inodes=100", "size=8k,nr_inodes=100"])
def test_export_onto_a_full_tmpfs_leaves_nothing(tmp_path, tiny_src, opts):
    mnt = tmp_path / "mnt"
    _mount_tmpfs(mnt, opts)
    try:
        r = hf_ckpt("export", tiny_src, mnt / "out", "--weights-only")
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert r.stderr.startswith("error:") and "no space left" in r.stderr
        assert _everything(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
