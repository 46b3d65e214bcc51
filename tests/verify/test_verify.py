"""``verify`` compares every tensor of an export with its source, bitwise, and checks the source's
own checksums: a damaged tensor anywhere in the export, or a flipped bit in the source, is named.
On a private copy of a committed DeepSpeed checkpoint, in this process: no engine run.
"""

import random

import pytest
import torch

from hf_ckpt_integrations import api
from hf_ckpt_integrations.formats.safetensors import read_hf_dir
from hf_ckpt_integrations.sources import build_plan


@pytest.fixture
def exported(committed_zero2, tmp_path):
    """(source, export): the fixture exported in several shards, so tensors sit in different files."""
    src, dst = committed_zero2 / "ckpt", tmp_path / "exp"
    api.export_checkpoint(src, dst, max_shard_size="10KB")
    return src, dst


def _flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x10]))


def test_intact_export_checks_every_tensor(exported):
    src, dst = exported
    report = api.verify_checkpoint(dst, src)
    assert report.ok, report.differences
    assert report.checked == len(read_hf_dir(dst)) == len(build_plan(str(src)).tensors)
    assert len({path for path, *_ in read_hf_dir(dst).values()}) > 1, "want more than one shard"


def test_a_damaged_tensor_is_named_wherever_it_is(exported):
    """Every tensor in turn (first, last and each between): one flipped byte in its data, at a
    random position of it (seeded per tensor, different each run), is that tensor's difference alone."""
    src, dst = exported
    have = read_hf_dir(dst)
    seed = random.randrange(2**32)
    for i, (name, (path, _dtype, _shape, off, nbytes)) in enumerate(sorted(have.items(), key=lambda kv: kv[1][3])):
        pos = off + random.Random(seed + i).randrange(nbytes)
        _flip(path, pos)
        try:
            report = api.verify_checkpoint(dst, src)
        finally:
            _flip(path, pos)
        assert report.differences == [f"{name}: values differ from the source"], (name, pos, seed,
                                                                                 report.differences)
        assert report.checked == len(have), (name, report.checked)


def test_a_flipped_bit_in_the_source_fails_its_crc(exported):
    """Element 1 of rank 1's partition: the export-time placement samples do not read it, so only
    the zip's CRC-32 (the checksum torch wrote with the entry) can tell."""
    src, dst = exported
    plan = build_plan(str(src))
    piece = next(p for t in plan.tensors if t.kind == "master" for p in t.parts[0] if "rank_1" in p.path)
    _flip(piece.path, piece.offset + 4 + 1)
    report = api.verify_checkpoint(dst, src)
    crc = [d for d in report.differences if "fails its CRC-32 check" in d]
    assert len(crc) == 1 and crc[0].startswith(f"{piece.path}: entry ") and crc[0].endswith(
        "the source file is damaged, copy it again"), report.differences


def test_a_missing_and_an_extra_tensor_are_named(exported):
    """One tensor taken out of its shard and one the source does not have put in (the index updated
    to match, so only the comparison of names can tell)."""
    import json

    from safetensors.torch import load_file, save_file

    src, dst = exported
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    gone = sorted(index["weight_map"])[0]
    shard = dst / index["weight_map"].pop(gone)
    tensors = load_file(str(shard))
    del tensors[gone]
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"]["extra.weight"] = shard.name
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    report = api.verify_checkpoint(dst, src)
    assert sorted(report.differences) == sorted([f"{gone}: missing from {dst}",
                                                 f"extra.weight: in {dst} but not in the source"]), report.differences


def test_verify_finds_the_source_once(tmp_path, monkeypatch):
    """verify_checkpoint asks the registry once: the universal check, the export's config and the plan
    share the source it found."""
    import torch

    from hf_ckpt_integrations import export_checkpoint, verify_checkpoint
    from hf_ckpt_integrations.sources import registry

    src = tmp_path / "src"
    src.mkdir()
    torch.save({"a.weight": torch.ones(2, 3)}, src / "pytorch_model.bin")
    export_checkpoint(src, tmp_path / "out", weights_only=True)
    (tmp_path / "out" / "config.json").write_text("{}")  # what makes verify look for the export's config
    calls = []
    real = registry.find_source
    monkeypatch.setattr(registry, "find_source", lambda *a: calls.append(a) or real(*a))
    assert verify_checkpoint(tmp_path / "out", src).ok
    assert len(calls) == 1, calls
