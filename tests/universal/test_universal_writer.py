"""`hf-ckpt universal` on checkpoints of real DeepSpeed 0.10 - 0.19 engines (the committed fixtures,
no engine run): what it writes is the engine's own state, what it refuses leaves nothing behind.

The references are the engines': the fp32 masters each engine reported at save time
(``reference.safetensors``) and, for the optimizer states, the offsets DeepSpeed itself recorded
in every ZeRO-1/2 file (``param_slice_mappings``), read with ``torch.load`` from the fixture.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import REPO, hf_ckpt
from hf_ckpt_integrations import LayoutError, write_universal_checkpoint

FIXTURES = REPO / "tests" / "fixtures" / "deepspeed"
CASES = sorted(f"{v.name}/{c.name}" for v in FIXTURES.iterdir() if v.is_dir() for c in v.iterdir()
               if (c / "reference.safetensors").exists() and c.name != "trainer-zero3")


def _write(case, dst, **kw):
    src = FIXTURES / case
    return write_universal_checkpoint(src / "ckpt", dst, config=str(src), **kw)


def _load(path):
    return torch.load(path, weights_only=False)


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("case", CASES)
def test_fp32_masters_are_the_engines(case, tmp_path):
    report = _write(case, tmp_path / "uc" / "global_step2")
    zero = tmp_path / "uc" / "global_step2" / "zero"
    ref = load_file(str(FIXTURES / case / "reference.safetensors"))
    assert report["states"] == ["fp32", "exp_avg", "exp_avg_sq", "step"]
    assert sorted(n for n in os.listdir(zero) if (zero / n).is_dir()) == sorted(ref)
    first = next((FIXTURES / case / "ckpt" / "global_step2").glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    osd = _load(first)["optimizer_state_dict"]
    step = (osd.get("base_optimizer_state") or osd.get("optimizer_state_dict"))["state"][0]["step"]
    for name, want in ref.items():
        got = _load(zero / name / "fp32.pt")["param"]
        assert got.shape == want.shape and torch.equal(_bits(got), _bits(want)), f"{case}: {name}"
        assert _load(zero / name / "step.pt") == step, f"{case}: {name} step"


@pytest.mark.parametrize("case", [c for c in CASES if "zero2" in c])
def test_optimizer_states_sit_where_deepspeed_recorded_them(case, tmp_path):
    """Every rank file's exp_avg / exp_avg_sq fragment, cut where its own param_slice_mappings say
    (ranks walked by number), is the matching range of the written full state."""
    _write(case, tmp_path / "uc")
    tag = FIXTURES / case / "ckpt" / "global_step2"
    import re

    files = {}
    for n in os.listdir(tag):
        m = re.match(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$", n)
        if m:
            files.setdefault(int(m.group(2)), {})[int(m.group(1))] = tag / n
    checked = 0
    for mp, ranks in files.items():
        done = {}
        for dp in sorted(ranks):
            osd = _load(ranks[dp])["optimizer_state_dict"]
            for g, mapping in enumerate(osd["param_slice_mappings"]):
                state = osd["base_optimizer_state"]["state"][g]
                for name, frag in mapping.items():
                    at = done.get(name, 0)
                    for key in ("exp_avg", "exp_avg_sq"):
                        full = _load(tmp_path / "uc" / "zero" / name / f"{key}.pt")["param"].view(-1)
                        want = state[key].narrow(0, frag.start, frag.numel)
                        assert torch.equal(_bits(full[at:at + frag.numel]), _bits(want)), (case, mp, dp, name, key)
                        checked += 1
                    done[name] = at + frag.numel
    assert checked


def test_loader_fields(tmp_path):
    """What DeepSpeed's load_universal reads besides the tensors: one model-states file under both
    names (ZeRO-1/2 and ZeRO-3 engines look for different ones), mp_world_size 1, the step counters,
    and optimizer_state.pt with the hyperparameters and ZeRO-3's step."""
    dst = tmp_path / "uc"
    _write("0.18.9/zero3", dst)
    a, b = _load(dst / "mp_rank_00_model_states.pt"), _load(dst / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    assert a.keys() == b.keys() and a["global_steps"] == b["global_steps"] == 2 and a["mp_world_size"] == 1
    assert a["dp_world_size"] == 2 and a["universal_checkpoint_info"]["universal_checkpoint_version"] >= 0.3
    opt = _load(dst / "zero" / "optimizer_state.pt")
    assert opt["param_groups"][0]["lr"] > 0 and opt["ds_version"] == "0.18.9"
    assert opt["optimizer_state_dict"]["state"][0]["step"] == 2


def _replica_with_diverged_state(tmp_path):
    """A copy of the 0.14.4 replica save in which one replica's exp_avg differs by one element."""
    work = tmp_path / "work"
    shutil.copytree(FIXTURES / "0.14.4" / "zero2-replica", work)
    path = work / "ckpt" / "global_step2" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    sd = _load(path)
    state = sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"]
    state[0] += 1.0
    torch.save(sd, path)
    return work


def test_replicas_that_disagree_are_refused(tmp_path):
    work = _replica_with_diverged_state(tmp_path)
    with pytest.raises(LayoutError, match="differs from the copy"):
        write_universal_checkpoint(work / "ckpt", tmp_path / "out" / "uc", config=str(work))
    assert os.listdir(tmp_path / "out") == []  # nothing staged is left, no lock file either
    r = hf_ckpt("universal", work / "ckpt", tmp_path / "out" / "uc", "--config", work)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error:"), r.stderr
    assert "exp_avg" not in r.stderr or "differs" in r.stderr
    assert not (tmp_path / "out" / "uc").exists()


def test_refusals_exit_2_with_one_line(tmp_path, committed_zero2):
    src = committed_zero2 / "ckpt"
    r = hf_ckpt("universal", src, src / "uc")  # inside the source
    assert r.returncode == 2 and r.stderr.startswith("error:") and r.stderr.count("\n") == 1, r.stderr
    assert "inside the source" in r.stderr and not (src / "uc").exists()
    hf = tmp_path / "hf"
    assert hf_ckpt("export", src, hf, "--config", committed_zero2).returncode == 0
    r = hf_ckpt("universal", hf, tmp_path / "uc")  # not a DeepSpeed save
    assert r.returncode == 2 and "DeepSpeed ZeRO save" in r.stderr and not (tmp_path / "uc").exists(), r.stderr


def test_cli_writes_and_says_how_to_load(tmp_path, committed_zero2):
    r = hf_ckpt("universal", committed_zero2 / "ckpt", tmp_path / "run" / "global_step2_universal")
    assert r.returncode == 0, r.stderr
    assert "load_checkpoint(" in r.stdout and "tag='global_step2_universal'" in r.stdout
    assert "load_universal" in r.stdout


def test_ds_to_universal_doubles_replicas_where_we_write_one_copy(tmp_path):
    """Seed 000's save through DeepSpeed's own converter (the installed release, on the 0.14.4
    engine's replica save): with --inject_missing_state it concatenates the replicas — every tensor
    doubled — where `universal` writes the full tensor once."""
    import subprocess
    import sys

    work = tmp_path / "work"
    shutil.copytree(FIXTURES / "0.14.4" / "zero2-replica", work)
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(work / "ckpt" / "global_step2"), "--output_folder", str(tmp_path / "ds"),
                        "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    _write("0.14.4/zero2-replica", tmp_path / "ours")
    ref = load_file(str(FIXTURES / "0.14.4" / "zero2-replica" / "reference.safetensors"))
    for name in ("lm_head.weight", "model.norm.weight"):
        theirs = _load(tmp_path / "ds" / "zero" / name / "fp32.pt")["param"]
        ours = _load(tmp_path / "ours" / "zero" / name / "fp32.pt")["param"]
        assert theirs.shape[0] == 2 * ref[name].shape[0]  # the replica axis concatenated
        assert torch.equal(_bits(ours), _bits(ref[name]))


def test_verify_checks_every_state_and_dry_run_writes_nothing(tmp_path):
    src = FIXTURES / "0.14.4" / "zero2-replica" / "ckpt"
    r = hf_ckpt("universal", src, tmp_path / "plan", "--dry-run")
    assert r.returncode == 0 and not (tmp_path / "plan").exists(), r.stderr
    import json

    shown = json.loads(r.stdout)
    assert shown["mp_axis"] == "replica" and shown["universal"]["optimizer_states"] == ["exp_avg", "exp_avg_sq", "step"]
    assert all(p["merge"].startswith("replicas") for p in shown["universal"]["parameters"])
    dst = tmp_path / "uc"
    assert hf_ckpt("universal", src, dst, "--quiet").returncode == 0
    r = hf_ckpt("verify", dst, "--against", src)
    assert r.returncode == 0 and "108 tensors" in r.stdout, r.stdout + r.stderr  # 27 parameters x 4 states
    path = dst / "zero" / "model.norm.weight" / "exp_avg_sq.pt"
    d = _load(path)
    d["param"][3] += 1
    path.unlink()
    torch.save(d, path)
    r = hf_ckpt("verify", dst, "--against", src)
    assert r.returncode == 1 and "model.norm.weight/exp_avg_sq.pt: differs" in r.stdout, r.stdout + r.stderr


def test_every_file_is_fsynced_before_the_rename(tmp_path, monkeypatch):
    """The fsyncs run on a thread pool (universal_writer._Syncer): each written file must still be
    synced, and all of them before the staging directory is renamed into place."""
    import hf_ckpt_integrations.commit as commit

    synced, renamed = set(), []
    real_fsync, real_swap = os.fsync, commit.SiblingSwap._swap

    def fsync(fd):
        real_fsync(fd)
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if path.is_relative_to(tmp_path) and len(path.relative_to(tmp_path).parts) > 1:
            synced.add(Path(*path.relative_to(tmp_path).parts[1:]))  # inside the staging directory

    def swap(self):
        renamed.append(set(synced))
        return real_swap(self)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(commit.SiblingSwap, "_swap", swap)
    dst = tmp_path / "uc"
    _write(CASES[0], dst)
    files = {p.relative_to(dst) for p in dst.rglob("*") if p.is_file()}
    assert len(files) > 10 and renamed and files <= renamed[0], sorted(files - renamed[0])[:5]


def test_planning_reads_every_rank_file_once():
    """``universal`` (and ``--dry-run``) read each optimizer partition file and the model-states
    file only as much as the source's own plan does: the plan keeps what it unpickled for the
    writer (a 1,024-rank save was read twice, seconds each time). Counted with an audit hook on
    the real ``open`` calls."""
    import sys

    from hf_ckpt_integrations.sources import deepspeed
    from hf_ckpt_integrations.sources.protocol import PlanContext
    from hf_ckpt_integrations.universal_writer import plan_universal

    case = FIXTURES / "0.18.9" / "zero2"
    tag = case / "ckpt" / "global_step2"
    files = sorted(str(p) for p in tag.iterdir() if p.name.endswith("_states.pt"))
    assert sum("optim_states" in f for f in files) >= 2, files
    opened = []
    counting = [False]

    def hook(event, args):
        if counting[0] and event == "open" and isinstance(args[0], str) and args[0] in files:
            opened.append(args[0])

    def count(fn):
        opened.clear()
        counting[0] = True
        try:
            fn()
        finally:
            counting[0] = False
        return {f: opened.count(f) for f in files}

    sys.addaudithook(hook)  # hooks stay for the process: it counts only while `counting`
    plan_alone = count(lambda: deepspeed.plan(PlanContext(str(case / "ckpt"), config_dir=str(case))))
    assert all(plan_alone.values()), plan_alone
    assert count(lambda: plan_universal(case / "ckpt", config=str(case))) == plan_alone
