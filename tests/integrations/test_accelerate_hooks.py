"""install_accelerate_hooks on real Accelerate + DeepSpeed runs (2 ranks, torchrun, CPU/gloo).

``accelerator.save_model`` as usual writes a complete HF directory (weights, index, config),
bitwise equal to the engine's own weights, lean in both formats; ``save_state`` carries an HF copy.
"""

import json

import pytest
import torch

from helpers import assert_bitwise_equal as _assert_equal
from helpers import load_hf_state as _load
from helpers import load_safetensors

pytestmark = pytest.mark.engine


def _assert_lean_bin(directory, reference):
    """Every tensor in every .bin shard owns exactly its bytes (seed 002: no flat-buffer storages)."""
    seen = {}
    for shard in sorted(directory.glob("pytorch_model*.bin")):
        for name, t in torch.load(shard, weights_only=True, mmap=True).items():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name
            seen[name] = t
    _assert_equal(seen, reference)


def _metrics(case):
    files = sorted((case / "metrics").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def test_zero3_gather_false_save_model_streams_a_complete_hf_dir(engine_ckpt):
    """Accelerate alone raises ValueError here (stage3_gather_16bit_weights_on_model_save false).
    3 ranks: partitions broadcast one at a time, the last one padded; persistent parameters read whole."""
    case = engine_ckpt("acc-z3")
    hf = case / "hf"
    module = load_safetensors(case / "reference" / "module.safetensors")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3
    assert (hf / "config.json").exists() and not list(hf.glob(".hfckpt*"))
    _assert_equal(_load(hf, torch.float32), module)
    tensor_bytes = sum(t.numel() * t.element_size() for t in module.values())
    assert index["metadata"]["total_size"] == tensor_bytes
    assert sum(p.stat().st_size for p in hf.glob("*.safetensors")) <= tensor_bytes * 1.01
    assert [m["written_here"] for m in _metrics(case)] == [[f"model-0000{i}-of-00003.safetensors"] for i in (1, 2, 3)]


def test_zero3_bin_format_is_lean_and_loads(engine_ckpt):
    case = engine_ckpt("acc-z3")
    module = load_safetensors(case / "reference" / "module.safetensors")
    assert (case / "bin" / "pytorch_model.bin.index.json").exists()
    _assert_lean_bin(case / "bin", module)
    _assert_equal(_load(case / "bin", torch.float32), module)


def test_zero3_save_state_carries_loadable_copy(engine_ckpt):
    case = engine_ckpt("acc-z3")
    state = case / "state"
    assert (state / "pytorch_model").is_dir()  # DeepSpeed's own checkpoint is still there for load_state
    _assert_equal(_load(state, torch.float32), load_safetensors(case / "reference" / "master.safetensors"))


def test_zero1_bf16_save_model_reads_views_in_place_without_bloat(engine_ckpt):
    case = engine_ckpt("acc-z1-bf16")
    module = load_safetensors(case / "reference" / "module.safetensors")
    assert {t.dtype for t in module.values()} == {torch.bfloat16}
    _assert_equal(_load(case / "hf", torch.bfloat16), module)
    tensor_bytes = sum(t.numel() * 2 for t in module.values())
    assert sum(p.stat().st_size for p in (case / "hf").glob("*.safetensors")) <= tensor_bytes * 1.01
    _assert_lean_bin(case / "bin", module)
    # A few of the same live tensors through a plain torch.save: each view drags its whole flat
    # buffer along (seed 002), which is what the lean checks above would catch.
    small = _metrics(case)[0]["bloat_tensor_bytes"]
    bloat = (case / "bloat" / "pytorch_model.bin").stat().st_size
    assert bloat > 0.9 * tensor_bytes > 50 * small, (bloat, tensor_bytes, small)


def test_zero1_bf16_save_state_copy_is_training_dtype(engine_ckpt):
    case = engine_ckpt("acc-z1-bf16")
    _assert_equal(_load(case / "state", torch.bfloat16), load_safetensors(case / "reference" / "module.safetensors"))


@pytest.mark.parametrize("name", ["acc-autotp-z2-bf16", "acc-autotp-z3-bf16"])
def test_autotp_save_model_gathers_full_shapes_bitwise(engine_ckpt, name):
    """AutoTP tp=2 (vocab 1001 split 501 + 500), bf16, under ZeRO-2 (2 ranks) and ZeRO-3 (4 ranks:
    2 replicas x TP 2, every parameter a ZeRO-3 partition of a TP slice): each layer's slices are
    gathered by the layer's own gather when its tensors are written; the files hold full shapes."""
    case = engine_ckpt(name)
    module = load_safetensors(case / "reference" / "module.safetensors")  # DeepSpeed's gather of each layer
    assert module["lm_head.weight"].shape == module["model.embed_tokens.weight"].shape == (1001, 64)
    hf = _load(case / "hf", torch.bfloat16)
    assert {n: t.shape for n, t in hf.items()} == {n: t.shape for n, t in module.items()}
    _assert_equal(hf, module)
    tensor_bytes = sum(t.numel() * 2 for t in module.values())
    assert sum(p.stat().st_size for p in (case / "hf").glob("*.safetensors")) <= tensor_bytes * 1.01
    _assert_lean_bin(case / "bin", module)
    metrics = _metrics(case)
    assert all(m["autotp_size"] == 2 for m in metrics)
    assert sum(bool(m["written_here"]) for m in metrics) == 2  # 2 shards, by ranks 0 and 1
    # save_state's HF copy comes from the ZeRO checkpoint's AutoTP record (universal_checkpoint_info).
    _assert_equal(_load(case / "state", torch.bfloat16), module)


@pytest.mark.parametrize("name", ["acc-z1-bf16", "acc-z3", "acc-autotp-z2-bf16", "acc-autotp-z3-bf16"])
def test_save_model_leaves_parameters_in_place(engine_ckpt, name):
    """After a save every parameter still has its own storage (under ZeRO-1/2 a view of the flat
    buffer the optimizer writes): a gather that left DeepSpeed's re-split copies behind would not."""
    for m in _metrics(engine_ckpt(name)):
        assert m["data_ptr_changed_by_save"] == []
