"""torch.save's legacy (non-zip) format, ``_use_new_zipfile_serialization=False``
(hf_ckpt_integrations/formats/torch_files.py): read by the same restricted unpickler with the same
allowlist as zip files, for every source; storages are byte ranges after their 8-byte counts.

Fast: an HF directory whose ``pytorch_model.bin`` is a legacy file, exported bitwise, and hostile or
damaged legacy files refused cleanly. Engine: DeepSpeed ZeRO-2 with ``"checkpoint":
{"checkpoint_serialization": false}`` exported bitwise (tests/engines/ds_legacy_save.py).
"""

import pickle

import pytest
import torch

from helpers import assert_bitwise_equal, export, export_refused, load_safetensors
from hf_ckpt_integrations.errors import CheckpointError, UnsafeCheckpointError
from hf_ckpt_integrations.formats import torch_files, torch_legacy


def _state():
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(7, 5, generator=g), "b.bias": torch.randn(3, generator=g).to(torch.bfloat16),
            "c.ids": torch.arange(20, dtype=torch.int64)[4:10]}  # a view: the whole storage is saved


def _legacy(path, obj):
    torch.save(obj, path, _use_new_zipfile_serialization=False)
    return path


def test_legacy_file_reads_as_byte_ranges(tmp_path):
    sd = _state()
    path = _legacy(tmp_path / "w.bin", sd)
    assert torch_files.is_legacy(path) and not torch_files.is_legacy(tmp_path / "x")
    got = torch_files.load(path)
    raw = path.read_bytes()
    for name, want in sd.items():
        offset, nbytes = got[name].byte_range()
        assert torch.equal(torch.frombuffer(bytearray(raw[offset:offset + nbytes]), dtype=want.dtype).view(want.shape),
                           want), name


def test_legacy_pytorch_model_bin_exports_bitwise(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    sd = _state()
    _legacy(src / "pytorch_model.bin", sd)
    r = export(src, tmp_path / "out", "--weights-only")
    assert_bitwise_equal(load_safetensors(tmp_path / "out" / "model.safetensors"), sd)


def _exploit(path):
    """A legacy file whose object pickle names os.system (the header pickles are the real ones)."""
    class Evil:
        def __reduce__(self):
            import os
            return (os.system, ("true",))
    _legacy(path, {"w": torch.zeros(2)})
    raw = path.read_bytes()
    head = pickle.dumps(torch_legacy.MAGIC, protocol=2) + pickle.dumps(1001, protocol=2)
    head += pickle.dumps({"protocol_version": 1001, "little_endian": True,
                          "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2)
    assert raw.startswith(head)
    path.write_bytes(head + pickle.dumps({"w": Evil()}, protocol=2) + pickle.dumps([], protocol=2))
    return path


def _truncated(path):
    _legacy(path, _state())
    path.write_bytes(path.read_bytes()[:-5])
    return path


def _count_changed(path):
    _legacy(path, {"w": torch.zeros(4)})
    raw = bytearray(path.read_bytes())
    at = len(raw) - 4 * 4 - 8  # the one storage's 8-byte count
    raw[at:at + 8] = (5).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    return path


def _header_only(path):
    _legacy(path, _state())
    raw = path.read_bytes()
    path.write_bytes(raw[:40])
    return path


@pytest.mark.parametrize("make,error,reason", [
    (_exploit, UnsafeCheckpointError, "refused for safety"),
    (_truncated, CheckpointError, "truncated"),
    (_count_changed, CheckpointError, "holds 5 elements, the pickle records 4"),
    (_header_only, CheckpointError, "corrupt pickle"),
], ids=["os.system", "truncated", "count", "header-only"])
def test_hostile_or_damaged_legacy_files_refused(tmp_path, make, error, reason):
    path = make(tmp_path / "w.bin")
    with pytest.raises(error, match=reason):
        torch_files.load(path)
    src = tmp_path / "hf"
    src.mkdir()
    path.rename(src / "pytorch_model.bin")
    export_refused(src, tmp_path / "out", match=("pytorch_model.bin", reason))


def test_deepspeed_legacy_serialization_exports_bitwise(engine_ckpt, tmp_path):
    """DeepSpeed ZeRO-2 with "checkpoint_serialization": false: every file in the legacy format."""
    case = engine_ckpt("z2-legacy")
    tag = case / "ckpt" / "global_step2"
    assert all(torch_files.is_legacy(p) for p in tag.glob("*.pt"))
    r = export(case / "ckpt", tmp_path / "out", "--config", case / "config")
    assert_bitwise_equal(load_safetensors(tmp_path / "out" / "model.safetensors"),
                         load_safetensors(case / "reference" / "master.safetensors"))
