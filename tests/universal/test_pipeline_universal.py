"""`hf-ckpt universal` of a DeepSpeed PipelineModule save: parameters under the module's own names
("{layer}.{name}", what ``load_universal`` looks up), TP merged by the pipeline's rules (the name
map's), replicas and row-parallel biases one copy (never summed: the loader copies a full-shaped
tensor to every rank), and a resume under DeepSpeed's own ``load_universal`` at another layout that
holds the originals' states bitwise and continues with the original run's losses.

Engine cases (tests/conftest.py): ``pipe-*`` are 4-rank ds_pipe_train.py saves (2 stages x TP 2),
which record under module names, right after the save, every parameter's fp32 master, exp_avg and
exp_avg_sq as DeepSpeed's ``safe_get_full_*`` give them (``states-stage*``), and the losses of the
two steps after the save; ``ucw-pipe-tp2-seq-to1`` (tests/engines/ds_pipe_resume.py) converts the
sequential-residual save and resumes it on 1 rank (PP 1 x TP 1).
"""

import json

import pytest
import torch

from helpers import assert_refused, hf_ckpt, load_safetensors

pytestmark = pytest.mark.engine


def _states(run, pattern):
    out = {}
    for f in sorted(run.glob(pattern)):
        out.update(load_safetensors(f))
    return out


def _bits(t):
    return t.contiguous().view(-1).view(torch.int32)


def test_seed001_pipeline_save_resumes_at_tp1(engine_ckpt):
    """Seed 001: 2 stages x TP 2 ZeRO-1 -> 1 rank. What DeepSpeed holds after load_universal (fp32
    masters, exp_avg, exp_avg_sq of all 28 parameters, the step) is bitwise what the saving run held
    at its save, and the next two steps' losses are those the saving run computed after its save."""
    saved = engine_ckpt("pipe-tp2-fp32-seq")
    resumed = engine_ckpt("ucw-pipe-tp2-seq-to1")
    want = _states(saved / "reference", "states-stage*.safetensors")
    got = _states(resumed, "loaded-stage*.safetensors")
    assert len(want) == 3 * 28 and sorted(got) == sorted(want)
    differ = [k for k in want if got[k].shape != want[k].shape or not torch.equal(_bits(got[k]), _bits(want[k]))]
    assert not differ, f"states loaded from the universal checkpoint differ from the saved run's: {differ[:5]}"
    before = json.loads((saved / "reference" / "run.json").read_text())
    after = json.loads((resumed / "run.json").read_text())
    assert after["steps"] == before["steps"] == [2.0] and after["global_steps"] == 2 + 2
    # GPT-NeoX's client state comes back to the loop: its iteration and RNG states (numpy's is left out
    # by name: the reader never rebuilds a numpy object)
    assert after["client_iteration"] == 2
    assert {"iteration", "args", "random_rng_state", "torch_rng_state"} <= set(after["client_keys"])
    assert "np_rng_state" not in after["client_keys"]
    # TP 2 adds partial products in another order than TP 1's one matmul: equal to rounding.
    assert after["losses"] == pytest.approx(before["losses_after_save"], rel=1e-5, abs=1e-6)


def _universal(run, dst, *args):
    r = hf_ckpt("universal", run / "ckpt", dst, "--config", run / "config", *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _written(dst, state):
    """``{param: tensor}`` of every ``zero/<param>/<state>.pt`` (torch.load: files this test wrote)."""
    out = {}
    for d in sorted((dst / "zero").iterdir()):
        if (d / f"{state}.pt").is_file():
            out[d.name] = torch.load(d / f"{state}.pt", weights_only=True)["param"]
    return out


def test_parallel_residual_save_keeps_each_ranks_row_bias(engine_ckpt, tmp_path):
    """The parallel-residual save (its HF export sums the row-parallel biases): the universal
    checkpoint holds every state as each TP rank's module holds it, bitwise the saving run's
    (the row-parallel biases one copy, not the sum), says what a TP change does to them, and
    verify re-reads every state through the same plan."""
    run = engine_ckpt("pipe-tp2-fp32-par")
    dst = tmp_path / "uc" / "global_step2"
    r = _universal(run, dst)
    want = _states(run / "reference", "states-stage*.safetensors")
    for state in ("fp32", "exp_avg", "exp_avg_sq"):
        got = _written(dst, state)
        ref = {k.split("/", 1)[1]: v for k, v in want.items() if k.startswith(state + "/")}
        assert sorted(got) == sorted(ref) and len(got) == 28, state
        differ = [n for n in ref if got[n].shape != ref[n].shape or not torch.equal(_bits(got[n]), _bits(ref[n]))]
        assert not differ, f"{state} differs: {differ[:5]}"
    assert torch.load(dst / "zero" / "2.attention.dense.bias" / "fp32.pt", weights_only=True)["cat_dim"] == 0
    assert "row-parallel biases" in r.stderr and "count (new tp)/2 times" in r.stderr
    v = hf_ckpt("verify", dst, "--against", run / "ckpt", "--config", run / "config")
    assert v.returncode == 0 and "112 tensors" in v.stdout, v.stdout[-2000:] + v.stderr[-2000:]


def test_a_save_without_zero_is_refused_like_any_save_without_zero(engine_ckpt, tmp_path):
    """No ZeRO: the torch optimizer's states are keyed by position, not name, and DeepSpeed loads a
    universal checkpoint through its ZeRO optimizers only: refused as for a plain stage-0 save
    (tests/universal/test_universal_refusals.py), nothing written."""
    run = engine_ckpt("pipe-tp2-fp32-z0-par")
    dst = tmp_path / "uc"
    r = hf_ckpt("universal", run / "ckpt", dst, "--config", run / "config")
    assert_refused(r, match=("without ZeRO (stage 0", "ZeRO stage 1-3 engines only"), dst=dst)


def test_without_a_config_tp_rules_on_module_names_give_the_same_checkpoint(engine_ckpt, tmp_path):
    """A fork with no HF config (seed 001's): --tp-rule on the module's own names merges the split
    parameters; the rest are byte-identical over TP (one copy). The files equal those the built-in map
    gives, and the output says that no row-parallel bias was recognised as one."""
    run = engine_ckpt("pipe-tp2-fp32-par")
    src = tmp_path / "src"  # no config beside it
    __import__("shutil").copytree(run / "ckpt", src)
    rules = ["*word_embeddings.weight=0", "*.query_key_value.*=0", "*.dense_h_to_4h.*=0", "*.dense.weight=1",
             "*.dense_4h_to_h.weight=1", "*final_linear.weight=0"]
    bare, mapped = tmp_path / "bare" / "t", tmp_path / "mapped" / "t"
    r = hf_ckpt("universal", src, bare, *[a for x in rules for a in ("--tp-rule", x)])
    assert r.returncode == 0 and "no row-parallel bias is recognised" in r.stderr, r.stderr[-2000:]
    _universal(run, mapped)
    files = sorted(p.relative_to(mapped / "zero") for p in (mapped / "zero").rglob("*.pt"))
    assert files == sorted(p.relative_to(bare / "zero") for p in (bare / "zero").rglob("*.pt")) and len(files) == 113
    assert all((bare / "zero" / f).read_bytes() == (mapped / "zero" / f).read_bytes() for f in files)
