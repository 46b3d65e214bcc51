"""ConsolidatedCheckpointCallback on real Trainer + DeepSpeed runs (2 ranks, torchrun, CPU/gloo).

Every ``checkpoint-N/`` loads with ``from_pretrained``, bitwise equal to the weights the engine
reported inside the same save; resuming from such a directory gives the uninterrupted losses.
"""

import json

import pytest
import torch

from helpers import assert_bitwise_equal as _assert_equal
from helpers import load_hf_state as _load
from helpers import load_safetensors

pytestmark = pytest.mark.engine


def _header_dtypes(path):
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def _weight_bytes(directory):
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def _run(case):
    return json.loads((case / "reference" / "run.json").read_text())


def _metrics(case):
    return [json.loads((case / "metrics" / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_zero3_every_checkpoint_loads_bitwise_sharded_over_both_ranks(engine_ckpt):
    """ZeRO-3, gather flag false (the Trainer writes no weights at all), save_total_limit=2."""
    case = engine_ckpt("cb-z3")
    run = case / "run"
    # Rotation: checkpoint-2 was deleted by the Trainer; the two kept ones are complete.
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    for step in (4, 6):
        ckpt = run / f"checkpoint-{step}"
        index = json.loads((ckpt / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) == 3 and not (ckpt / "model.safetensors").exists()
        assert not list(ckpt.glob(".hfckpt*")), "staging directory left behind"
        ref = case / "reference" / f"checkpoint-{step}"
        masters = load_safetensors(ref / "master.safetensors")
        _assert_equal(_load(ckpt, torch.float32), masters)  # fp32 training: module == masters
        tensor_bytes = sum(t.numel() * 4 for t in masters.values())
        assert index["metadata"]["total_size"] == tensor_bytes
        assert _weight_bytes(ckpt) <= tensor_bytes * 1.01
    # Shard i is written by rank i % 2: both ranks wrote, nothing twice.
    m0, m1 = _metrics(case)
    for step in ("checkpoint-4", "checkpoint-6"):
        assert m0["written_here"][step] == ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"]
        assert m1["written_here"][step] == ["model-00002-of-00003.safetensors"]


def test_final_model_helper_makes_output_dir_loadable(engine_ckpt):
    case = engine_ckpt("cb-z3")
    final = case / "final"
    assert _run(case)["final"]["action"] == "written"
    _assert_equal(_load(final, torch.float32), load_safetensors(case / "reference" / "final" / "module.safetensors"))
    assert (final / "config.json").exists()


def test_failure_on_one_rank_raises_on_every_rank_and_leaves_checkpoint_untouched(engine_ckpt):
    case = engine_ckpt("cb-z3")
    seen = [json.loads((case / "fail" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for s in seen:
        assert s["raised"] and s["type"] == "WriteError", s
        assert list(s["failures"]) == ["1"] and "No space left on device" in s["failures"]["1"]
        assert "rank 1" in s["message"] and "model-00002-of-" in s["message"]
    assert seen[0]["unchanged"] and seen[0]["leftovers"] == []


def test_resume_from_consolidated_checkpoint_gives_uninterrupted_losses(engine_ckpt):
    full = engine_ckpt("cb-z3")
    resumed = engine_ckpt("cb-z3-resume")  # a fresh torchrun resuming from cb-z3/run/checkpoint-4
    a, b = _run(full)["losses"], _run(resumed)["losses"]
    assert _run(resumed)["resumed_from"].endswith("cb-z3/run/checkpoint-4")
    assert [a[s] for s in ("5", "6")] == [b[s] for s in ("5", "6")]
    # and the resumed run's own last checkpoint holds the same bytes as the uninterrupted one
    for shard in sorted((full / "run" / "checkpoint-6").glob("model-*.safetensors")):
        assert shard.read_bytes() == (resumed / "run" / "checkpoint-6" / shard.name).read_bytes(), shard.name


def test_zero2_last_only_replaces_trainer_weights_with_requested_dtype(engine_ckpt):
    """ZeRO-2 with dtype="bf16", checkpoints="last": earlier checkpoints keep the Trainer's own fp32
    model.safetensors untouched; the last one holds the bf16 cast of the fp32 masters instead."""
    case = engine_ckpt("cb-z2-last")
    run = case / "run"
    assert list(_run(case)["reports"]) == ["checkpoint-6"]
    for step in (2, 4):
        ckpt = run / f"checkpoint-{step}"
        assert _header_dtypes(ckpt / "model.safetensors") == {"F32"}
        _assert_equal(_load(ckpt, torch.float32),
                      load_safetensors(case / "reference" / f"checkpoint-{step}" / "module.safetensors"))
    last = run / "checkpoint-6"
    assert _header_dtypes(last / "model.safetensors") == {"BF16"}
    masters = load_safetensors(case / "reference" / "checkpoint-6" / "master.safetensors")
    _assert_equal(_load(last, torch.bfloat16), {n: t.to(torch.bfloat16) for n, t in masters.items()})
    assert _weight_bytes(last) <= sum(t.numel() * 2 for t in masters.values()) * 1.01


def test_zero3_gather_true_keeps_trainer_weights(engine_ckpt):
    case = engine_ckpt("cb-z3-gather")
    run = _run(case)
    for step in (2, 4, 6):
        assert run["reports"][f"checkpoint-{step}"]["action"] == "kept"
        ckpt = case / "run" / f"checkpoint-{step}"
        assert _header_dtypes(ckpt / "model.safetensors") == {"F32"}
        module = load_safetensors(case / "reference" / f"checkpoint-{step}" / "module.safetensors")
        _assert_equal(_load(ckpt, torch.float32), module)
    assert run["final"]["action"] == "kept"
    _assert_equal(_load(case / "final", torch.float32),
                  load_safetensors(case / "reference" / "final" / "module.safetensors"))


def test_callback_rejects_bad_options():
    from hf_ckpt_integrations import ConsolidatedCheckpointCallback

    with pytest.raises(ValueError, match="checkpoints="):
        ConsolidatedCheckpointCallback(checkpoints="some")
    with pytest.raises(ValueError, match="unknown dtype"):
        ConsolidatedCheckpointCallback(dtype="int3")
