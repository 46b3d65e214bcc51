"""A collective save through the one writer (``torchrun --nproc_per_node N collective_save.py DST OUT``).

Every tensor is read by a collective, as a live ZeRO-3 parameter is: each of its chunks is
broadcast from the rank that owns it, so every rank must walk every tensor in the same order
(the writing rank writes what the read yields, the others drain it). ``--fsize-limit-on-rank R:BYTES``
sets ``RLIMIT_FSIZE`` on rank R, so its write fails with a real ``EFBIG`` from the kernel in
the middle of a shard (and of a tensor). Each rank records what it saw in ``OUT/rankN.json``.

Kept out of ``tests/engines/``: that directory's contents key the engine checkpoint cache.
"""
import argparse
import json
import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TENSORS, ROWS, COLS, PIECES = 8, 64, 256, 4  # 64 KiB fp32 tensors, each read in 4 broadcasts


def expected(k):
    import numpy as np

    return (np.arange(ROWS * COLS, dtype=np.float32) + 1000 * k).reshape(ROWS, COLS)


def collective_tensors(world):
    """The plan: every tensor produced on request (a ``LivePiece``) by broadcasts from its owner."""
    import torch
    import torch.distributed as dist

    from hf_ckpt_integrations.plan import ExportPlan, LivePiece, TensorPlan

    out = []
    for k in range(TENSORS):
        owner = k % world

        def read(lo, hi, writer, dtype, k=k, owner=owner):
            flat = torch.from_numpy(expected(k).reshape(-1).copy())
            step = flat.numel() // PIECES
            for j in range(PIECES):
                buf = flat[j * step:(j + 1) * step].clone() if dist.get_rank() == owner else torch.empty(step)
                dist.broadcast(buf, src=owner)
                yield memoryview(buf.numpy()).cast("B")

        out.append(TensorPlan(f"layers.{k}.weight", (ROWS, COLS), "F32", [[LivePiece(read, 0, ROWS * COLS, "F32")]],
                              kind="live", out_dtype="F32"))
    return ExportPlan("test", "collective", None, out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dst")
    p.add_argument("out")
    p.add_argument("--max-shard-size", default="150KB")
    p.add_argument("--fsize-limit-on-rank", help="R:BYTES")
    args = p.parse_args()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.fsize_limit_on_rank:
        r, limit = map(int, args.fsize_limit_on_rank.split(":"))
        if rank == r:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write() instead of being killed
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from hf_ckpt_integrations.integrations._dist import write_distributed

    try:
        report = write_distributed(collective_tensors(dist.get_world_size()), args.dst,
                                   max_shard_size=args.max_shard_size, collective=True, what="collective save")
        seen = {"raised": False, "report": report}
    except Exception as e:
        seen = {"raised": True, "type": type(e).__name__, "message": str(e),
                "failures": {str(k): v for k, v in getattr(e, "failures", {}).items()}}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh, default=str)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
