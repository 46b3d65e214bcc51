"""Does a thread pool help the one-process writer here? ``workers_bench.py CASE_DIR --shard 200MB``.

Writes the plan's shards (same split as ``hf-ckpt export --max-shard-size``) with
``writer.write_shard`` either one after another or from a ``ThreadPoolExecutor`` of 2, 4 rounds
alternating, on a warm page cache, and prints the median write-phase seconds per setting and
output dtype (plan building and interpreter start excluded: they are the same for both).
"""
import argparse
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_ckpt_integrations.mapped_files import MappedFiles  # noqa: E402
from hf_ckpt_integrations.sources import build_plan  # noqa: E402
from hf_ckpt_integrations.writer import plan_tensors, split_shards, write_shard  # noqa: E402


def write_once(plan, dtype, shard, workers, out):
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    with MappedFiles() as files:
        tensors = plan_tensors(plan, dtype, files)
        by_name = {t.name: t for t in tensors}
        jobs = [(os.path.join(out, f), [by_name[n] for n in names])
                for f, names in split_shards(tensors, shard).filename_to_tensors.items()]
        started = time.perf_counter()
        if workers == 1:
            for path, ts in jobs:
                write_shard(path, ts)
        else:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda job: write_shard(*job), jobs))
        took = time.perf_counter() - started
    shutil.rmtree(out, ignore_errors=True)
    return took, len(jobs)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("case", type=Path)
    p.add_argument("--shard", default="200MB")
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    plan = build_plan(str(args.case / "ckpt"), config=str(args.case / "config"))
    out = Path(__file__).resolve().parent.parent / ".bench-cache" / "workers-out"
    parts = []
    for dtype in ("fp32", "bf16"):
        times = {1: [], 2: []}
        for _ in range(args.rounds):
            for w in times:
                took, n = write_once(plan, dtype, args.shard, w, out)
                times[w].append(took)
        one, two = statistics.median(times[1]), statistics.median(times[2])
        parts.append(f"{dtype} ({n} shards): 1 thread {one:.2f} s, 2 threads {two:.2f} s ({two / one:.2f}x)")
    print("; ".join(parts))


if __name__ == "__main__":
    main()
