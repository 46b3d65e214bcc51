"""What reading a checkpoint refuses, and which check refuses it: rank files out of place (the
ZeRO-1/2 placement proof), DCP chunks that are not what ``.metadata`` records, and the unpickler's
budgets, each at its limit and one past it. Each refusal names the file and its reason; the
assertions match the reason (the text after the file name), never words a temp path may hold.
Committed fixtures and files made here, in this process: no engine run.
"""

import os
import pickle
import pickletools
import shutil

import pytest
import torch

from hf_ckpt_integrations import api, safe_load
from hf_ckpt_integrations.errors import CheckpointError, LayoutError


def _reason(err, path) -> str:
    text = str(err)
    assert text.startswith(f"{path}: "), text
    return text[len(f"{path}: "):]


# ---------------------------------------------------------------- ZeRO-1/2 placement proof

def _partition(src, rank):
    """(file, byte offset, nbytes) of the fp32 flat partition of rank ``rank`` (its whole storage)."""
    f = src / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    ref = safe_load.load(f)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    return f, ref.storage.offset, ref.storage.numel * ref.itemsize


@pytest.mark.parametrize("damage", ["rolled by one element", "swapped with rank 1's"])
def test_partition_out_of_place_is_refused_by_the_placement_proof(committed_zero2, tmp_path, damage):
    """The recorded ``param_slice_mappings`` stay right (they are in the pickle), only the partition
    bytes move: nothing but the comparison with the module weights can tell."""
    src = committed_zero2 / "ckpt"
    f0, off0, n0 = _partition(src, 0)
    data0 = f0.read_bytes()
    if damage == "rolled by one element":
        part = data0[off0:off0 + n0]
        f0.write_bytes(data0[:off0] + part[-4:] + part[:-4] + data0[off0 + n0:])
    else:
        f1, off1, n1 = _partition(src, 1)
        assert n0 == n1
        data1 = f1.read_bytes()
        f0.write_bytes(data0[:off0] + data1[off1:off1 + n1] + data0[off0 + n0:])
        f1.write_bytes(data1[:off1] + data0[off0:off0 + n0] + data1[off1 + n1:])
    with pytest.raises(LayoutError) as e:
        api.export_checkpoint(src, tmp_path / "out")
    assert _reason(e.value, f0).startswith(
        "its fp32 partition of parameter group 0 does not match the model's own weights "
        "(mp_rank_00_model_states.pt) at its place as data-parallel rank 0"), str(e.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- DCP chunks

@pytest.mark.parametrize("stored", ["transposed", "transposed in place"])
def test_dcp_chunk_stored_transposed_is_refused(tmp_path, stored):
    """A (4, 2) chunk saved as its (2, 4) transpose holds the same number of elements: only the
    shape check tells; saved as a column-major view of the right shape, only the layout does."""
    from test_dcp import write_dcp

    w = torch.arange(16.0).view(4, 4)
    blocks = [((0, 0), (4, 2)), ((0, 2), (4, 2))]

    def store(fqn, j, piece):
        if j != 1:
            return piece
        return piece.t().contiguous() if stored == "transposed" else piece.t().contiguous().t()
    src = write_dcp(tmp_path / "dcp", {"w": (w, blocks)}, stored=store)
    with pytest.raises(CheckpointError) as e:
        api.export_checkpoint(src, tmp_path / "out")
    reason = _reason(e.value, src / "__1_0.distcp")  # chunk 1 of the first tensor
    if stored == "transposed":
        assert reason.startswith("bytes ") and reason.split(" hold ", 1)[1].startswith(
            "F32 [2, 4], but .metadata records the chunk of w as F32 [4, 2]"), str(e.value)
    else:
        assert reason.startswith("tensor in storage 0 is not contiguous"), str(e.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the unpickler's budgets
# Each budget patched small; the same file passes at the limit and is refused one below it, naming
# that budget (a budget dropped, or its comparison off by one, fails here).

def _write(tmp_path, obj_or_bytes, name="meta.pkl"):
    p = tmp_path / name
    p.write_bytes(obj_or_bytes if isinstance(obj_or_bytes, bytes) else pickle.dumps(obj_or_bytes, protocol=2))
    return p


def _loads(p):
    return safe_load.loads(p, allowed={})


def test_opcode_budget(tmp_path, monkeypatch):
    p = _write(tmp_path, list(range(50)))
    ops = sum(1 for _ in pickletools.genops(p.read_bytes()))
    monkeypatch.setattr(safe_load, "MAX_OPS", ops)
    assert _loads(p) == list(range(50))
    monkeypatch.setattr(safe_load, "MAX_OPS", ops - 1)
    with pytest.raises(CheckpointError) as e:
        _loads(p)
    assert _reason(e.value, p).startswith(f"its pickle runs past {ops - 1} operations"), str(e.value)


def test_node_budget(tmp_path, monkeypatch):
    p = _write(tmp_path, {"a": [0] * 20, "b": (1, 2)})  # 1 dict + 2 keys + 2 values + 20 + 2 atoms
    monkeypatch.setattr(safe_load, "MAX_NODES", 27)
    assert _loads(p)["b"] == (1, 2)
    monkeypatch.setattr(safe_load, "MAX_NODES", 26)
    with pytest.raises(CheckpointError) as e:
        _loads(p)
    assert _reason(e.value, p).startswith("its pickle describes over 26 objects"), str(e.value)


def test_shared_nodes_count_each_time_they_are_reached(tmp_path, monkeypatch):
    x = [0] * 10
    p = _write(tmp_path, [x, x, x])  # 1 + 3 + 30 when walked, 1 + 1 + 10 stored
    monkeypatch.setattr(safe_load, "MAX_NODES", 34)
    assert _loads(p) == [x, x, x]
    monkeypatch.setattr(safe_load, "MAX_NODES", 33)
    with pytest.raises(CheckpointError, match="describes over 33 objects"):
        _loads(p)


def test_depth_budget(tmp_path, monkeypatch):
    deep = 0
    for _ in range(6):
        deep = [deep]  # 6 lists around an int: the int sits 6 levels below the top
    p = _write(tmp_path, deep)
    monkeypatch.setattr(safe_load, "MAX_DEPTH", 6)
    assert _loads(p) == deep
    monkeypatch.setattr(safe_load, "MAX_DEPTH", 5)
    with pytest.raises(CheckpointError) as e:
        _loads(p)
    assert _reason(e.value, p).startswith("its pickle nests deeper than 5 levels"), str(e.value)


def test_pickle_size_budget_of_a_plain_pickle(tmp_path, monkeypatch):
    p = _write(tmp_path, {"w": "x" * 100})
    size = p.stat().st_size
    monkeypatch.setattr(safe_load, "MAX_PICKLE_BYTES", size)
    assert _loads(p) == {"w": "x" * 100}
    monkeypatch.setattr(safe_load, "MAX_PICKLE_BYTES", size - 1)
    with pytest.raises(CheckpointError) as e:
        _loads(p)
    assert _reason(e.value, p).startswith(f"over {size - 1} bytes; no checkpoint's metadata is that large"), \
        str(e.value)


def test_pickle_size_budget_inside_a_torch_file(tmp_path, monkeypatch):
    p = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(3), "note": "x" * 100}, p)
    import zipfile

    with zipfile.ZipFile(p) as zf:
        size = next(i.file_size for i in zf.infolist() if i.filename.endswith("data.pkl"))
    monkeypatch.setattr(safe_load, "MAX_PICKLE_BYTES", size)
    assert safe_load.load(p)["note"] == "x" * 100
    monkeypatch.setattr(safe_load, "MAX_PICKLE_BYTES", size - 1)
    with pytest.raises(CheckpointError) as e:
        safe_load.load(p)
    assert _reason(e.value, p).startswith(f"its pickle is {size} bytes (over {size - 1})"), str(e.value)


def test_dimension_budget(tmp_path, monkeypatch):
    p = tmp_path / "w.pt"
    torch.save({"w": torch.zeros(1, 2, 1, 2)}, p)
    monkeypatch.setattr(safe_load, "MAX_NDIM", 4)
    assert safe_load.load(p)["w"].shape == (1, 2, 1, 2)
    monkeypatch.setattr(safe_load, "MAX_NDIM", 3)
    with pytest.raises(CheckpointError) as e:
        safe_load.load(p)
    assert "tensor shape is not a list of at most 3 integers" in _reason(e.value, p), str(e.value)


def test_dict_key_budget(tmp_path, monkeypatch):
    p = _write(tmp_path, {(1, 2, 3): "v"})
    monkeypatch.setattr(safe_load, "_MAX_KEY_LEN", 3)
    assert _loads(p) == {(1, 2, 3): "v"}
    monkeypatch.setattr(safe_load, "_MAX_KEY_LEN", 2)
    with pytest.raises(CheckpointError) as e:
        _loads(p)
    assert _reason(e.value, p).startswith("a dict key or set element of type tuple"), str(e.value)
