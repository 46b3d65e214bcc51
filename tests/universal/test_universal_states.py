"""Optimizer states `hf-ckpt universal` cannot carry are refused by name, before anything is
written: a state whose file name is another's (``fp32``: the master's ``fp32.pt``; two names one
case-folding file system takes for one), and a non-tensor state beyond ``STATE_LIMIT`` bytes (it is
copied into every parameter's folder). On the committed 0.18.9 ZeRO-2 save, no engine run."""

import os

import pytest
import torch

from helpers import assert_refused, hf_ckpt, tree_digest


def _edit_states(work, edit):
    tag = work / "ckpt" / "global_step2"
    for name in sorted(os.listdir(tag)):
        if name.endswith("_optim_states.pt"):
            sd = torch.load(tag / name, weights_only=False)
            for state in sd["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
                edit(state)
            torch.save(sd, tag / name)


def _rename(old, new):
    def edit(state):
        state[new] = state.pop(old)
    return edit


@pytest.mark.parametrize("edit, match", [
    (_rename("exp_avg", "fp32"), ("state named 'fp32'", "fp32.pt", "the fp32 master weights")),
    (_rename("exp_avg", "EXP_AVG_SQ"), ("state named 'EXP_AVG_SQ'", "optimizer state 'exp_avg_sq'")),
    (lambda s: s.update(step=list(range(10**6))), ("optimizer state 'step'", "65,536 bytes of non-tensor data")),
])
def test_states_a_universal_checkpoint_cannot_hold_are_refused(committed_zero2, tmp_path, edit, match):
    work = committed_zero2
    _edit_states(work, edit)
    before = tree_digest(work)
    r = hf_ckpt("universal", work / "ckpt", tmp_path / "uc", "--config", work)
    assert_refused(r, match=match, dst=tmp_path / "uc", src=work, digest=before)
    assert os.listdir(tmp_path) == ["work"]  # no staging directory, no lock left beside the destination


def test_a_small_list_state_is_carried(committed_zero2, tmp_path):
    """A per-group value that is a short list (not a number) is still carried, as stored."""
    from hf_ckpt_integrations.formats.torch_files import load

    work = committed_zero2
    _edit_states(work, lambda s: s.update(step=[3, 4]))
    r = hf_ckpt("universal", work / "ckpt", tmp_path / "uc", "--config", work)
    assert r.returncode == 0, r.stderr
    some = next(p for p in (tmp_path / "uc" / "zero").iterdir() if (p / "step.pt").exists())
    assert load(some / "step.pt") == [3, 4]
