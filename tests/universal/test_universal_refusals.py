"""What `hf-ckpt universal` refuses because DeepSpeed could not resume it: a save without ZeRO
(stage 0), whose optimizer state sits inside the model-states file and which DeepSpeed's
``load_universal`` never restores (an engine without ZeRO does not read ``zero/``). One ``error:``
line giving that reason, exit 2, nothing written."""

import os

import pytest
import torch

from helpers import assert_refused, hf_ckpt


def _as_stage0(work):
    """The committed 0.18.9 ZeRO-2 save rewritten as DeepSpeed writes a save without ZeRO: the fp32
    weights whole in ``module``, the torch optimizer's state dict beside them, no ``param_shapes``,
    no optimizer partition files."""
    tag = work / "ckpt" / "global_step2"
    path = tag / "mp_rank_00_model_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["ds_config"]["zero_optimization"]["stage"] = 0
    for key in ("param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments"):
        sd[key] = None
    sd["optimizer"] = {"state": {}, "param_groups": [{"lr": 0.01, "params": list(range(len(sd["module"])))}]}
    torch.save(sd, path)
    for name in os.listdir(tag):
        if name.endswith("_optim_states.pt"):
            os.remove(tag / name)
    return work


def test_save_without_zero_is_refused_by_its_reason(committed_zero2, tmp_path):
    work = _as_stage0(committed_zero2)
    r = hf_ckpt("universal", work / "ckpt", tmp_path / "uc", "--config", work)
    assert_refused(r, match=("without ZeRO (stage 0, torch optimizer)", "ZeRO stage 1-3 engines only"),
                   dst=tmp_path / "uc")


@pytest.mark.parametrize("name, optimizer", [("z0-fp32", "torch optimizer"), ("z0-bf16", "FP16_UnfusedOptimizer")])
def test_engine_saves_without_zero_are_refused(name, optimizer, engine_ckpt, tmp_path):
    """The same on real DeepSpeed 0.19 saves without ZeRO, fp32 and bf16 (bf16 there is wrapped in
    FP16_UnfusedOptimizer; BF16_Optimizer without ZeRO exists only under pipeline parallelism)."""
    case = engine_ckpt(name)
    r = hf_ckpt("universal", case / "ckpt", tmp_path / "uc", "--config", case / "config")
    assert_refused(r, match=(f"without ZeRO (stage 0, {optimizer})", "ZeRO stage 1-3 engines only"),
                   dst=tmp_path / "uc")
