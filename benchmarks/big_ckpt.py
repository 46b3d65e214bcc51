"""Synthetic checkpoints of any size (1 GB .. tens of GB) in the engines' own file layouts, written fast.

For ``disk_bench.py``: what matters there is the byte volume and the real file structure, so the
model is a Llama whose hidden size is chosen to reach the requested size, and the tensor values are
a repeated 64 MiB block of random fp32 (generating 20 GB of fresh random numbers would take minutes
on the benchmark machine). Each layout holds one rank's tensors in memory at a time (never the
model), so a 20 GB save needs ~20 GB / ranks of RAM:

- ``zero3``: what DeepSpeed ZeRO-3's ``engine.save_checkpoint`` writes (``benchmarks/synth_ckpt.py``'s
  keys and DeepSpeed types): per rank ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` (the flat fp32
  partition ``fp32_flat_groups``, ``ceil(n / dp)`` elements of every parameter, the last rank
  zero-padded, plus Adam's ``exp_avg`` and ``exp_avg_sq``: three times the masters) and
  ``zero_pp_rank_R_mp_rank_00_model_states.pt`` (``param_shapes``, empty module tensors);
- ``zero3-legacy``: the same files in torch.save's legacy (pre-zip) format, as DeepSpeed writes them
  with ``"checkpoint": {"checkpoint_serialization": false}``;
- ``dcp``: torch DCP's ``FileSystemWriter`` layout, one ``__R_0.distcp`` per rank of FSDP2's dim-0
  shards (each chunk ``torch.save``'d at the offset ``.metadata`` records, as the writer does) and
  the pickled ``Metadata``;
- ``rank-files``: verl's ``FSDPCheckpointManager`` per-rank ``torch.save`` of the model's state
  dict, ``model_world_size_W_rank_R.pt``, each tensor an FSDP2 ``DTensor`` (``Shard(0)``) built by
  torch on a fake process group, with ``huggingface/config.json`` beside them.

``sizes`` are *tensor* bytes: for ``zero3`` the whole save's (masters + Adam), so an fp32 export
writes a third of it; for the others the model's fp32 bytes. Usage:
``python benchmarks/big_ckpt.py DST --layout zero3 --gb 20 [--ranks 8]``.
"""

import argparse
import io
import json
import math
import os
import pickle
import sys
import time
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synth_ckpt import TAG, _config, _ds_config, _ds_types, llama_shapes  # noqa: E402

__all__ = ["LAYOUTS", "make", "model_for"]

LAYOUTS = ("zero3", "zero3-legacy", "dcp", "rank-files")
LAYERS, HEADS, KV_HEADS, VOCAB = 32, 32, 8, 32000
_BLOCK = 1 << 24  # elements of the repeated random block (64 MiB of fp32)
_pattern = None


def _fill(n: int, start: int = 0) -> torch.Tensor:
    """``n`` fp32 values: the repeated random block, from element ``start`` of the infinite repetition."""
    global _pattern
    if _pattern is None:
        _pattern = torch.randn(_BLOCK, generator=torch.Generator().manual_seed(0))
    out = torch.empty(n)
    done = 0
    while done < n:
        at = (start + done) % _BLOCK
        k = min(n - done, _BLOCK - at)
        out[done:done + k] = _pattern[at:at + k]
        done += k
    return out


def model_for(fp32_bytes: float):
    """(hidden, shapes) of the 32-layer Llama whose fp32 parameters come closest to ``fp32_bytes``."""
    best = None
    for hidden in range(256, 16384, 128):
        shapes = llama_shapes(LAYERS, hidden, VOCAB, HEADS, KV_HEADS)
        n = sum(math.prod(s) for s in shapes.values())
        if best is None or abs(4 * n - fp32_bytes) < abs(4 * best[2] - fp32_bytes):
            best = (hidden, shapes, n)
    return best[0], best[1]


def _write_config(directory, hidden):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(_config(LAYERS, hidden, VOCAB, HEADS, KV_HEADS, None), fh, indent=2)


def make_zero3(dst, gb: float, dp: int = 8, legacy: bool = False) -> dict:
    LossScaler, ZeroStageEnum, _ = _ds_types()
    hidden, shapes = model_for(gb * 1e9 / 3)  # masters + exp_avg + exp_avg_sq
    numels = [math.prod(s) for s in shapes.values()]
    chunks = [-(-n // dp) for n in numels]
    tag_dir = os.path.join(dst, TAG)
    os.makedirs(tag_dir, exist_ok=True)
    with open(os.path.join(dst, "latest"), "w") as fh:
        fh.write(TAG)
    _write_config(dst, hidden)
    common = {"ds_config": _ds_config(3), "ds_version": "0.19.8"}
    model_common = {"buffer_names": [], "optimizer": None,
                    "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in shapes.items())],
                    "frozen_param_shapes": OrderedDict(), "shared_params": {}, "frozen_param_fragments": OrderedDict(),
                    "lr_scheduler": None, "data_sampler": None, "random_ltd": None, "skipped_steps": 0,
                    "global_steps": 1, "global_samples": dp, "dp_world_size": dp, "mp_world_size": 1, **common}
    empty = OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n in shapes)
    starts = [0]
    for n in numels:
        starts.append(starts[-1] + n)
    for r in range(dp):
        part = torch.empty(sum(chunks))
        off = 0
        for n, c, s in zip(numels, chunks, starts):
            lo, hi = r * c, min((r + 1) * c, n)
            k = max(0, hi - lo)
            if k:
                part[off:off + k] = _fill(k, s + lo)
            part[off + k:off + c] = 0  # the last rank's padding
            off += c
        adam = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(part),
                              "exp_avg_sq": torch.zeros_like(part)}},
                "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                  "amsgrad": False, "params": [0]}]}
        osd = {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False,
               "overflow": False, "partition_count": dp, "optimizer_state_dict": adam, "fp32_flat_groups": [part]}
        torch.save({"optimizer_state_dict": osd, **common},
                   os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"),
                   _use_new_zipfile_serialization=not legacy)
        torch.save({"module": empty, **model_common},
                   os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
                   _use_new_zipfile_serialization=not legacy)
        del part, adam, osd
    return {"hidden": hidden, "parameters": sum(numels), "export_fp32_bytes": 4 * sum(numels)}


def _rows(n, ranks):
    per = -(-n // ranks)
    return [(r * per, max(0, min(per, n - r * per))) for r in range(ranks)]


def _flat_layout(shapes):
    """``({name: numel}, {name: first element})`` of the tensors laid end to end in ``shapes``' order:
    the value pattern (``_fill``) is keyed by an element's place in that one flat run."""
    numels = {n: math.prod(s) for n, s in shapes.items()}
    starts, at = {}, 0
    for n in shapes:
        starts[n] = at
        at += numels[n]
    return numels, starts


def make_dcp(dst, gb: float, ranks: int = 8) -> dict:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    hidden, shapes = model_for(gb * 1e9)
    os.makedirs(dst, exist_ok=True)
    sd_meta, storage, planner = {}, {}, {}
    numels, starts = _flat_layout(shapes)
    for r in range(ranks):
        name = f"__{r}_0.distcp"
        with open(os.path.join(dst, name), "wb") as fh:
            for fqn, shape in shapes.items():
                lo, rows = _rows(shape[0], ranks)[r]
                row = numels[fqn] // shape[0]
                piece = _fill(rows * row, starts[fqn] + lo * row).view((rows,) + tuple(shape[1:]))
                start = fh.tell()
                buf = io.BytesIO()  # torch.save wants a seekable stream of its own per record
                torch.save(piece, buf)
                fh.write(buf.getbuffer())
                offsets = (lo,) + (0,) * (len(shape) - 1)
                storage[MetadataIndex(fqn, offsets)] = _StorageInfo(name, start, fh.tell() - start)
                sd_meta.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape),
                                                              []))
                sd_meta[fqn].chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                sizes=torch.Size(piece.shape)))
    for fqn in shapes:
        planner[fqn] = (fqn,)
    md = Metadata(state_dict_metadata=sd_meta, planner_data=planner, storage_data=storage, version="1.0.0")
    with open(os.path.join(dst, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)
    _write_config(dst, hidden)
    return {"hidden": hidden, "parameters": sum(numels.values()), "export_fp32_bytes": 4 * sum(numels.values())}


def make_rank_files(dst, gb: float, world: int = 8) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    hidden, shapes = model_for(gb * 1e9)
    actor = os.path.join(dst, "actor")
    os.makedirs(actor, exist_ok=True)
    numels, starts = _flat_layout(shapes)
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", (world,))
            sd = OrderedDict()
            for fqn, shape in shapes.items():
                lo, rows = _rows(shape[0], world)[rank]
                row = numels[fqn] // shape[0]
                local = _fill(rows * row, starts[fqn] + lo * row).view((rows,) + tuple(shape[1:]))
                sd[fqn] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                             stride=torch.empty(0).new_empty(shape, device="meta").stride())
            torch.save(sd, os.path.join(actor, f"model_world_size_{world}_rank_{rank}.pt"))
            del sd
        finally:
            dist.destroy_process_group()
    with open(os.path.join(actor, "fsdp_config.json"), "w") as fh:
        json.dump({"FSDP_version": 2, "world_size": world}, fh)
    _write_config(os.path.join(actor, "huggingface"), hidden)
    return {"hidden": hidden, "parameters": sum(numels.values()), "export_fp32_bytes": 4 * sum(numels.values()),
            "src": actor}


def make(layout: str, dst, gb: float, ranks: int = 8) -> dict:
    """Write ``layout`` of ``gb`` GB of tensors under ``dst``; a summary with ``src`` (the directory to
    export), ``seconds`` and the byte counts."""
    started = time.perf_counter()
    info = {"zero3": make_zero3, "zero3-legacy": lambda d, g, r: make_zero3(d, g, r, legacy=True), "dcp": make_dcp,
            "rank-files": make_rank_files}[layout](dst, gb, ranks)
    info.setdefault("src", str(dst))
    total = 0
    for root, _, files in os.walk(dst):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    info.update(layout=layout, ranks=ranks, bytes=total, seconds=round(time.perf_counter() - started, 1))
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dst")
    ap.add_argument("--layout", choices=LAYOUTS, required=True)
    ap.add_argument("--gb", type=float, required=True)
    ap.add_argument("--ranks", type=int, default=8)
    args = ap.parse_args(argv)
    print(json.dumps(make(args.layout, args.dst, args.gb, args.ranks)))


if __name__ == "__main__":
    sys.exit(main())
