"""An export killed (SIGKILL at random points; SIGTERM and SIGHUP clean up like Ctrl-C), starved of disk
space, or racing another export into the same destination never leaves a partial destination or a
temporary sibling: real exports in subprocesses on an engine checkpoint.
"""

import contextlib
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import REPO, assert_refused, export, hf_ckpt, leftovers, tree_digest


# ---------------------------------------------------------------- SIGKILL during export

def _export_cmd(src, dst, config, dtype):
    # Tiny shards: many files, each fsynced; bf16 also imports torch and casts, so the
    # staging directory lives long enough to be killed in.
    return [sys.executable, "-m", "hf_ckpt_integrations", "export", str(src), str(dst), "--config", str(config),
            "--dtype", dtype, "--max-shard-size", "8KB", "--overwrite", "--quiet"]


def test_sigkill_at_random_points(engine_ckpt, tmp_path):
    """24 real exports killed at random delays (every third just after its staging directory
    appears): dst is always one complete export (the previous one or the new one), never partial;
    the next run removes the killed runs' temp dirs."""
    case = engine_ckpt("z2-fp32")
    src, config = case / "ckpt", case / "config"
    complete = {}
    for dtype in ("fp32", "bf16"):
        ref = tmp_path / f"ref-{dtype}"
        # Timed warm: the first export of a config derives and caches transformers' answers (Hub
        # layout, fp32-kept modules, the config fit), so it is several times slower than the
        # exports killed below; timed cold, every kill would land after the export had finished.
        # The fastest of three: one slowed by a cold page cache or a busy machine would put most
        # kills after the export had finished.
        subprocess.run(_export_cmd(src, ref, config, dtype), check=True, cwd=REPO, timeout=120)
        took = []
        for _ in range(3):
            started = time.perf_counter()
            subprocess.run(_export_cmd(src, ref, config, dtype), check=True, cwd=REPO, timeout=120)
            took.append(time.perf_counter() - started)
        complete[dtype] = (tree_digest(ref), min(took))
    digests = {d for d, _ in complete.values()}
    dst = tmp_path / "out"
    shutil.copytree(tmp_path / "ref-fp32", dst)
    rng = random.Random(7)
    outcomes = {"old": 0, "new": 0, "killed-while-staging": 0}
    for i in range(24):
        dtype = ("bf16", "fp32")[i % 2]  # alternate, so each run replaces a different complete export
        old = tree_digest(dst)
        before = {n for n in leftovers(tmp_path) if ".hfckpt-tmp-" in n}  # what earlier killed runs left

        def staging():  # this run's own staging entries
            return {n for n in leftovers(tmp_path) if ".hfckpt-tmp-" in n} - before
        proc = subprocess.Popen(_export_cmd(src, dst, config, dtype), cwd=REPO, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        if i % 3 == 0:
            # Every third run waits for its staging directory and is killed inside the window this
            # test is about: timed delays alone landed all before it or all after it, by machine load.
            deadline = time.monotonic() + 120
            while not staging() and proc.poll() is None:
                assert time.monotonic() < deadline, "the export never created its staging directory"
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.02))
        else:
            time.sleep(rng.uniform(0.1, 1.1) * complete[dtype][1])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        now = tree_digest(dst)
        assert now in digests, f"run {i}: destination is not a complete export after SIGKILL"
        outcomes["old" if now == old else "new"] += 1
        outcomes["killed-while-staging"] += bool(staging())
    # The kills must have landed inside the interesting window at least a few times.
    assert outcomes["killed-while-staging"] >= 3, outcomes
    r = export(src, dst, "--config", config, "--overwrite", "--quiet")
    assert leftovers(tmp_path) == [], "the next run must remove what killed runs left"
    assert hf_ckpt("verify", dst, "--against", src).returncode == 0


# ---------------------------------------------------------------- disk full

@contextlib.contextmanager
def _small_tmpfs(path, size):
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); the RLIMIT_FSIZE case covers it")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_disk_full_on_a_small_tmpfs(engine_ckpt, tmp_path):
    """A 800 KB file system: a bf16 export (0.4 MB) fits, an fp32 overwrite (0.6 MB more) does not."""
    case = engine_ckpt("z2-fp32")
    src, config = case / "ckpt", case / "config"
    with _small_tmpfs(tmp_path / "fs", "800k") as fs:
        dst = fs / "out"
        r = export(src, dst, "--config", config, "--dtype", "bf16", "--quiet")
        before = tree_digest(dst)
        for target, extra in ((dst, ["--overwrite"]), (fs / "other", [])):
            r = hf_ckpt("export", src, target, "--config", config, "--quiet", *extra)
            assert_refused(r, match="no space left")
            assert sorted(p.name for p in fs.iterdir()) == ["out"]  # nothing partial, no temp, no lock
            assert tree_digest(dst) == before


def _limit_file_size(limit):
    def apply():
        # Ignored SIGXFSZ: the write fails with EFBIG instead of killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_disk_full_as_a_file_size_limit(engine_ckpt, tmp_path):
    case = engine_ckpt("z2-fp32")
    dst = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "hf_ckpt_integrations", "export", case / "ckpt", dst, "--config",
                        case / "config", "--quiet"], capture_output=True, text=True, cwd=REPO, timeout=120,
                       preexec_fn=_limit_file_size(256 * 1024))
    assert_refused(r, match="no space left", dst=dst)


# ---------------------------------------------------------------- concurrent exports

def _wait_for_staging(parent, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(".hfckpt-tmp-" in n for n in leftovers(parent)):
            return
        assert proc.poll() is None, "the first export ended before it started staging"
        time.sleep(0.005)
    raise AssertionError("the first export never created its staging directory")


@pytest.mark.parametrize("second", [[], ["--overwrite"]])
def test_two_exports_into_one_destination(engine_ckpt, tmp_path, second):
    """The first export is caught mid-write (SIGSTOP, a real process, no test hook); the second
    one fails at once naming the other; the first then finishes: one complete export."""
    case = engine_ckpt("z2-fp32")
    src, config = case / "ckpt", case / "config"
    dst = tmp_path / "out"
    first = subprocess.Popen([*_export_cmd(src, dst, config, "bf16")], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_staging(tmp_path, first)
        first.send_signal(signal.SIGSTOP)
        r = hf_ckpt("export", src, dst, "--config", config, "--quiet", *second)
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "another export into it is running" in lines[0] and str(first.pid) in lines[0]
    assert leftovers(tmp_path) == []
    assert hf_ckpt("verify", dst, "--against", src).returncode == 0


def test_two_exports_started_together(engine_ckpt, tmp_path):
    """No choreography: both start at once; exactly one wins, the other fails with one clear line."""
    case = engine_ckpt("z2-fp32")
    src, config = case / "ckpt", case / "config"
    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_ckpt_integrations", "export", str(src), str(dst), "--config", str(config),
           "--dtype", "bf16", "--max-shard-size", "8KB", "--quiet"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert sorted(rc for rc, _ in results) == [0, 2], results
    err = next(e for rc, e in results if rc == 2).strip().splitlines()
    assert len(err) == 1 and ("another export into it is running" in err[0] or "already exists" in err[0]), err
    assert leftovers(tmp_path) == []
    assert hf_ckpt("verify", dst, "--against", src).returncode == 0


# ---------------------------------------------------------------- 5. signals

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_like_ctrl_c(z2_trainer, tmp_path, sig):
    """Caught mid-write (SIGSTOP while its staging directory exists), sent ``sig``, then resumed:
    it removes its staging directory and lock, exits 128+sig with one error line."""
    dst = tmp_path / "out"
    cmd = [sys.executable, "-m", "hf_ckpt_integrations", "export", str(z2_trainer), str(dst), "--max-shard-size", "8KB",
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


class _Stop(Exception):
    pass


@pytest.mark.parametrize("strategy", ["sibling-swap", "merge"])
@pytest.mark.parametrize("window", ["lock-file", "owner-marker", "staging-mkdir"])
def test_a_signal_inside_begin_leaves_nothing(tmp_path, monkeypatch, strategy, window):
    """SIGTERM delivered right after begin() creates its lock file, owner marker or staging
    directory (before anything records it) is held to the end of that step and then raised
    where begin() removes what it made: the race the timed test above can only hit by chance."""
    from hf_ckpt_integrations import _staging
    from hf_ckpt_integrations.commit import MergeIntoCheckpoint, SiblingSwap

    def signalled(real):
        def step(*a, **k):
            out = real(*a, **k)
            os.kill(os.getpid(), signal.SIGTERM)
            return out
        return step

    if strategy == "merge":
        dst = tmp_path / "ckpt"
        dst.mkdir()
        (dst / "kept.txt").write_text("the user's file")
        made = MergeIntoCheckpoint(dst)
    else:
        dst = tmp_path / "out"
        made = SiblingSwap(dst)

    def stop(*_):
        raise _Stop()
    previous = signal.signal(signal.SIGTERM, stop)
    # Another thread alive, as in a training process: the kernel may hand it the signal.
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    try:
        if window == "lock-file":
            monkeypatch.setattr(_staging.DirLock, "_open", signalled(_staging.DirLock._open))
        elif window == "owner-marker":
            monkeypatch.setattr(_staging, "open_new", signalled(_staging.open_new))
        else:
            monkeypatch.setattr(_staging.os, "mkdir", signalled(os.mkdir))
        with pytest.raises(_Stop):
            made.begin()
            made.abort()  # not reached where the signal landed inside begin(); keeps the tree clean if not
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGTERM, previous)
        idle.set()
    assert leftovers(tmp_path) == []
    if strategy == "merge":
        assert sorted(p.name for p in dst.iterdir()) == ["kept.txt"]
    else:
        assert not dst.exists()
