"""`hf-ckpt universal` output resumes under DeepSpeed's own ``load_universal`` at another layout:
the states the engine holds after loading are bitwise those it holds after loading the original
save at the original layout, and training continues with the same losses.

Each pair of engine cases (tests/engines/ds_uc_resume.py) loads one save twice: ``-own`` at its
own layout with DeepSpeed's ordinary loader, ``-toN`` through ``write_universal_checkpoint`` on N
plain data-parallel ranks. Both record what the engine holds (DeepSpeed's ``safe_get_full_*``).
"""

import json

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.engine

PAIRS = [("replica-z2", "to1"), ("tp-z1", "to1")]


def _run(case):
    return json.loads((case / "run.json").read_text()), load_file(str(case / "loaded.safetensors"))


@pytest.mark.parametrize("src,to", PAIRS)
def test_universal_resume_continues_the_run(src, to, engine_ckpt):
    own, own_states = _run(engine_ckpt(f"ucw-{src}-own"))
    uni, uni_states = _run(engine_ckpt(f"ucw-{src}-{to}"))
    assert sorted(uni_states) == sorted(own_states)
    differ = [k for k in own_states if own_states[k].shape != uni_states[k].shape
              or not own_states[k].view(-1).view(dtype=__import__("torch").int32).equal(
                  uni_states[k].view(-1).view(dtype=__import__("torch").int32))]
    assert not differ, f"states loaded from the universal checkpoint differ: {differ[:5]}"
    assert uni["steps"] == own["steps"] and own["steps"], "optimizer step not carried"
    assert uni["global_steps"] == own["global_steps"]
    assert uni["losses"] == pytest.approx(own["losses"], rel=1e-5, abs=1e-6)


def test_zero3_replica_save_resumes_on_one_rank(engine_ckpt):
    test_universal_resume_continues_the_run("replica-z3", "to1", engine_ckpt)


def test_twelve_ranks_resume_on_two_and_one(engine_ckpt):
    """Seed 004: 12 data-parallel ranks (file names sort 0, 1, 10, 11, 2...) onto 2 and onto 1: the
    loaded fp32 masters are the engine's own at save time, bitwise; both resumed runs load the same
    optimizer states and continue with the same losses."""
    import torch

    ref = load_file(str(engine_ckpt("z2-dp12") / "reference" / "master.safetensors"))
    one, one_states = _run(engine_ckpt("ucw-z2-dp12-to1"))
    two, two_states = _run(engine_ckpt("ucw-z2-dp12-to2"))
    for name, want in ref.items():
        assert torch.equal(one_states[f"fp32/{name}"].view(torch.int32), want.view(torch.int32)), name
    assert sorted(one_states) == sorted(two_states)
    assert all(torch.equal(one_states[k].view(torch.int32), two_states[k].view(torch.int32)) for k in one_states)
    assert one["steps"] == two["steps"] == [2.0] and one["global_steps"] == two["global_steps"]
    assert one["losses"] == pytest.approx(two["losses"], rel=1e-5, abs=1e-6)


def test_autotp_save_resumes_at_tp1(engine_ckpt):
    """DeepSpeed AutoTP's own record (universal_checkpoint_info; lm_head's 1001 rows split 501 + 500)
    decides the merge: at TP 1 the loaded fp32 masters are bitwise the full weights DeepSpeed itself
    gathered at save time, and training goes on."""
    import math

    import torch

    ref = load_file(str(engine_ckpt("autotp-z1") / "reference" / "master.safetensors"))
    run, states = _run(engine_ckpt("ucw-autotp-z1-to1"))
    for name, want in ref.items():
        got = states[f"fp32/{name}"]
        assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32)), name
    assert run["steps"] == [2.0] and all(math.isfinite(x) for x in run["losses"])
