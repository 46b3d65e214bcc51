"""verl-style per-rank FSDP2 files of a DeepSeek-V3-like MoE (45,395 tensors), for any world size, fast.

``model_world_size_W_rank_R.pt`` in ``DST/actor/`` (and ``fsdp_config.json``), each rank's
``torch.save`` of its state dict of ``DTensor`` s (``Shard(0)`` on a 1-D mesh of ``W``), as verl's
``FSDPCheckpointManager`` writes them. Every tensor is ``(W, 2)`` fp32, so each rank holds one row
of every tensor: the plan has tensors x ranks pieces, as a real model at that rank count has (its
shapes only change the byte counts, never the plan's work). Names from ``synth_ckpt.deepseek_v3_shapes``.

torch writes one rank's file in ~30 s on the benchmark machine (45,395 DTensors), 8 hours for
1,024 ranks; so torch writes ranks 0 and 1 (through a fake process group), and every other rank's
file is rank 0's with the two bytes torch's pickle gives the rank changed (the mesh's ``_rank``
and ``_coordinate_on_dim``, found by comparing torch's rank 0 and rank 1 pickles; both widened
to ``BININT2`` so every rank's file has the same layout) and the pickle's CRC-32 set again. A rank
byte in the wrong place would show at once: the plan refuses shards that overlap or leave a gap. Usage: ``python benchmarks/synth_rank_files.py DST --world 64``.
"""

import argparse
import json
import os
import struct
import sys
import time
import zipfile
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synth_ckpt import deepseek_v3_shapes  # noqa: E402


def torch_rank_file(path: str, world: int, rank: int) -> None:
    """Rank ``rank``'s state dict, written by torch itself (a fake process group)."""
    from collections import OrderedDict

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        sd = OrderedDict()
        for name in deepseek_v3_shapes():
            local = torch.full((1, 2), float(rank))
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((world, 2)),
                                          stride=(2, 1))
        torch.save(sd, path)
    finally:
        dist.destroy_process_group()


def _pickle(path: str) -> "tuple[zipfile.ZipFile, str, bytes]":
    z = zipfile.ZipFile(path)
    name = next(n for n in z.namelist() if n.endswith("/data.pkl"))
    return z, name, z.read(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dst")
    ap.add_argument("--world", type=int, required=True)
    a = ap.parse_args()
    if not 2 <= a.world <= 65535:
        sys.exit("--world: 2 .. 65535")
    started = time.perf_counter()
    actor = os.path.join(a.dst, "actor")
    os.makedirs(actor, exist_ok=True)
    name_of = lambda r: os.path.join(actor, f"model_world_size_{a.world}_rank_{r}.pt")  # noqa: E731
    tmp = os.path.join(actor, ".torch-rank-1.pt")
    torch_rank_file(name_of(0), a.world, 0)
    torch_rank_file(tmp, a.world, 1)
    z0, pkl_name, p0 = _pickle(name_of(0))
    _, _, p1 = _pickle(tmp)
    os.unlink(tmp)
    diff = [i for i in range(len(p0)) if p0[i] != p1[i]] if len(p0) == len(p1) else None
    if diff is None or len(diff) != 2 or any(p0[i - 1:i + 1] != b"K\x00" for i in diff):
        sys.exit(f"error: torch's rank 0 and rank 1 pickles differ in other ways than two BININT1 ranks ({diff!r:.200})")
    # Widen both to BININT2 ('M' + 2 bytes): the value of rank R sits at `spots` in every file.
    a_, b_ = diff
    template = p0[:a_ - 1] + b"M\x00\x00" + p0[a_ + 1:b_ - 1] + b"M\x00\x00" + p0[b_ + 1:]
    spots = (a_, b_ + 1)
    # Rank 0's archive again, with the widened pickle; the other records as torch wrote them.
    base = os.path.join(actor, ".template.pt")
    with zipfile.ZipFile(base, "w", zipfile.ZIP_STORED) as out:
        for info in z0.infolist():
            data = template if info.filename == pkl_name else z0.read(info.filename)
            out.writestr(zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0)), data)
    z0.close()
    with zipfile.ZipFile(base) as zt:
        info = zt.getinfo(pkl_name)
        start_dir = zt.start_dir
    blob = bytearray(open(base, "rb").read())
    os.unlink(base)
    lh = info.header_offset
    name_len, extra_len = struct.unpack("<HH", blob[lh + 26:lh + 30])
    data_at = lh + 30 + name_len + extra_len
    assert blob[data_at:data_at + len(template)] == template
    assert blob[start_dir:start_dir + 4] == b"PK\x01\x02" and blob[start_dir + 46:start_dir + 46 + name_len].decode() == pkl_name
    for r in range(a.world):
        pkl = bytearray(template)
        for s in spots:
            pkl[s:s + 2] = struct.pack("<H", r)
        crc = struct.pack("<I", zlib.crc32(pkl) & 0xFFFFFFFF)
        for s in spots:
            blob[data_at + s:data_at + s + 2] = pkl[s:s + 2]
        blob[lh + 14:lh + 18] = crc
        blob[start_dir + 16:start_dir + 20] = crc
        with open(name_of(r), "wb") as fh:
            fh.write(blob)
    with open(os.path.join(actor, "fsdp_config.json"), "w") as fh:
        json.dump({"FSDP_version": 2, "world_size": a.world}, fh)
    print(json.dumps({"src": actor, "world": a.world, "tensors": len(deepseek_v3_shapes()),
                      "bytes_per_file": len(blob), "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
