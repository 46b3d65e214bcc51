"""The formats layer (``hf_ckpt_integrations.formats``): one dtype table, one safetensors header
reader/writer, one home for HF names, one config writer. Pure and fast: no engine, no process."""

import json

import numpy as np
import pytest
import torch

from hf_ckpt_integrations.errors import CheckpointError, OptionError
from hf_ckpt_integrations.formats import config, dtypes, names, safetensors as st


def test_dtype_table_agrees_with_torch_and_safetensors():
    """Every safetensors name maps to the torch dtype of the same size, and back; user names map once."""
    from safetensors.torch import _SIZE, _TYPES  # safetensors' own table: ours must agree with it

    for name, size in dtypes.SIZES.items():
        t = dtypes.to_torch(name)
        assert torch.empty(0, dtype=t).element_size() == size, name
        assert dtypes.from_torch(t) == dtypes.from_torch(str(t)) == name
        assert _TYPES[name] == t and _SIZE[t] == size
    assert {n for n in dtypes.SIZES if torch.empty(0, dtype=dtypes.to_torch(n)).is_floating_point()} == dtypes.FLOATS
    for user, want in (("fp32", "F32"), ("BF16", "BF16"), ("half", "F16"), ("float16", "F16"), (None, None)):
        assert dtypes.from_user(user) == want
    assert [dtypes.to_user(d) for d in ("F32", "BF16", "F16", "I64")] == ["fp32", "bf16", "fp16", None]
    with pytest.raises(OptionError, match="use one of fp32, bf16, fp16"):
        dtypes.from_user("fp8")
    with pytest.raises(ValueError, match="no safetensors name"):
        dtypes.from_torch(torch.complex64)
    for d, bits in dtypes.NUMPY_BITS.items():
        assert np.dtype(bits).itemsize == dtypes.SIZES[d]


def test_training_dtype_is_the_one_float_dtype():
    assert dtypes.training_dtype(torch.nn.Linear(2, 2).to(torch.bfloat16)) == "bf16"
    mixed = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).half())
    assert dtypes.training_dtype(mixed) is None and dtypes.training_dtype(None) is None
    assert dtypes.training_dtype(torch.nn.Linear(2, 2).to(torch.float8_e4m3fn)) is None  # not ours: no crash


def test_header_written_is_what_safetensors_writes_and_reads(tmp_path):
    """encode_header + raw bytes == safetensors.torch.save_file's file, and read_header reads it back."""
    from safetensors.torch import save_file

    tensors = {"b": torch.arange(6, dtype=torch.float32).view(2, 3), "a": torch.ones(3, dtype=torch.bfloat16),
               "c": torch.tensor([1, 2], dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    # safetensors lays tensors out largest dtype first, then by name: so does the writer.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    ours = st.encode_header((n, dtypes.from_torch(tensors[n].dtype), tuple(tensors[n].shape)) for n in order)
    ours += b"".join(tensors[n].contiguous().view(torch.uint8).numpy().tobytes() for n in order)
    assert ours == (tmp_path / "ref.safetensors").read_bytes()
    header = st.read_header(tmp_path / "ref.safetensors")
    assert header.metadata == {"format": "pt"} and list(header.tensors) == order
    assert header.tensors["b"].dtype == "F32" and header.tensors["b"].shape == (2, 3)
    assert header.data_start + sum(e.nbytes for e in header.tensors.values()) == header.file_size
    assert st.floating_dtypes([tmp_path / "ref.safetensors"]) == {"F32", "BF16"}


# damage -> the reason read_header gives (what its own check found, after the file name)
_HEADER_DAMAGE = {
    "trailing byte": "the tensors end at byte 80 of 81 (truncated, or trailing bytes)",
    "unknown dtype": "w: dtype 'F8_E4M3X' unknown",
    "bad shape": "w: shape [-2] is not a list of non-negative integers",
    "length past the end": "header length 1099511627776 exceeds the file",
    "duplicate name": "a name appears twice in the header",
    "size mismatch": "w: 8 bytes for shape [3] of F32",
    "hole": "v: data starts at 12, the previous tensor ends at 8 (a hole or an overlap)",
    "overlap": "v: data starts at 4, the previous tensor ends at 8 (a hole or an overlap)",
}


@pytest.mark.parametrize("damage", sorted(_HEADER_DAMAGE))
def test_read_header_refuses_what_safetensors_refuses(tmp_path, damage):
    """Each check of the header alone (``check_loader=False``: safetensors' own loader, which
    refuses the same files, must not be what refuses them here)."""
    path = tmp_path / "x.safetensors"
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    head, data = {"w": entry}, b"\0" * 8
    text = None
    if damage == "trailing byte":
        data += b"\0"
    elif damage == "unknown dtype":
        head["w"] = {**entry, "dtype": "F8_E4M3X", "data_offsets": [0, 2]}
        data = b"\0" * 2
    elif damage == "bad shape":
        head["w"] = {**entry, "shape": [-2]}
    elif damage == "duplicate name":
        text = '{"w": %s, "w": %s}' % (json.dumps(entry), json.dumps(entry))
    elif damage == "size mismatch":
        head["w"] = {**entry, "shape": [3]}
    elif damage in ("hole", "overlap"):
        start = 12 if damage == "hole" else 4
        head["v"] = {**entry, "data_offsets": [start, start + 8]}
        data = b"\0" * (start + 8)
    raw = (text or json.dumps(head)).encode()
    if damage == "trailing byte":
        raw += b" " * (64 - len(raw))  # a fixed header length, so the reason's byte counts are known
    length = len(raw) if damage != "length past the end" else 2**40
    path.write_bytes(length.to_bytes(8, "little") + raw + data)
    with pytest.raises(CheckpointError) as e:
        st.read_header(path, check_loader=False)
    prefix = f"{path}: not a valid safetensors file ("
    assert str(e.value).startswith(prefix), str(e.value)
    assert str(e.value)[len(prefix):].startswith(_HEADER_DAMAGE[damage]), str(e.value)


def test_names_and_index(tmp_path):
    """Shard names are huggingface_hub's, the index is save_pretrained's shape, and an index that
    names a path outside its directory is refused."""
    items = {f"t{i}": 400 for i in range(5)}
    split = names.split_shards(items, lambda n: n, max_shard_size=1000)
    assert list(split.filename_to_tensors)[0] == "model-00001-of-00003.safetensors"
    split = names.split_shards(items, lambda n: n, max_shard_size=1000, pattern=names.BIN_PATTERN)
    assert list(split.filename_to_tensors)[-1] == "pytorch_model-00003-of-00003.bin"
    path = names.write_index(tmp_path, {"b": "f2", "a": "f1"}, total_size=10)
    assert json.loads(open(path).read()) == {"metadata": {"total_size": 10}, "weight_map": {"a": "f1", "b": "f2"}}
    assert names.read_index(path) == {"a": "f1", "b": "f2"}
    assert names.weight_names(tmp_path) == ("safetensors", names.SAFETENSORS_INDEX, ["f1", "f2"])
    with pytest.raises(FileExistsError):  # a new file only, never over what is there
        names.write_index(tmp_path, {"a": "f1"}, total_size=10)
    (tmp_path / "bad").mkdir()
    bad = names.write_index(tmp_path / "bad", {"a": "../f1"}, total_size=10)
    with pytest.raises(CheckpointError, match="not a file name"):
        names.read_index(bad)
    assert names.SAVED_WEIGHTS_RE.match("model-00001-of-00002.safetensors")
    assert not names.SAVED_WEIGHTS_RE.match("optimizer.pt")
    assert names.WEIGHT_FILES_RE.match("pytorch_model-00001.bin")  # ColossalAI's own numbering
    assert (names.ADAPTER_CONFIG_NAME, names.ADAPTER_SAFETENSORS_NAME) == ("adapter_config.json",
                                                                          "adapter_model.safetensors")


class _Config:
    def __init__(self):
        self.architectures = None

    def save_pretrained(self, directory):
        with open(f"{directory}/config.json", "w") as fh:
            json.dump({"architectures": self.architectures, "model_type": "toy"}, fh)


class _Gen:
    def save_pretrained(self, directory):
        open(f"{directory}/generation_config.json", "w").write("{}")


class _Model:
    def __init__(self, generates):
        self.config, self.generation_config, self._generates = _Config(), _Gen(), generates

    def can_generate(self):
        return self._generates


def test_one_config_policy(tmp_path, monkeypatch):
    """A live model's generation config is written only when it can generate (save_pretrained's
    rule); config.json records the dtype of the tensors written — their one dtype, or the first
    floating one when mixed — under the key the config already holds."""
    monkeypatch.setattr(config, "transformers_major", lambda: 5)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    assert config.write_config(a, model=_Model(True), tensor_dtypes=["I64", "BF16", "F32"]) == [
        "config.json", "generation_config.json"]
    assert json.loads((a / "config.json").read_text())["dtype"] == "bfloat16"
    assert config.write_config(b, model=_Model(False), tensor_dtypes=["F16"]) == ["config.json"]
    assert not (b / "generation_config.json").exists()
    # Offline: the files of the config dir are copied, then the same dtype rule; an existing key is kept.
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({"torch_dtype": "float32"}))
    (tmp_path / "cfg" / "tokenizer.json").write_text("{}")
    (tmp_path / "c").mkdir()
    got = config.write_config(tmp_path / "c", config_dir=str(tmp_path / "cfg"), tensor_dtypes=["F16", "F32"])
    assert got == ["config.json", "tokenizer.json"]
    assert json.loads((tmp_path / "c" / "config.json").read_text()) == {"torch_dtype": "float16"}
    assert config.record_dtype(tmp_path / "c", ["I64"]) is None  # no floating tensor: nothing recorded
