"""A torch DCP save of a DeepSeek-V3-like MoE (45,395 tensors) over any number of ranks, fast.

``DST/.metadata`` and ``DST/__R_0.distcp``, as torch's ``FileSystemWriter`` writes an FSDP2 save:
every tensor ``(W, 2)`` fp32 ``Shard(0)``, so each rank holds one row of every tensor and the
metadata has tensors x ranks chunks, as the real model sharded over ``W`` ranks has (real shapes only
change the byte counts; the metadata's size and the plan's work grow with the chunks). The
``.metadata`` is torch's own ``Metadata`` dataclasses, pickled as DCP pickles them; each chunk is the
same ``torch.save`` of a (1, 2) tensor (the plan reads every chunk's archive; the values are not
what is measured). Names from ``synth_ckpt.deepseek_v3_shapes``. Usage:
``python benchmarks/synth_dcp.py DST --world 8``.
"""

import argparse
import io
import json
import os
import pickle
import sys
import time

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synth_ckpt import deepseek_v3_shapes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dst")
    ap.add_argument("--world", type=int, required=True)
    a = ap.parse_args()
    started = time.perf_counter()
    os.makedirs(a.dst, exist_ok=True)
    buf = io.BytesIO()
    torch.save(torch.arange(2, dtype=torch.float32).view(1, 2), buf)
    record = buf.getvalue()
    names = list(deepseek_v3_shapes())
    sd_meta, storage = {}, {}
    for r in range(a.world):
        name = f"__{r}_0.distcp"
        with open(os.path.join(a.dst, name), "wb") as fh:
            fh.write(record * len(names))
        for i, fqn in enumerate(names):
            offsets = torch.Size([r, 0])
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(name, i * len(record), len(record))
            sd_meta.setdefault(fqn, TensorStorageMetadata(TensorProperties(dtype=torch.float32),
                                                          torch.Size([a.world, 2]), []))
            sd_meta[fqn].chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([1, 2])))
    md = Metadata(state_dict_metadata=sd_meta, planner_data={fqn: (fqn,) for fqn in names}, storage_data=storage,
                  version="1.0.0")
    with open(os.path.join(a.dst, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)
    print(json.dumps({"src": a.dst, "world": a.world, "tensors": len(names), "chunks": len(storage),
                      "metadata_bytes": os.path.getsize(os.path.join(a.dst, ".metadata")),
                      "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
