"""torch DCP / FSDP2 checkpoints (hf_ckpt_integrations/sources/dcp.py).

Engine cases (real torchrun processes, gloo on CPU, see tests/engines/fsdp_train.py): plain
``fully_shard`` + ``dcp.save`` (vocabulary 1001 over 2 ranks: uneven shards), Accelerate FSDP2
``save_state``, the Trainer under FSDP2 (``checkpoint-2`` and ``checkpoint-4``). Reference: the
engine's own ``get_model_state_dict(full_state_dict=True)`` at the last save, bitwise.

Synthetic cases: DCP directories written here with torch's own metadata classes and ``torch.save``
chunks laid in one ``.distcp`` file as FileSystemWriter lays them (milliseconds): uneven and
empty shards, a 2-D split, and the refusals (hostile pickle, overlap, gap, truncation).
"""

import io
import os
import pickle
import shutil

import pytest
import torch

from dcp_build import write_dcp
from helpers import (assert_bitwise_equal, assert_refused, export, hf_ckpt, load_hf_state, load_safetensors,
                    read_export, tree_digest)


# ---------------------------------------------------------------- synthetic DCP directories


def _rows(n, ranks):
    """FSDP2's dim-0 chunks of ``n`` rows over ``ranks`` (ceil-sized, the last ones short or empty)."""
    per = -(-n // ranks)
    return [(r * per, max(0, min(per, n - r * per))) for r in range(ranks)]


def _dim0(full, ranks):
    return [((o,) + (0,) * (full.dim() - 1), (s,) + tuple(full.shape[1:])) for o, s in _rows(full.shape[0], ranks)]


def test_synthetic_uneven_and_empty_shards_and_2d_split_export_bitwise(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 5, generator=g)  # 4 ranks: rows 2, 2, 2, 1
    b = torch.randn(3, generator=g)  # 4 ranks: 1, 1, 1, 0 (an empty last shard)
    c = torch.randn(6, 8, generator=g).to(torch.bfloat16)  # 2-D mesh: dim 0 over 2, dim 1 over 2
    grid = [((r, k), (3, 4)) for k in (4, 0) for r in (3, 0)]  # recorded out of order on purpose
    d = torch.randn(2, 5, 6, generator=g)  # split along dims 1 and 2 (uneven), never dim 0
    blocks = [((0, o1, o2), (2, s1, s2)) for o1, s1 in ((0, 3), (3, 2)) for o2, s2 in ((0, 4), (4, 2))]
    s = torch.tensor(3.5)
    src = write_dcp(tmp_path / "dcp", {"a": (a, _dim0(a, 4)), "b": (b, _dim0(b, 4)), "c": (c, grid),
                                       "d": (d, blocks), "s": (s, [((), ())])},
                    nest=None, extra={"optimizer.param_groups.0.lr": None})
    export(src, tmp_path / "out", "--weights-only")  # synthetic: no model config
    out = read_export(tmp_path / "out")
    assert set(out) == {"a", "b", "c", "d", "s"}
    for name, want in {"a": a, "b": b, "c": c, "d": d, "s": s}.items():
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), name
    v = hf_ckpt("verify", tmp_path / "out", "--against", src)
    assert v.returncode == 0, v.stdout + v.stderr
    info = hf_ckpt("inspect", src, "--json")
    assert info.returncode == 0 and '"torch-dcp"' in info.stdout, info.stderr


def test_synthetic_nested_state_dict_keeps_the_models_own_prefix(tmp_path):
    w = torch.arange(12.0).view(4, 3)
    src = write_dcp(tmp_path / "state" / "pytorch_model_fsdp_0", {"model.embed.weight": (w, _dim0(w, 2))},
                    nest="model")
    export(tmp_path / "state", tmp_path / "out", "--weights-only")
    out = read_export(tmp_path / "out")
    assert list(out) == ["model.embed.weight"] and torch.equal(out["model.embed.weight"], w)
    assert src.is_dir()


def _mutate_metadata(src, fn):
    """Rewrite ``src/.metadata`` through torch's own classes (test side: our own file)."""
    with open(src / ".metadata", "rb") as fh:
        md = pickle.load(fh)  # noqa: S301 - a file this test wrote
    fn(md)
    with open(src / ".metadata", "wb") as fh:
        pickle.dump(md, fh)


def _two_chunk_dcp(tmp_path):
    w = torch.arange(20.0).view(5, 4)
    return write_dcp(tmp_path / "dcp", {"w": (w, _dim0(w, 2))}, nest=None)


def _refused(tmp_path, src, match):
    digest = tree_digest(src)
    r = hf_ckpt("export", src, tmp_path / "out")
    return assert_refused(r, match=match, dst=tmp_path / "out", src=src, digest=digest)


def test_overlapping_chunks_are_refused(tmp_path):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    src = _two_chunk_dcp(tmp_path)

    def overlap(md):
        chunks = md.state_dict_metadata["w"].chunks
        chunks[1] = ChunkStorageMetadata(torch.Size([2, 0]), chunks[1].sizes)
    _mutate_metadata(src, overlap)
    # (the reason, not "overlap" alone: pytest's temp path of this test holds that word too)
    line = _refused(tmp_path, src, "do not tile its size [5, 4] (chunks 0 and 1 overlap)")
    assert line.startswith(f"error: {src / '.metadata'}: the chunks recorded for w"), line


def test_missing_chunk_is_refused(tmp_path):
    src = _two_chunk_dcp(tmp_path)
    _mutate_metadata(src, lambda md: md.state_dict_metadata["w"].chunks.pop())
    line = _refused(tmp_path, src, "a gap")
    assert ".metadata" in line


def test_chunk_without_storage_entry_is_refused(tmp_path):
    src = _two_chunk_dcp(tmp_path)

    def drop(md):
        key = next(k for k in md.storage_data if tuple(k.offset)[0] != 0)
        del md.storage_data[key]
    _mutate_metadata(src, drop)
    _refused(tmp_path, src, "no storage entry")


def test_truncated_distcp_is_refused(tmp_path):
    src = _two_chunk_dcp(tmp_path)
    f = src / "__1_0.distcp"
    f.write_bytes(f.read_bytes()[:-100])
    _refused(tmp_path, src, "__1_0.distcp")


def test_missing_distcp_is_refused(tmp_path):
    src = _two_chunk_dcp(tmp_path)
    (src / "__0_0.distcp").unlink()
    _refused(tmp_path, src, "__0_0.distcp")


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_is_refused_unexecuted(tmp_path):
    src = _two_chunk_dcp(tmp_path)
    marker = tmp_path / "pwned"
    _mutate_metadata(src, lambda md: setattr(md, "planner_data", {"w": _Evil(marker)}))
    line = _refused(tmp_path, src, "refused for safety")
    assert "system" in line and not marker.exists()
    r = hf_ckpt("inspect", src)
    assert_refused(r, match="refused for safety")
    assert not marker.exists()


def test_hostile_chunk_archive_is_refused_unexecuted(tmp_path):
    src = _two_chunk_dcp(tmp_path)
    marker = tmp_path / "pwned"
    buf = io.BytesIO()
    torch.save(_Evil(marker), buf)
    f = src / "__0_0.distcp"
    data = f.read_bytes()

    def repoint(md):  # the first chunk now names the hostile archive appended to its file
        for key, info in md.storage_data.items():
            if info.relative_path == "__0_0.distcp":
                info.offset, info.length = len(data), len(buf.getvalue())
                break
    f.write_bytes(data + buf.getvalue())
    _mutate_metadata(src, repoint)
    _refused(tmp_path, src, "refused for safety")
    assert not marker.exists()


# ---------------------------------------------------------------- real engine runs

ENGINE_CASES = {"fsdp2-plain": "dcp", "fsdp2-accelerate": "state", "fsdp2-trainer": "run/checkpoint-4",
                "fsdp2-hf-writer": "hf",
                # FSDP1 under SHARDED_STATE_DICT, with original params and with flat params
                "fsdp1": "state", "fsdp1-flat": "state"}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_export_is_bitwise_the_engines_full_state_dict(engine_ckpt, tmp_path, case):
    root = engine_ckpt(case)
    src = root / ENGINE_CASES[case]
    digest = tree_digest(src)
    args = ["--config", root / "config"]  # (an FSDP checkpoint-N holds no config.json)
    r = export(src, tmp_path / "out", *args)
    assert tree_digest(src) == digest
    reference = load_safetensors(root / "reference.safetensors")
    assert_bitwise_equal(load_hf_state(tmp_path / "out", torch.float32), reference)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.json", "model.safetensors"], files
    from transformers import AutoModelForCausalLM

    import common

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        logits = model(common.probe_input()).logits
    torch.testing.assert_close(logits, torch.load(root / "logits.pt"), rtol=1e-5, atol=1e-5)
    v = hf_ckpt("verify", tmp_path / "out", "--against", src, *args)
    assert v.returncode == 0, v.stdout + v.stderr


def test_engine_inspect_describes_the_dcp_checkpoint(engine_ckpt):
    import json

    root = engine_ckpt("fsdp2-plain")
    r = hf_ckpt("inspect", root / "dcp", "--json", "--config", root / "config")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["engine"] == "torch-dcp" and info["dp_size"] == 2 and info["dtypes"] == {"module": "F32"}
    assert any("chunks per tensor: 2" in n for n in info["notes"]), info["notes"]
    assert any("optimizer" in n for n in info["notes"]), info["notes"]
    assert "optimizer" not in " ".join(t["name"] for t in info["tensors"])


def test_hf_writer_with_a_rank_file_missing_is_refused(engine_ckpt, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(engine_ckpt("fsdp2-hf-writer") / "hf", src)
    (src / "shard-00001-model-00001-of-00001.safetensors").unlink()
    line = _refused(tmp_path, src, "a gap")
    assert "shard is missing" in line


def test_trainer_fsdp2_both_checkpoints_export(engine_ckpt, tmp_path):
    """checkpoint-2 exports too (no reference at step 2: it must load and differ from step 4)."""
    root = engine_ckpt("fsdp2-trainer")
    r = export(root / "run" / "checkpoint-2", tmp_path / "out2", "--config", root / "config")
    state = load_hf_state(tmp_path / "out2", torch.float32)
    reference = load_safetensors(root / "reference.safetensors")
    assert set(state) >= set(reference)
    assert any(not torch.equal(state[k], reference[k]) for k in reference)


# ---------------------------------------------------------------- save time under FSDP2


def test_accelerate_save_model_under_fsdp2_writes_a_complete_hf_dir(engine_ckpt):
    import json

    root = engine_ckpt("fsdp2-accelerate-hooks")
    saved = root / "saved"
    names = sorted(p.name for p in saved.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00001-of-00003.safetensors",
                     "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                     "model.safetensors.index.json"], names
    assert json.loads((saved / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_bitwise_equal(load_hf_state(saved, torch.float32), load_safetensors(root / "reference.safetensors"))


def test_trainer_callback_under_fsdp2_makes_every_checkpoint_loadable_and_resume_works(engine_ckpt):
    root = engine_ckpt("fsdp2-trainer-cb")
    reference = load_safetensors(root / "reference.safetensors")
    states = {}
    for step in (2, 4):
        ckpt = root / "run" / f"checkpoint-{step}"
        assert (ckpt / "config.json").is_file() and (ckpt / "pytorch_model_fsdp_0").is_dir()
        states[step] = load_hf_state(ckpt, torch.float32)
    assert_bitwise_equal(states[4], reference)
    assert any(not torch.equal(states[2][k], reference[k]) for k in reference)
    # The same checkpoint exports offline to the same bytes (the DCP files stay the source of truth).
    resumed = engine_ckpt("fsdp2-trainer-cb-resume")
    assert not (resumed / "run" / "checkpoint-2").exists()  # resumed at step 2: only step 4 saved
    assert_bitwise_equal(load_hf_state(resumed / "run" / "checkpoint-4", torch.float32), states[4])
