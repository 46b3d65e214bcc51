"""DeepSpeed configurations beyond ZeRO-1/2/3 with every weight saved, from real engine runs
(tests/engines/ds_configs_train.py, ds_parallel_train.py): no ZeRO (stage 0), DeepSpeed's
BF16_Optimizer, replica-mpu and AutoTP models without ZeRO, a save with
``exclude_frozen_parameters=True`` and a plain ``nn.Module`` with tied parameters and no HF config.
Each export is bitwise the engine's own full fp32 weights; ``verify`` agrees; ``inspect`` says what
the checkpoint is; what cannot be exported is refused by its reason."""

import json

import pytest
import torch

from hf_ckpt_integrations import export_checkpoint, inspect_checkpoint, verify_checkpoint
from helpers import export_refused, hf_ckpt, load_safetensors, read_export

pytestmark = pytest.mark.engine


def _assert_bitwise(out, reference):
    assert set(out) == set(reference), sorted(set(out) ^ set(reference))
    for name, t in reference.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


@pytest.mark.parametrize("name, optimizer, stage", [("z0-fp32", "torch optimizer", 0),
                                                    ("bf16opt-z1", "BF16_Optimizer", 1)])
def test_export_is_the_engines_fp32_weights(name, optimizer, stage, engine_ckpt, tmp_path):
    case = engine_ckpt(name)
    run = json.loads((case / "reference" / "run.json").read_text())
    assert run["optimizer"] in ("AdamW", "BF16_Optimizer")  # what the engine really wrapped
    info = inspect_checkpoint(case / "ckpt", config=str(case / "config"))
    assert (info["zero_stage"], info["optimizer"], info["dp_size"]) == (stage, optimizer, 2)
    export_checkpoint(case / "ckpt", tmp_path / "hf", config=str(case / "config"))
    _assert_bitwise(read_export(tmp_path / "hf"), load_safetensors(case / "reference" / "master.safetensors"))
    report = verify_checkpoint(tmp_path / "hf", case / "ckpt", config=str(case / "config"))
    assert report.ok, report.differences


def test_bf16_optimizer_bf16_export_is_the_module_weights(engine_ckpt, tmp_path):
    case = engine_ckpt("bf16opt-z1")
    export_checkpoint(case / "ckpt", tmp_path / "hf", dtype="bf16", config=str(case / "config"))
    state = load_safetensors(case / "reference" / "state.safetensors")
    _assert_bitwise(read_export(tmp_path / "hf"), {n: t for n, t in state.items() if t.dtype == torch.bfloat16})


def test_stage0_16bit_module_refused_by_what_it_is_or_exported_in_its_dtype(engine_ckpt, tmp_path):
    """bf16 without ZeRO on DeepSpeed 0.19 wraps the optimizer in FP16_UnfusedOptimizer: its fp32
    masters are unnamed per-group lists; the default (fp32) export says so, --dtype bf16 works."""
    case = engine_ckpt("z0-bf16")
    line = export_refused(case / "ckpt", tmp_path / "hf", "--config", case / "config")
    assert "ZeRO stage 0 (FP16_UnfusedOptimizer)" in line and "--dtype bf16" in line, line
    export_checkpoint(case / "ckpt", tmp_path / "hf16", dtype="bf16", config=str(case / "config"))
    _assert_bitwise(read_export(tmp_path / "hf16"), load_safetensors(case / "reference" / "state.safetensors"))
    assert verify_checkpoint(tmp_path / "hf16", case / "ckpt", config=str(case / "config")).ok
    info = inspect_checkpoint(case / "ckpt", config=str(case / "config"))
    assert (info["optimizer"], info["dtype_required"]["dtype"]) == ("FP16_UnfusedOptimizer", "bf16")


@pytest.mark.parametrize("name", ["replica-z0", "autotp-z0"])
def test_model_parallel_without_zero(name, engine_ckpt, tmp_path):
    case = engine_ckpt(name)
    export_checkpoint(case / "ckpt", tmp_path / "hf", config=str(case / "config"))
    out = read_export(tmp_path / "hf")
    if name == "autotp-z0":  # gathered from the engine's TP layers with DeepSpeed's own helper
        reference = load_safetensors(case / "reference" / "master.safetensors")
    else:  # every replica holds the whole fp32 module: the engine's own state dict, as saved
        tag = (case / "ckpt" / "latest").read_text().strip()
        reference = torch.load(case / "ckpt" / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    _assert_bitwise(out, {n: t.contiguous() for n, t in reference.items()})
    assert verify_checkpoint(tmp_path / "hf", case / "ckpt", config=str(case / "config")).ok


@pytest.mark.parametrize("name", ["z0-module-tied", "z2-module-tied"])
def test_module_without_config_writes_every_name(name, engine_ckpt, tmp_path):
    case = engine_ckpt(name)
    export_checkpoint(case / "ckpt", tmp_path / "hf", weights_only=True)
    state = load_safetensors(case / "reference" / "state.safetensors")  # module.state_dict(): head.weight too
    out = read_export(tmp_path / "hf")
    _assert_bitwise(out, state)
    sys_path_engines = __import__("ds_configs_train")  # the engine script's own module class
    model = sys_path_engines.TiedModule()
    model.load_state_dict(out, strict=True)
    assert model.head.weight is model.embed.weight
    assert verify_checkpoint(tmp_path / "hf", case / "ckpt").ok


def test_exclude_frozen_parameters_listed_and_refused(engine_ckpt, tmp_path):
    case = engine_ckpt("z2-exclude-frozen")
    frozen = json.loads((case / "reference" / "run.json").read_text())["frozen"]
    info = inspect_checkpoint(case / "ckpt", config=str(case / "config"))
    assert info["missing_tensors"] == sorted(frozen) and info["exclude_frozen_parameters"] is True
    r = hf_ckpt("inspect", case / "ckpt", "--config", case / "config")
    assert r.returncode == 0 and "missing     2 tensor(s)" in r.stdout, r.stdout
    line = export_refused(case / "ckpt", tmp_path / "hf", "--config", case / "config")
    assert "exclude_frozen_parameters=True" in line and "--allow-missing" in line and frozen[0] in line, line
    export_checkpoint(case / "ckpt", tmp_path / "hf", config=str(case / "config"), allow_missing=True)
    masters = load_safetensors(case / "reference" / "master.safetensors")
    _assert_bitwise(read_export(tmp_path / "hf"), {n: t for n, t in masters.items() if n not in frozen})
