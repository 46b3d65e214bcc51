"""The legacy torch.save reader streams: bounded memory and a budget on every scan, whatever the
file's size (hf_ckpt_integrations/formats/torch_legacy.py).

The pickles at the head of a legacy file are read one after another through the file's own small
buffer by the budgeted unpickler; nothing pre-scans them and nothing holds the file in memory. A
crafted file of hundreds of MB of opcodes is refused by a budget, naming the file, after reading a
few MB of it; a real 700 MB file (a sparse one, written here as torch's ``_legacy_save`` writes it)
is inspected in a bounded resident size (peak RSS of the subprocess: a generous bound only, no time).
"""

import collections
import os
import pickle
import pickletools
import subprocess
import sys

import pytest
import torch

from helpers import REPO, export_refused
from hf_ckpt_integrations.errors import CheckpointError
from hf_ckpt_integrations.formats import torch_files, torch_legacy, unpickler


def _header() -> bytes:
    """The three pickles torch's ``_legacy_save`` writes first (magic, protocol, sys info)."""
    return (pickle.dumps(torch_legacy.MAGIC, protocol=2) + pickle.dumps(1001, protocol=2)
            + pickle.dumps({"protocol_version": 1001, "little_endian": True,
                            "type_sizes": {"short": 2, "int": 4, "long": 4}}, protocol=2))


def _legacy_one_tensor(path, numel: int):
    """A legacy file holding ``{"w": float32 tensor of numel zeros}``, written as ``_legacy_save``
    writes it (object pickle with a persistent storage id, key list, count, raw bytes), the raw
    bytes a hole: a file of any size in no disk space or time."""
    storage = object()

    class Tensor:
        def __reduce__(self):
            return (torch._utils._rebuild_tensor_v2, (storage, 0, (numel,), (1,), False, collections.OrderedDict()))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", numel, None) if obj is storage else None

    with open(path, "wb") as fh:
        fh.write(_header())
        Pickler(fh, protocol=2).dump({"w": Tensor()})
        pickle.dump(["0"], fh, protocol=2)
        fh.write(numel.to_bytes(8, "little"))
        fh.truncate(fh.tell() + 4 * numel)
    return path


def test_the_hand_written_legacy_file_is_what_torch_reads(tmp_path):
    path = _legacy_one_tensor(tmp_path / "w.bin", 6)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.zeros(6))
    ref = torch_files.load(path)["w"]
    assert ref.shape == (6,) and ref.dtype == "F32" and ref.byte_range()[0] + 24 == path.stat().st_size


def _hostile(path, body: bytes, repeat: int):
    """A real legacy header, then ``body`` written ``repeat`` times as the object pickle."""
    with open(path, "wb") as fh:
        fh.write(_header() + b"\x80\x02")
        chunk = body * (2**20 // len(body))
        for _ in range(repeat * len(body) // len(chunk)):
            fh.write(chunk)
        fh.write(b".")
    return path


def test_hundreds_of_mb_of_opcodes_are_refused_by_a_budget(tmp_path):
    """300 MB of NONE opcodes: the unpickler's budget on the objects it holds refuses it after a few
    MB; before, a pre-scan walked every opcode of the first 512 MiB with no budget at all."""
    path = _hostile(tmp_path / "w.bin", b"N", 300 * 2**20)
    with pytest.raises(CheckpointError, match=r"its pickle holds over \d+ objects at once") as e:
        torch_files.load(path)
    assert str(e.value).startswith(f"{path}: ")
    src = tmp_path / "hf"
    src.mkdir()
    path.rename(src / "pytorch_model.bin")
    export_refused(src, tmp_path / "out", match=("pytorch_model.bin", "objects at once"))


def test_opcodes_that_hold_nothing_run_into_the_opcode_budget(tmp_path, monkeypatch):
    """NONE, POP repeated holds no object: the opcode budget (patched small here) refuses it."""
    path = _hostile(tmp_path / "w.bin", b"N0", 8 * 2**20)
    monkeypatch.setattr(unpickler, "MAX_OPS", 2**20)
    with pytest.raises(CheckpointError, match=f"its pickle runs past {2**20} operations"):
        torch_files.load(path)


def test_one_huge_object_is_refused_before_it_is_read(tmp_path):
    big = torch_legacy._MAX_READ + 1
    path = tmp_path / "w.bin"
    path.write_bytes(_header() + b"\x80\x02X" + big.to_bytes(4, "little"))
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size + big)  # the string's bytes: a hole
    with pytest.raises(CheckpointError, match=f"a pickled object of {big} bytes"):
        torch_files.load(path)


def test_the_pickles_bytes_budget(tmp_path, monkeypatch):
    """The same file passes with the budget at the end of its last pickle and is refused one below."""
    path = _legacy_one_tensor(tmp_path / "w.bin", 6)
    raw = path.read_bytes()
    end = 0
    for _ in range(5):  # header (3), object, key list
        end = next(pos for op, _, pos in pickletools.genops(raw[end:]) if op.name == "STOP") + end + 1
    monkeypatch.setattr(torch_legacy, "MAX_PICKLE_BYTES", end)
    assert torch_files.load(path)["w"].shape == (6,)
    monkeypatch.setattr(torch_legacy, "MAX_PICKLE_BYTES", end - 1)
    with pytest.raises(CheckpointError, match=f"run past {end - 1} bytes"):
        torch_files.load(path)


# Peak RSS of `hf-ckpt inspect` on an HF directory, in a fresh interpreter: VmHWM (ru_maxrss would
# carry over the parent's peak across exec).
_RSS = ("import runpy, sys\n"
        "sys.argv = ['hf-ckpt', 'inspect', sys.argv[1]]\n"
        "try:\n"
        "    runpy.run_module('hf_ckpt_integrations', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "hwm = next(l for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
        "print('peak_kib', hwm.split()[1], file=sys.stderr)\n")


def peak_rss_mib(src, repo=REPO) -> float:
    r = subprocess.run([sys.executable, "-c", _RSS, str(src)], capture_output=True, text=True, cwd=repo,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert r.returncode == 0, r.stderr
    return int(r.stderr.split("peak_kib")[-1].split()[0]) / 1024


def test_inspect_of_a_700_mb_legacy_file_stays_small(tmp_path):
    """Measured: 535 MiB before (the reader held the file's first 512 MiB), 24 MiB after (the
    interpreter and the package): the bound is generous, the old behaviour far above it."""
    src = tmp_path / "hf"
    src.mkdir()
    _legacy_one_tensor(src / "pytorch_model.bin", 175_000_000)  # 700 MB
    assert peak_rss_mib(src) < 200
