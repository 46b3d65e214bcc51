"""ZeRO-1/2 ``round_robin_gradients``: DeepSpeed deals each group's parameters out over its ranks
before flattening; ``param_shapes`` records the flat order, ``param_slice_mappings`` offsets counted
in the module order. The export places masters by the flat order, accepts exactly the mappings
DeepSpeed records under round robin, and still proves every place against the module weights."""

import json

import pytest
import torch

from hf_ckpt_integrations import export_checkpoint, inspect_checkpoint, verify_checkpoint
from hf_ckpt_integrations.sources.deepspeed import partitions
from hf_ckpt_integrations.sources.deepspeed.zero12 import _round_robin_recorded
from helpers import export_refused, load_safetensors, tampered_copy


def _deepspeed_reorder(count, dp):
    stage12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    # _round_robin_reorder uses nothing of the optimizer: DeepSpeed's own arithmetic on plain items.
    items, _ = stage12.DeepSpeedZeroOptimizer._round_robin_reorder(None, list(range(count)), dp)
    return items


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 5])
def test_round_robin_order_is_deepspeeds(dp):
    for count in range(12):
        assert partitions.round_robin_order(count, dp) == _deepspeed_reorder(count, dp), (count, dp)


def _recorded_by_deepspeed(module_numels, dp, rank):
    """The param_slice_mappings DeepSpeed's own _init_lp_to_hp_mapping gives ``rank`` when the
    module-order parameters are linked without offsets (what round robin does, no alignment padding)."""
    linkage = pytest.importorskip("deepspeed.utils.mixed_precision_linkage")
    params = [torch.zeros(n) for n in module_numels]
    size = -(-sum(module_numels) // dp)
    start = rank * size
    out = {}
    for i, (lp, lp_start) in enumerate(linkage._init_lp_to_hp_mapping(params, start, size, None)):
        name = f"p{next(k for k, q in enumerate(params) if q is lp)}"
        first = max(lp_start, start)
        out[name] = (min(lp_start + lp.numel(), start + size) - first, first - start)
    return out, size


@pytest.mark.parametrize("dp", [2, 3])
def test_round_robin_mappings_accepted_only_as_deepspeed_records_them(dp):
    module_numels = [35, 3, 44, 6, 45, 6, 13]
    order = partitions.round_robin_order(len(module_numels), dp)
    names = [f"p{k}" for k in order]  # param_shapes: the flat order
    numels = [module_numels[k] for k in order]
    total = sum(numels)
    for rank in range(dp):
        recorded, size = _recorded_by_deepspeed(module_numels, dp, rank)
        parts = [min(size, total - r * size) for r in range(dp)]
        pads = [size - p for p in parts]
        frags = partitions.zero12_fragments(numels, parts, pads)

        class Part:  # only .numel is read
            def __init__(self, n):
                self.numel = n

        assert partitions.check_slice_mappings(names, frags, rank, recorded), "the flat order alone explains them"
        assert _round_robin_recorded(names, numels, [Part(p) for p in parts], pads, rank, recorded)
        # Another rank's mappings never pass for this one: a swapped file is still refused.
        other, _ = _recorded_by_deepspeed(module_numels, dp, (rank + 1) % dp)
        assert not _round_robin_recorded(names, numels, [Part(p) for p in parts], pads, rank, other)


CASES = ["z2-round-robin-dp2", "z2-round-robin-dp3"]


@pytest.mark.engine
@pytest.mark.parametrize("name", CASES)
def test_round_robin_export_is_the_engine_masters(name, engine_ckpt, tmp_path):
    case = engine_ckpt(name)
    run = json.loads((case / "reference" / "run.json").read_text())
    assert run["module_is_master_cast"], "the reference masters are where the module weights are"
    assert run["flat_order"] != sorted(run["flat_order"]), "the run must reorder its flat group"
    export_checkpoint(case / "ckpt", tmp_path / "hf", weights_only=True)  # no config: the engine's own names
    out = load_safetensors(tmp_path / "hf" / "model.safetensors")
    masters = load_safetensors(case / "reference" / "master.safetensors")
    assert set(out) == set(masters)
    assert [n for n in masters if not torch.equal(out[n], masters[n])] == []
    assert verify_checkpoint(tmp_path / "hf", against=case / "ckpt").ok
    assert any("round_robin_gradients" in n for n in inspect_checkpoint(case / "ckpt")["notes"])


@pytest.mark.engine
def test_round_robin_swapped_rank_files_refused(engine_ckpt, tmp_path):
    src = tampered_copy(engine_ckpt("z2-round-robin-dp2") / "ckpt", tmp_path)
    tag = src / "global_step2"
    a, b = (tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1))
    a.rename(tag / "tmp")
    b.rename(a)
    (tag / "tmp").rename(b)
    export_refused(src, tmp_path / "hf", match="param_slice_mappings")
