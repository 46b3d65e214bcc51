"""Launcher for the rank-parallel export (``torchrun ... parallel_export.py SRC DST``, or one
process per rank with ``RANK`` and ``WORLD_SIZE`` set).

Same options as ``hf-ckpt export``. ``--fsize-limit-on-rank R:BYTES`` (test support) sets
``RLIMIT_FSIZE`` on rank R before exporting, so that rank's writes fail with a real ``EFBIG``
from the kernel, as on a full disk or an exceeded quota; ``--die-on-rank R:BYTES`` sets the same
limit but leaves ``SIGXFSZ`` to kill rank R mid-write (a rank that dies without a word). Each rank
prints ``rank R: torch imported: yes|no`` at the end.

Kept out of ``tests/engines/``: that directory's contents key the engine checkpoint cache.
"""
import argparse
import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_ckpt_integrations.errors import CheckpointError  # noqa: E402
from hf_ckpt_integrations.parallel import write_plan_parallel  # noqa: E402
from hf_ckpt_integrations.sources import build_plan  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tag")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--max-shard-size", default="5GB")
    p.add_argument("--config")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--fsize-limit-on-rank", help="R:BYTES")
    p.add_argument("--die-on-rank", help="R:BYTES")
    args = p.parse_args()
    for spec, die in ((args.fsize_limit_on_rank, False), (args.die_on_rank, True)):
        if spec:
            r, limit = map(int, spec.split(":"))
            if int(os.environ["RANK"]) == r:
                # EFBIG from write(), or (SIG_DFL: Python ignores SIGXFSZ by default) killed by the kernel
                signal.signal(signal.SIGXFSZ, signal.SIG_DFL if die else signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        plan = build_plan(args.src, tag=args.tag, dtype=args.dtype, config=args.config)
        report = write_plan_parallel(plan, args.dst, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                     overwrite=args.overwrite, quiet=True)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        print(f"rank {os.environ.get('RANK', '0')}: torch imported: {'yes' if 'torch' in sys.modules else 'no'}")
    if report["world_size"] and int(os.environ.get("RANK", "0")) == 0:
        print(f"wrote {report['destination']}: {report['shards']} shard(s) by {report['world_size']} ranks "
              f"{report['shards_by_rank']}, {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
