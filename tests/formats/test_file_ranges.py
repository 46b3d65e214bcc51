"""The one file-range reader (formats/file_ranges.py) and the one metadata validator (guards.dims).

A source file that ends before a range the checkpoint's metadata places in it fails the same way on
every path that reads one — the safetensors writer's kernel copy and its user-space fallback, the
torch.save writer of universal checkpoints, the torch-free cast, the mapped reads that assemble
slices: a LayoutError naming the file, the byte needed and the file's size; never a short result,
zeros, or an error naming the output file instead."""

import errno
import os

import numpy as np
import pytest

from hf_ckpt_integrations import guards
from hf_ckpt_integrations.assemble import iter_bytes
from hf_ckpt_integrations.casts import iter_cast
from hf_ckpt_integrations.commit import SiblingSwap
from hf_ckpt_integrations.errors import LayoutError
from hf_ckpt_integrations.formats.file_ranges import FileRange
from hf_ckpt_integrations.formats.out_tensor import OutTensor
from hf_ckpt_integrations.formats.torch_save_out import save
from hf_ckpt_integrations.mapped_files import MappedFiles
from hf_ckpt_integrations.orchestrator import write
from hf_ckpt_integrations.plan import Chunk, ExportPlan, Piece, TensorPlan
from helpers import leftovers

SHORT = r"src.bin: ends before byte 404, which the checkpoint's metadata reads \(100 bytes long: truncated"


@pytest.fixture
def short_src(tmp_path):
    """A 100-byte file whose tensor (100 fp32 at byte 4) needs 404."""
    (tmp_path / "ckpt").mkdir()
    src = tmp_path / "ckpt" / "src.bin"
    src.write_bytes(np.arange(25, dtype=np.float32).tobytes())
    return src


def _plan(src, tensors):
    return ExportPlan("test", str(src.parent), None, tensors)


@pytest.mark.parametrize("how", ["kernel", "exdev", "absent"])
def test_safetensors_writer_refuses_a_truncated_source(tmp_path, short_src, monkeypatch, how):
    """write_shard's copy, by copy_file_range and by its user-space fallback."""
    if how == "exdev":
        def refuse(*a):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    elif how == "absent":
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    t = TensorPlan("x", (100,), "F32", [[Piece(str(short_src), 4, 100, "F32")]], out_dtype="F32")
    with pytest.raises(LayoutError, match=SHORT):
        write(_plan(short_src, [t]), SiblingSwap(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_torch_save_writer_refuses_a_truncated_source(tmp_path, short_src):
    """The universal checkpoint's torch.save writer named its own output and a record size before."""
    with open(tmp_path / "out.pt", "wb") as fh, pytest.raises(LayoutError, match=SHORT):
        save({"param": OutTensor("param", "F32", (100,), lambda: [FileRange(str(short_src), 4, 400)])}, fh)


def test_cast_refuses_a_truncated_source(short_src):
    with pytest.raises(LayoutError, match=SHORT):
        list(iter_cast([Piece(str(short_src), 4, 100, "F32")], "BF16", MappedFiles()))


def test_mapped_reads_refuse_a_truncated_source(short_src):
    """A slice of a map past its end comes back short: assembled tensors and verify read this way."""
    with MappedFiles() as files:
        with pytest.raises(LayoutError, match=SHORT):
            files.read(str(short_src), 4, 400)
        t = TensorPlan.from_chunks("x", (2, 50), "F32", [Chunk([Piece(str(short_src), 0, 50, "F32")], (0, 0), (2, 25)),
                                                       Chunk([Piece(str(short_src), 4, 50, "F32")], (0, 25), (2, 25))])
        t.out_dtype = "F32"
        with pytest.raises(LayoutError, match=r"src.bin: ends before byte 200,"):
            list(iter_bytes(t, "F32", files))


def test_a_whole_range_reads_through(tmp_path):
    data = np.random.default_rng(0).integers(0, 2**32, 3000, dtype=np.uint32).tobytes()
    src = tmp_path / "src.bin"
    src.write_bytes(b"HEAD" + data)
    t = TensorPlan("x", (3000,), "F32", [[Piece(str(src), 4, 3000, "F32")]], out_dtype="F32")
    with MappedFiles() as files:
        assert b"".join(bytes(c) for c in iter_bytes(t, "F32", files)) == data


@pytest.mark.parametrize("value, ok", [((1, 2), True), ([3, 0], True), ((), True), ((1, -1), False),
                                       ((True, 2), False), ((1.0,), False), ("12", False), (None, False),
                                       ((1,) * 65, False)])
def test_dims_is_the_one_validator(value, ok):
    if ok:
        assert guards.dims(value, "shape", "f.pt") == tuple(value)
    else:
        with pytest.raises(LayoutError, match=r"^f.pt: shape .* is not a list of at most 64 non-negative integers"):
            guards.dims(value, "shape", "f.pt")
