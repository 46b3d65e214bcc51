"""`hf-ckpt universal` resumed under the installed DeepSpeed's ``load_universal`` across ZeRO stages,
precisions and releases: ZeRO-3 onto 3 ranks, bf16 ZeRO-2 and BF16_Optimizer onto 1 rank, a
DeepSpeed 0.14.4 save onto 1 and 2 ranks (what cannot be resumed: tests/universal/test_universal_refusals.py).

The runs are tests/engines/ds_uc_resume.py (cases ``ucw-*`` in tests/conftest.py): ``-own`` loads
the save at its own layout with DeepSpeed's ordinary loader, ``-toN`` through
``write_universal_checkpoint`` on N plain data-parallel ranks. Both record the states the engine
holds right after loading (DeepSpeed's ``safe_get_full_*``), the optimizer step and the next two
losses on the same global batches.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from helpers import REPO

pytestmark = pytest.mark.engine

FIXTURE_014 = REPO / "tests" / "fixtures" / "deepspeed" / "0.14.4" / "zero2-replica"


def _run(case):
    return json.loads((case / "run.json").read_text()), load_file(str(case / "loaded.safetensors"))


def _differ(got, want):
    """Names whose tensors are not bitwise equal (or missing from ``got``)."""
    return [k for k, w in want.items() if k not in got or got[k].shape != w.shape or got[k].dtype != w.dtype
            or not torch.equal(got[k].contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))]


def _masters_are(states, reference):
    bad = _differ({k[len("fp32/"):]: v for k, v in states.items() if k.startswith("fp32/")}, reference)
    assert not bad, f"loaded fp32 masters are not the engine's own at save time: {bad[:5]}"


def test_zero3_save_resumes_on_three_ranks(engine_ckpt):
    """ZeRO-3 saved on 2 ranks, loaded on 3 (every parameter partitioned anew in thirds, the last
    one short): the fp32 masters are those the engine reported at save time, and with exp_avg and
    exp_avg_sq bitwise what the run resumed at its own layout loads; step carried; the next two
    losses equal (fp32: the same sums, reduced over 3 ranks instead of 2)."""
    own, own_states = _run(engine_ckpt("ucw-z3-fp32-own"))
    uni, uni_states = _run(engine_ckpt("ucw-z3-fp32-to3"))
    assert (uni["world_size"], uni["optimizer"]) == (3, "DeepSpeedZeroOptimizer_Stage3")
    _masters_are(uni_states, load_file(str(engine_ckpt("z3-fp32") / "reference" / "master.safetensors")))
    assert sorted(uni_states) == sorted(own_states)
    bad = _differ(uni_states, own_states)
    assert not bad, f"states loaded from the universal checkpoint differ from the own-layout run's: {bad[:5]}"
    assert uni["steps"] == own["steps"] == [2.0] and uni["global_steps"] == own["global_steps"] == 4
    assert uni["losses"] == pytest.approx(own["losses"], rel=1e-6)


@pytest.mark.parametrize("src, optimizer", [("z2-bf16", "DeepSpeedZeroOptimizer"), ("bf16opt-z1", "BF16_Optimizer")])
def test_bf16_save_resumes_on_one_rank(src, optimizer, engine_ckpt):
    """bf16 ZeRO-2, and DeepSpeed's BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation), saved
    on 2 ranks and loaded on 1: fp32 masters the engine's own, every state bitwise what the own-layout
    run loads, step carried. The first loss after loading is the own run's to the last bit (the same
    bf16 weights on the same rows) where torch's CPU kernels are AVX-512's; on an AVX2-only CPU one
    process's forward over 4 rows and two ranks' over 2 + 2 round apart in the loss's last bits
    (measured: 7e-8 relative), so equal to 1e-6 there. The second follows a step whose bf16 gradients one run computes
    on 4 rows and the other on 2 + 2 rows reduced over 2 ranks, which round apart in bf16: equal
    to 1e-4 relative (measured: about 1e-5)."""
    own, own_states = _run(engine_ckpt(f"ucw-{src}-own"))
    uni, uni_states = _run(engine_ckpt(f"ucw-{src}-to1"))
    assert own["optimizer"] == uni["optimizer"] == optimizer and uni["world_size"] == 1
    _masters_are(uni_states, load_file(str(engine_ckpt(src) / "reference" / "master.safetensors")))
    assert sorted(uni_states) == sorted(own_states)
    bad = _differ(uni_states, own_states)
    assert not bad, f"states loaded from the universal checkpoint differ from the own-layout run's: {bad[:5]}"
    assert uni["steps"] == own["steps"] == [2.0] and uni["global_steps"] == own["global_steps"] == 4
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert uni["losses_hex"][0] == own["losses_hex"][0], (uni["losses"], own["losses"])
    else:  # (AVX2's bf16 kernels block by rows: 4 rows in one process and 2 + 2 round apart in the last bits)
        assert uni["losses"][0] == pytest.approx(own["losses"][0], rel=1e-6), (uni["losses"], own["losses"])
    assert uni["losses"][1] == pytest.approx(own["losses"][1], rel=1e-4)


def _fixture_states():
    """The 0.14.4 save's exp_avg / exp_avg_sq per parameter and model-parallel copy: each rank file's
    fragments cut where its own ``param_slice_mappings`` say, ranks walked by number."""
    tag = FIXTURE_014 / "ckpt" / "global_step2"
    out = {}
    for mp in (0, 1):
        flat = {}
        for dp in (0, 1):
            osd = torch.load(tag / f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt",
                             weights_only=False)["optimizer_state_dict"]
            for g, mapping in enumerate(osd["param_slice_mappings"]):
                state = osd["base_optimizer_state"]["state"][g]
                for name, frag in mapping.items():
                    for key in ("exp_avg", "exp_avg_sq"):
                        flat.setdefault((key, name), []).append(state[key].narrow(0, frag.start, frag.numel))
        out[mp] = {f"{key}/{name}": torch.cat(parts) for (key, name), parts in flat.items()}
    return out


def test_deepspeed_0_14_save_resumes_on_one_and_two_ranks(engine_ckpt):
    """DeepSpeed 0.14.4's replica-mpu ZeRO-2 save (the committed fixture: 2 replicas x 2 data-parallel
    ranks), converted and loaded by the installed DeepSpeed's load_universal on 1 and on 2 plain
    ranks, the model rebuilt from the fixture's config.json. No 0.14.4 engine is installed to resume
    it at its own layout, so there is no own-layout run to match losses against; the references are
    the save's own: the fp32 masters 0.14.4 reported at save time (reference.safetensors), exp_avg and
    exp_avg_sq as each rank file's fragments at the offsets it records (both replicas), step 2. The two
    steps after loading run with finite losses, the same on 1 rank and on 2 (the same batches)."""
    ref = load_file(str(FIXTURE_014 / "reference.safetensors"))
    frags = _fixture_states()
    runs = {n: _run(engine_ckpt(f"ucw-ds0.14.4-replica-to{n}")) for n in (1, 2)}
    for n, (run, states) in runs.items():
        assert run["world_size"] == n
        _masters_are(states, ref)
        for mp, want in frags.items():
            want = {k: v.view(states[k].shape) if k in states else v for k, v in want.items()}
            bad = _differ(states, want)
            assert not bad, f"{n} rank(s): optimizer states differ from mp rank {mp}'s fragments: {bad[:5]}"
        assert sorted(states) == sorted([f"fp32/{k}" for k in ref] + list(frags[0]))
        assert run["steps"] == [2.0] and run["global_steps"] == 4, "step not carried"
        assert all(math.isfinite(x) for x in run["losses"]), run["losses"]
    assert runs[1][0]["losses"] == pytest.approx(runs[2][0]["losses"], rel=1e-6)

