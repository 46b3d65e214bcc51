"""Every save-time path of a real engine run writes, under NCCL's device rules, the bytes it writes on gloo.

The engine runs train on CPU with gloo as always; at the end of the run each save-time hook saves
again with the rules of tests/support/nccl_rules.py switched on for the save only (a fake device,
collectives that refuse CPU tensors as NCCL does, batched point-to-point only, object collectives
off the device group): once with the ZeRO-3 partitions / FSDP2 shards on the rank's device, once
with them in CPU memory as ``offload_param: {device: cpu}`` and ``CPUOffloadPolicy`` leave them.
The engine's own collectives (DeepSpeed's AutoTP gather) pass untouched: on a GPU its tensors are
on the device by construction. No extra launch: the saves are part of the cached cases below.
"""

import json
import os

import pytest

# path -> (engine case, its gloo save (relative to the case), the variants saved under the rules)
PATHS = {
    "accelerate-zero3": ("acc-z3", "hf", ("device", "cpu")),
    "accelerate-autotp-zero3": ("acc-autotp-z3-bf16", "hf", ("device", "cpu")),
    "peft-adapter-zero3": ("peft-z3", "acc", ("device", "cpu")),
    "accelerate-fsdp2": ("fsdp2-accelerate-hooks", "saved", ("device", "cpu")),
    "trainer-callback-zero3": ("cb-z3", "run/checkpoint-6", ("device",)),
}
# The files each path's save writes (the callback's copy of the checkpoint holds the rest as well).
WEIGHTS = ("model", "adapter_model")


def _reports(nccl_dir):
    names = sorted(n for n in os.listdir(nccl_dir) if n.startswith("rank") and n.endswith(".json"))
    assert names, f"no per-rank report in {nccl_dir}"
    return [json.load(open(os.path.join(nccl_dir, n))) for n in names]


def _weight_files(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if n.startswith(WEIGHTS) and os.path.isfile(os.path.join(directory, n))}


@pytest.mark.engine
@pytest.mark.parametrize("variant", ["device", "cpu"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_under_nccl_rules_the_save_writes_the_gloo_bytes(engine_ckpt, path, variant):
    case, reference, variants = PATHS[path]
    if variant not in variants:
        pytest.skip(f"{path}: no offload variant (the callback reads the checkpoint files, not the partitions)")
    out = engine_ckpt(case)
    for r, report in enumerate(_reports(out / "nccl")):
        entry = report[variant]
        assert entry["outcome"] == "ok", f"rank {r}: {entry.get('error', '')[:2000]}"
    want = _weight_files(out / reference)
    assert want and _weight_files(out / "nccl" / variant) == want


@pytest.mark.engine
@pytest.mark.parametrize("variant", ["device", "cpu"])
@pytest.mark.parametrize("path", ["accelerate-zero3", "accelerate-autotp-zero3", "accelerate-fsdp2"])
def test_only_the_writing_rank_copies_to_the_host(engine_ckpt, path, variant):
    """Each rank copies from the device to the host exactly the bytes of the partitioned (or
    sharded) tensors in the files it wrote: none for a tensor another rank writes."""
    from safetensors import safe_open

    case, _, _ = PATHS[path]
    out = engine_ckpt(case)
    reports = _reports(out / "nccl")
    for r, report in enumerate(reports):
        entry = report[variant]
        assert entry["outcome"] == "ok", entry.get("error", "")[:2000]
        moved, mine = set(entry["moved"]), 0
        for name in entry["written_here"]:
            with safe_open(os.path.join(out / "nccl" / variant, name), "pt") as f:
                mine += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys() if k in moved)
        assert entry["d2h"] == mine, (r, entry["d2h"], mine)
    assert sum(len(rep[variant]["moved"]) > 0 for rep in reports) == len(reports)
