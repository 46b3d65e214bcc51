"""Rank-parallel export against one process and the disk's copy, side by side (issue 39).

On one generated ZeRO-3 save (``benchmarks/big_ckpt.py``; ``disk_bench.py`` generates the same),
each round, cold (page cache dropped before every run; needs root), runs as fresh processes:

- ``hf-ckpt export`` fp32, one process;
- the same over N ranks started by hand (``RANK``/``WORLD_SIZE``; the ranks meet through files:
  no torch), each rank's own peak RSS (``os.wait4`` per rank);
- the same under ``torchrun --standalone --nproc_per_node N`` (the RSS includes torchrun itself,
  which imports torch);
- with ``--baseline DIR`` (a checkout of the package before the change): its torchrun export,
  whose ranks imported torch for a gloo process group;
- ``cp -r`` of the output + ``sync``: the disk's own copy of the bytes the export writes.

``× cp`` is the copy's seconds over the tool's, the median of the per-round ratios. Not a test.
Usage: ``.venv/bin/python benchmarks/parallel_bench.py SRC SCRATCH [--ranks 2] [--shard 500MB]
[--rounds 3] [--baseline /path/to/old/checkout]``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from disk_bench import PY, REPO, drop_caches, env, rm, run_child, tree_bytes  # noqa: E402


def by_hand(args, scratch, ranks, extra_env=None):
    """(wall seconds, the largest rank's peak RSS) of ``ranks`` processes started with RANK/WORLD_SIZE."""
    started = time.perf_counter()
    procs = [subprocess.Popen([PY, "-m", "hf_ckpt_integrations", *args], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              env={**env(scratch), **(extra_env or {}), "RANK": str(r), "WORLD_SIZE": str(ranks)})
             for r in range(ranks)]
    rss = 0
    for p in procs:
        out = p.stdout.read()
        _, status, usage = os.wait4(p.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"error: rank failed:\n{out.decode(errors='replace')[-3000:]}")
        rss = max(rss, usage.ru_maxrss * 1024)
    return time.perf_counter() - started, rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("scratch", type=Path)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--shard", default="500MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="a checkout of the package before the change (its torchrun row)")
    a = ap.parse_args()
    out, copy = a.scratch / "out", a.scratch / "copy"
    rm(out)
    rm(copy)
    args = ["export", str(a.src), str(out), "--quiet", "--max-shard-size", a.shard]
    torchrun = [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc_per_node", str(a.ranks), "-m",
                "hf_ckpt_integrations", *args]
    run_child([PY, "-m", "hf_ckpt_integrations", *args], a.scratch)  # fills the Hub-layout cache
    out_bytes = tree_bytes(out)
    rows = {"export": [], f"export, {a.ranks} ranks by hand": [], f"export, torchrun x{a.ranks}": [], "cp": []}
    if a.baseline:
        rows[f"export, torchrun x{a.ranks}, before (gloo)"] = []
    for _ in range(a.rounds):
        rm(out)
        for tool in rows:
            drop_caches()
            if tool == "cp":
                run_child([PY, "-m", "hf_ckpt_integrations", *args], a.scratch)  # the output to copy
                drop_caches()
                t, r = run_child(f"cp -r {out} {copy} && sync", a.scratch, shell=True)
                rm(copy)
            elif tool == "export":
                t, r = run_child([PY, "-m", "hf_ckpt_integrations", *args], a.scratch)
            elif "by hand" in tool:
                t, r = by_hand(args, a.scratch, a.ranks)
            elif "before" in tool:
                old = {**env(a.scratch), "PYTHONPATH": str(a.baseline)}
                started = time.perf_counter()
                proc = subprocess.Popen(torchrun, cwd=a.baseline, env=old, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
                text = proc.stdout.read()
                _, status, usage = os.wait4(proc.pid, 0)
                if os.waitstatus_to_exitcode(status) != 0:
                    sys.exit(text.decode(errors="replace")[-3000:])
                t, r = time.perf_counter() - started, usage.ru_maxrss * 1024
            else:
                t, r = run_child(torchrun, a.scratch)
            rows[tool].append({"s": t, "rss": r})
            print(json.dumps({"tool": tool, "s": round(t, 2), "rss_mb": round(r / 2**20)}), file=sys.stderr, flush=True)
            rm(out)
    cp = [x["s"] for x in rows["cp"]]
    summary = {}
    for tool, runs in rows.items():
        summary[tool] = {"s": round(statistics.median(x["s"] for x in runs), 2),
                         "x_cp": round(statistics.median(c / x["s"] for c, x in zip(cp, runs)), 2),
                         "gbps": round(out_bytes / 1e9 / statistics.median(x["s"] for x in runs), 2),
                         "rss_mb": round(max(x["rss"] for x in runs) / 2**20), "rounds": [round(x["s"], 1) for x in runs]}
    print(json.dumps({"out_bytes": out_bytes, "shard": a.shard, "ranks": a.ranks, "rows": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
