"""``hf-ckpt universal`` against DeepSpeed's ``ds_to_universal`` on the benchmark checkpoints.

Builds (or reuses) ``export_bench.py``'s checkpoints, then runs the two converters alternately,
``--pairs`` times, each a fresh child process on a warm page cache with its output removed first,
and reports the median wall time and peak RSS (``wait4``'s ``ru_maxrss`` of the child, including
its worker processes' peak only where the child waits for them: ds_to_universal's pool workers are
counted through ``RUSAGE_CHILDREN`` of the child itself). Then checks that both outputs hold the same
fp32 / exp_avg / exp_avg_sq tensors, bitwise, for every parameter.

Not a test: nothing asserts a time. ``.venv/bin/python benchmarks/universal_bench.py [--pairs 3]
[--cases z3-40m,z2-156m] [--workers 4]``; prints a Markdown table.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_bench import CACHE, CHILD_ENV, PY, REPO, build  # noqa: E402

# The child reports its own peak plus its children's (ds_to_universal forks a pool of workers).
MEASURE = ("import resource, runpy, sys\n"
           "sys.argv = sys.argv[1:]\n"
           "try:\n"
           "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
           "finally:\n"
           "    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)\n"
           "    sys.stderr.write(f'\\nPEAK_KB {max(s.ru_maxrss, c.ru_maxrss)}\\n')\n")


def run(cmd, out: Path):
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    r = subprocess.run([PY, "-c", MEASURE, *cmd], capture_output=True, text=True, env=CHILD_ENV, cwd=REPO)
    wall = time.perf_counter() - start
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{r.stderr[-3000:]}")
    peak = int(r.stderr.rsplit("PEAK_KB", 1)[1].split()[0]) * 1024
    return wall, peak


def same_states(ours: Path, theirs: Path) -> int:
    import torch

    checked = 0
    for name in sorted(os.listdir(ours / "zero")):
        if not (ours / "zero" / name).is_dir():
            continue
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            a = torch.load(ours / "zero" / name / f"{state}.pt", weights_only=False)["param"]
            b = torch.load(theirs / "zero" / name / f"{state}.pt", weights_only=False)
            b = b["param"] if isinstance(b, dict) else b
            assert a.numel() == b.numel() and torch.equal(a.reshape(-1).view(torch.int32),
                                                          b.reshape(-1).view(torch.int32)), (name, state)
            checked += 1
    return checked


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--cases", default="z3-40m")
    p.add_argument("--workers", type=int, default=4, help="ds_to_universal --num_extract_workers/--num_merge_workers")
    args = p.parse_args()
    rows = []
    for case in args.cases.split(","):
        ckpt = build(case)
        tag = ckpt / "ckpt" / (ckpt / "ckpt" / "latest").read_text().strip()
        work = CACHE / "universal-bench" / case
        work.mkdir(parents=True, exist_ok=True)
        ours, theirs = work / "ours", work / "ds"
        tools = {
            "hf-ckpt universal": (["hf_ckpt_integrations", "universal", str(ckpt / "ckpt"), str(ours), "--quiet",
                                   "--config", str(ckpt / "config")], ours),
            "ds_to_universal": (["deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                                 "--output_folder", str(theirs), "--num_extract_workers", str(args.workers),
                                 "--num_merge_workers", str(args.workers)], theirs),
        }
        times = {k: [] for k in tools}
        for _ in range(args.pairs):
            for k, (cmd, out) in tools.items():
                times[k].append(run(cmd, out))
        checked = same_states(ours, theirs)
        base = statistics.median(w for w, _ in times["ds_to_universal"])
        base_rss = statistics.median(r for _, r in times["ds_to_universal"])
        for k, ts in times.items():
            wall, rss = statistics.median(w for w, _ in ts), statistics.median(r for _, r in ts)
            rows.append(f"| {case} | {k} | {wall:.2f} | {wall / base:.2f}x | {rss / 2**20:.0f} | "
                        f"{rss / base_rss:.2f}x |")
        rows.append(f"| {case} | bitwise equal states | {checked} tensors | | | |")
    print(f"median of {args.pairs} alternating runs, warm page cache; peak RSS of the tool's process tree "
          "(max of itself and its largest child)\n")
    print("| case | tool | wall s | vs ds_to_universal | peak RSS MiB | vs ds_to_universal |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
