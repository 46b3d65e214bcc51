"""ZeRO-3 partitions travel point to point to the writing rank (``torchrun --nproc_per_node 3 zero3_p2p.py OUT``).

Calls ``sources.live._partitions_to`` with parameter-like objects that carry what it reads of a
DeepSpeed ZeRO-3 parameter (``ds_tensor``: this rank's padded partition, ``ds_numel``,
``ds_process_group``), for several element ranges and every writing rank, on every rank in the
same order. ``torch.distributed.broadcast`` is replaced by a function that fails, and every
``isend`` of the batched point-to-point calls is counted. Each rank records in ``OUT/rankN.json`` the bytes it received as the writer
and the sends it made.

Kept out of ``tests/engines/``: that directory's contents key the engine checkpoint cache.
"""
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

NUMEL = 10  # over 3 ranks: partitions of 4, 4, 2 (+2 padding)
RANGES = [(0, 10), (3, 9), (4, 8), (9, 10)]


def main():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.arange(NUMEL, dtype=torch.float32) * 1.5
    n = -(-NUMEL // world)
    part = torch.zeros(n)
    mine = full[rank * n:(rank + 1) * n]
    part[:mine.numel()] = mine
    param = SimpleNamespace(ds_tensor=part, ds_numel=NUMEL, ds_process_group=dist.group.WORLD)

    sends = []
    real_batch = dist.batch_isend_irecv

    def counted_batch(ops, *a, **k):  # sends travel batched (comm.Traffic.exchange): count each isend
        sends.extend([op.peer, op.tensor.numel()] for op in ops if op.op is dist.isend)
        return real_batch(ops, *a, **k)

    def no_broadcast(*a, **k):
        raise AssertionError("a ZeRO-3 partition was broadcast")

    dist.batch_isend_irecv, dist.broadcast = counted_batch, no_broadcast
    from hf_ckpt_integrations.comm import Traffic
    from hf_ckpt_integrations.sources.live import _partitions_to

    traffic = Traffic(dist)

    got = {}
    for writer in range(world):
        for lo, hi in RANGES:
            data = b"".join(bytes(c) for c in _partitions_to(param, None, lo, hi, writer, traffic))
            if rank == writer:
                got[f"{writer}:{lo}:{hi}"] = data == full[lo:hi].numpy().tobytes()
            elif data:
                got[f"{writer}:{lo}:{hi}"] = "bytes on a rank that does not write"
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"got": got, "sends": sends}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
