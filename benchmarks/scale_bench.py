"""``make bench``: plan time and peak memory of ``inspect`` / ``export`` against the rank count.

Synthetic ZeRO-2 and ZeRO-3 saves of a 70B-class *structure* (``benchmarks/synth_ckpt.py``: 80
layers, 723 tensors, real DeepSpeed file layout, hidden size 64 so 1,024-rank partitions stay
tiny) for 8, 64, 256 and 1,024 data-parallel ranks, generated once under ``.bench-cache/scale-*``.
For each, fresh child processes (median of ``--rounds``):

- ``plan``: importing the package and ``build_plan``, timed inside the child (no interpreter
  start), and its peak RSS;
- ``inspect``: ``hf-ckpt inspect SRC --json`` end to end, wall and peak RSS (``os.wait4``);
- ``export``: ``hf-ckpt export SRC OUT`` (fp32) end to end, wall and peak RSS.

Writes a Markdown table and ``docs/scale.png`` and replaces the ``scale-bench`` block of
``docs/benchmarks.md``. Not a test: nothing asserts a time. Usage:
``.venv/bin/python benchmarks/scale_bench.py [--ranks 8,64,256,1024] [--stages 2,3] [--rounds 3]
[--no-doc] [--doc-only]``; ``--moe`` and ``--rank-files`` (below) print their tables.
"""

import argparse
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
CACHE = REPO / ".bench-cache"
DOC = REPO / "docs" / "benchmarks.md"
PLOT = REPO / "docs" / "scale.png"
RESULTS = CACHE / "scale-results.json"
START, END = "<!-- scale-bench:start -->", "<!-- scale-bench:end -->"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}

PLAN_CHILD = ("import json, resource, sys, time\n"
              "t = time.perf_counter()\n"
              "from hf_ckpt_integrations.sources import build_plan\n"
              "plan = build_plan(sys.argv[1])\n"
              "dt = time.perf_counter() - t\n"
              "print(json.dumps({'plan_s': dt, 'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,\n"
              "                  'tensors': len(plan.tensors),\n"
              "                  'pieces': sum(len(p) for t in plan.tensors for p in t.parts),\n"
              "                  'torch': 'torch' in sys.modules}))\n")


WHAT_THE_CURVE_SHOWED = """### What the curve showed, and what was fixed

- **ZeRO-3 read every rank's model-states file.** Each one pickles all 723 shapes and 723 empty
  module tensors (zip entries), and the plan opened all of them to look for frozen-parameter
  fragments even when `frozen_param_shapes` was empty: 64 ranks took 5.0 s to plan (3.6 s of it
  those files), and the cost was files × tensors. Now only rank 0's file is read unless it
  records frozen parameters (`sources/deepspeed/zero3.py`, `plan_zero3_frozen`): 64 ranks 0.36 s.
- **Per-piece work.** A ZeRO-3 tensor is one piece per rank that holds part of it, so the plan has
  tensors × ranks pieces (503,872 at 1,024 ranks) — inherent, it is the list of byte ranges to
  copy. Each piece went through the general segment walker with its bounds checks; with one
  contiguous flat buffer per rank (what DeepSpeed writes) a piece is now one addition, the bounds
  already proven by `zero3_fragments`, which itself now walks only the ranks that hold a
  parameter's elements (`sources/deepspeed/partitions.py`), not every rank for every parameter.
- What remains is linear: reading one optimizer file per rank (its zip directory and pickle, a
  few ms each) plus a constant per piece. ZeRO-1/2 have one piece per tensor plus one per
  partition boundary, so their plan hardly grows with the rank count.
- `export` at 1,024 ZeRO-3 ranks is dominated by one `copy_file_range` per piece (tens of µs
  each); with these tiny partitions that is most of the run, with a real 70B model (partitions
  of ~280 MB) it is noise next to the bytes.
- Memory is the plan itself (~250 bytes per piece) and the pickles of one file at a time."""


EXPORT_PLAN_CHILD = ("import json, resource, sys, time\n"
                     "t = time.perf_counter()\n"
                     "from hf_ckpt_integrations.sources import build_plan\n"
                     "from hf_ckpt_integrations.mapped_files import MappedFiles\n"
                     "from hf_ckpt_integrations.writer import check_max_shard_size, plan_tensors, split_shards\n"
                     "plan = build_plan(sys.argv[1])\n"
                     "with MappedFiles() as files:\n"
                     "    tensors = plan_tensors(plan, None, files, ranges=True)\n"
                     "    split = split_shards(tensors, check_max_shard_size(None))\n"
                     "print(json.dumps({'s': time.perf_counter() - t,\n"
                     "                  'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,\n"
                     "                  'shards': len(split.filename_to_tensors)}))\n")

# DeepSeek-V3's structure: 61 layers (3 dense), 256 routed experts + 1 shared per MoE layer: 45,395
# tensors. What a plan costs grows with tensors x ranks (ZeRO-3: one piece per rank holding part of
# a tensor), never with the bytes, so the tensors are tiny and the rank count is what is real.
MOE_RANKS = "8,16,32,64,1024"


def moe_pieces(dp: int) -> int:
    """The ZeRO-3 plan's piece count at ``dp`` ranks, from the partition arithmetic alone: a tensor of
    ``n`` elements is ``ceil(n / dp)`` per rank, held by the ranks its elements reach."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import math

    from synth_ckpt import deepseek_v3_shapes

    total = 0
    for shape in deepseek_v3_shapes().values():
        n = math.prod(shape)
        c = -(-n // dp)
        total += -(-n // c)
    return total


def moe_generate(dp: int) -> Path:
    out = cache_dir() / f"moe-z3-dp{dp}"
    if (out / "DONE").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    print(f"generating the MoE ZeRO-3 x {dp} ranks (once)", file=sys.stderr, flush=True)
    text = subprocess.run([PY, str(REPO / "benchmarks" / "synth_ckpt.py"), str(out), "--stage", "3", "--dp", str(dp),
                           "--moe", "--layers", "61"], env=ENV, check=True, capture_output=True, text=True).stdout
    (out / "DONE").write_text(text.strip().splitlines()[-1])
    return out


def moe_measure(src: Path, rounds: int) -> dict:
    rows = {"plan": [], "inspect": [], "export-plan": [], "universal --dry-run": []}
    for _ in range(rounds):
        _, _, text = run_child([PY, "-c", PLAN_CHILD, str(src)])
        p = json.loads(text.strip().splitlines()[-1])
        rows["plan"].append((p["plan_s"], p["rss"]))
        rows["inspect"].append(run_child([PY, "-m", "hf_ckpt_integrations", "inspect", str(src), "--json"])[:2])
        _, _, text = run_child([PY, "-c", EXPORT_PLAN_CHILD, str(src)])
        e = json.loads(text.strip().splitlines()[-1])
        rows["export-plan"].append((e["s"], e["rss"]))
        out = CACHE / "moe-universal-out"
        rows["universal --dry-run"].append(run_child([PY, "-m", "hf_ckpt_integrations", "universal", str(src),
                                                      str(out), "--dry-run"])[:2])
    med = statistics.median
    return {"pieces": p["pieces"], "tensors": p["tensors"], "torch": p["torch"],
            **{k: {"s": med(x for x, _ in v), "rss": max(r for _, r in v)} for k, v in rows.items()}}


def moe_render(results: dict, meta: dict) -> str:
    ks = sorted(results, key=int)
    lines = ["| ranks | pieces | " + " | ".join(f"{k} s / RSS" for k in results[ks[0]] if isinstance(results[ks[0]][k], dict))
             + " |", "|---" * 6 + "|"]
    for k in ks:
        r = results[k]
        cells = [f"{v['s']:.1f} s / {v['rss'] / 1e6:,.0f} MB" for v in r.values() if isinstance(v, dict)]
        lines.append(f"| {int(k):,} | {r['pieces']:,} | " + " | ".join(cells) + " |")
    if "1024" in results or len(ks) < 2:  # measured, not extrapolated (the plan is O(tensors) since issue 39)
        return "\n".join(lines)
    # Linear in pieces (the rank count's only effect): a least-squares line through the measured points.
    big = moe_pieces(1024)
    fit = []
    for tool in ("plan", "inspect", "export-plan", "universal --dry-run"):
        xs = [results[k]["pieces"] for k in ks]
        for what in ("s", "rss"):
            ys = [results[k][tool][what] for k in ks]
            mx, my = statistics.mean(xs), statistics.mean(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            fit.append((tool, what, slope, my - slope * mx))
    est = {}
    for tool, what, slope, icpt in fit:
        est.setdefault(tool, {})[what] = slope * big + icpt
        est[tool][what + "_per_piece"] = slope
    lines += ["", f"Extrapolated to **1,024 ranks** ({big:,} pieces; linear in pieces, fitted to the rows above):", ""]
    for tool, v in est.items():
        lines.append(f"- {tool}: ~{v['s'] / 60:,.0f} min, ~{v['rss'] / 1e9:,.1f} GB peak RSS "
                     f"({v['s_per_piece'] * 1e6:.0f} µs and {v['rss_per_piece']:.0f} bytes per piece)")
    return "\n".join(lines)


def moe_main(args) -> int:
    results = {}
    saved = CACHE / "moe-results.json"
    if args.doc_only:
        data = json.loads(saved.read_text())
        print(moe_render(data["results"], data["meta"]))
        return 0
    for dp in map(int, args.ranks.split(",")):
        src = moe_generate(dp)
        print(f"measuring the MoE ZeRO-3 x {dp}", file=sys.stderr, flush=True)
        results[str(dp)] = moe_measure(src, args.rounds)
        print(json.dumps(results[str(dp)]), file=sys.stderr, flush=True)
        meta = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "rounds": args.rounds}
        CACHE.mkdir(exist_ok=True)
        saved.write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    print(moe_render(results, meta))
    return 0


RF_RANKS = "8,64"
RF_CHILD = ("import json, resource, sys, time\n"
            "t, c = time.perf_counter(), time.process_time()\n"
            "from hf_ckpt_integrations.sources import build_plan\n"
            "plan = build_plan(sys.argv[1])\n"
            "me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print(json.dumps({'s': time.perf_counter() - t, 'cpu': time.process_time() - c + kids.ru_utime\n"
            "                  + kids.ru_stime, 'rss': me.ru_maxrss * 1024, 'worker_rss': kids.ru_maxrss * 1024,\n"
            "                  'tensors': len(plan.tensors)}))\n")


def synth_once(script: str, out: Path, world: int) -> Path:
    """``benchmarks/<script> OUT --world W`` once: its summary line kept in ``OUT/DONE`` (then reused)."""
    if (out / "DONE").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    print(f"generating {out.name} with {script} (once)", file=sys.stderr, flush=True)
    text = subprocess.run([PY, str(REPO / "benchmarks" / script), str(out), "--world", str(world)],
                          env=ENV, check=True, capture_output=True, text=True).stdout
    (out / "DONE").write_text(text.strip().splitlines()[-1])
    return out


def rf_generate(world: int) -> Path:
    return synth_once("synth_rank_files.py", CACHE / f"rank-files-w{world}", world)


def rf_main(args) -> int:
    """verl per-rank FSDP2 files of the DeepSeek-V3-like MoE: the plan read in this process
    (``HFCKPT_READ_PROCESSES=0``) against the default (worker processes), alternating fresh processes."""
    ranks = RF_RANKS if args.ranks == "8,64,256,1024" else args.ranks
    results, saved = {}, CACHE / "rank-files-results.json"
    variants = {"one process": "0", "workers (default)": ""}
    for world in map(int, ranks.split(",")):
        src = rf_generate(world)
        runs = {k: [] for k in variants}
        for r in range(args.rounds):
            for name, value in (variants.items() if r % 2 == 0 else reversed(variants.items())):
                env = {**ENV, "HFCKPT_READ_PROCESSES": value}
                proc = subprocess.run([PY, "-c", RF_CHILD, str(src)], env=env, capture_output=True, text=True,
                                      check=True, cwd=REPO)
                runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(world, name, runs[name][-1], file=sys.stderr, flush=True)
        med = statistics.median
        results[str(world)] = {name: {"s": med(x["s"] for x in v), "cpu": med(x["cpu"] for x in v),
                                      "rss": max(x["rss"] for x in v), "worker_rss": max(x["worker_rss"] for x in v),
                                      "all_s": [round(x["s"], 1) for x in v]} for name, v in runs.items()}
        meta = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "rounds": args.rounds,
                "cpus": len(os.sched_getaffinity(0))}
        CACHE.mkdir(exist_ok=True)
        saved.write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    lines = ["| ranks | how | wall s (median) | CPU s (all processes) | peak RSS: main / each worker | runs (s) |",
             "|---|---|---|---|---|---|"]
    for world, by in results.items():
        for name, v in by.items():
            workers = f"{v['worker_rss'] / 1e6:,.0f} MB" if v["worker_rss"] else "–"
            lines.append(f"| {int(world):,} | {name} | {v['s']:.1f} | {v['cpu']:.1f} | {v['rss'] / 1e6:,.0f} MB / "
                         f"{workers} | {', '.join(map(str, v['all_s']))} |")
    print("\n".join(lines))
    return 0


def dcp_main(args) -> int:
    """torch DCP saves of the DeepSeek-V3-like MoE (``benchmarks/synth_dcp.py``): the plan, fresh processes."""
    ranks = "8,16" if args.ranks == "8,64,256,1024" else args.ranks
    results, saved = {}, CACHE / "dcp-results.json"
    for world in map(int, ranks.split(",")):
        src = synth_once("synth_dcp.py", CACHE / f"dcp-w{world}", world)
        made = json.loads((src / "DONE").read_text())
        runs = []
        for _ in range(args.rounds):
            proc = subprocess.run([PY, "-c", RF_CHILD, str(src)], env=ENV, capture_output=True, text=True, check=True,
                                  cwd=REPO)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(world, runs[-1], file=sys.stderr, flush=True)
        med = statistics.median
        results[str(world)] = {"chunks": made["chunks"], "metadata_bytes": made["metadata_bytes"],
                               "s": med(x["s"] for x in runs), "cpu": med(x["cpu"] for x in runs),
                               "rss": max(x["rss"] for x in runs), "all_s": [round(x["s"], 1) for x in runs]}
        meta = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "rounds": args.rounds}
        saved.write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    lines = ["| ranks | chunks | .metadata | wall s (median) | CPU s | peak RSS | runs (s) |", "|---|---|---|---|---|---|---|"]
    for world, v in results.items():
        lines.append(f"| {int(world):,} | {v['chunks']:,} | {v['metadata_bytes'] / 1e6:,.0f} MB | {v['s']:.1f} | "
                     f"{v['cpu']:.1f} | {v['rss'] / 1e6:,.0f} MB | {', '.join(map(str, v['all_s']))} |")
    print("\n".join(lines))
    return 0


def cache_dir() -> Path:
    h = hashlib.sha256((REPO / "benchmarks" / "synth_ckpt.py").read_bytes()).hexdigest()[:12]
    return CACHE / f"scale-{h}"


def generate(stage: int, dp: int) -> Path:
    out = cache_dir() / f"z{stage}-dp{dp}"
    if (out / "DONE").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    print(f"generating ZeRO-{stage} x {dp} ranks (once)", file=sys.stderr, flush=True)
    text = subprocess.run([PY, str(REPO / "benchmarks" / "synth_ckpt.py"), str(out), "--stage", str(stage),
                           "--dp", str(dp)], env=ENV, check=True, capture_output=True, text=True).stdout
    (out / "DONE").write_text(text.strip().splitlines()[-1])
    return out


def run_child(cmd):
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {' '.join(map(str, cmd))} failed:\n{out.decode(errors='replace')[-3000:]}")
    return wall, usage.ru_maxrss * 1024, out.decode(errors="replace")


def measure(src: Path, rounds: int) -> dict:
    gen = json.loads((src / "DONE").read_text())
    plan, inspect, export = [], [], []
    out = CACHE / "scale-out"
    for _ in range(rounds):
        _, _, text = run_child([PY, "-c", PLAN_CHILD, str(src)])
        plan.append(json.loads(text.strip().splitlines()[-1]))
        inspect.append(run_child([PY, "-m", "hf_ckpt_integrations", "inspect", str(src), "--json"])[:2])
        shutil.rmtree(out, ignore_errors=True)
        export.append(run_child([PY, "-m", "hf_ckpt_integrations", "export", str(src), str(out), "--quiet"])[:2])
        shutil.rmtree(out, ignore_errors=True)
    med = statistics.median
    return {"gen": gen, "tensors": plan[0]["tensors"], "pieces": plan[0]["pieces"],
            "plan_s": med(p["plan_s"] for p in plan), "plan_rss": max(p["rss"] for p in plan),
            "plan_torch": any(p["torch"] for p in plan),
            "inspect_s": med(w for w, _ in inspect), "inspect_rss": max(r for _, r in inspect),
            "export_s": med(w for w, _ in export), "export_rss": max(r for _, r in export)}


def render(results: dict, meta: dict) -> str:
    lines = [START, "## Scale: plan time and memory against the rank count (synthetic 70B-class structure)", "",
             f"Generated by `.venv/bin/python benchmarks/scale_bench.py` (part of `make bench`) on {meta['date']}; "
             f"medians of {meta['rounds']} fresh processes per cell. **Machine:** {meta['machine']}. "
             "A VM shared with other jobs (2 cores): compare numbers within one run.",
             "",
             "The checkpoints are written by `benchmarks/synth_ckpt.py`: real `torch.save` zip files with the "
             "keys and DeepSpeed types `engine.save_checkpoint` writes (`param_shapes`, `param_slice_mappings`, "
             "`single_partition_of_fp32_groups` / `fp32_flat_groups`, `group_paddings`, `partition_count`, "
             "`zero_stage`, Adam's `exp_avg`/`exp_avg_sq`, `ds_config`, `ds_version`), for a Llama with the "
             "structure of a 70B-class model (80 layers, 9 tensors per layer, 8:1 query to key/value heads, "
             "untied 32,000-row embeddings: 723 tensors) but hidden size 64 (8.3M parameters). A true 70B "
             "cannot have tiny partitions: ZeRO-1/2 partitions add up to the whole model. What grows with the "
             "rank count is real: files, per-rank metadata, and (ZeRO-3) one piece per rank per tensor.", "",
             "- **plan**: importing the package and `build_plan`, timed inside a fresh process (reading every "
             "rank's metadata, placing every fragment, checking ZeRO-1/2's recorded offsets); **plan RSS** that process's peak.",
             "- **inspect** / **export**: the CLI end to end (`hf-ckpt inspect SRC --json`, "
             "`hf-ckpt export SRC OUT` in fp32), wall time and peak RSS of the process.", "",
             "| ZeRO | ranks | files | pieces | plan | plan RSS | inspect | inspect RSS | export fp32 | export RSS |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        stage, dp = key.split("-")
        lines.append(f"| {stage[1:]} | {int(dp[2:]):,} | {r['gen']['files']:,} | {r['pieces']:,} "
                     f"| {r['plan_s']:.2f} s | "
                     f"{r['plan_rss'] / 1e6:,.0f} MB | {r['inspect_s']:.2f} s | {r['inspect_rss'] / 1e6:,.0f} MB | "
                     f"{r['export_s']:.2f} s | {r['export_rss'] / 1e6:,.0f} MB |")
    lines += ["", "![plan time and peak RSS against the rank count](scale.png)", ""]
    per = []
    for stage in sorted({k.split("-")[0] for k in results}):
        ks = sorted((k for k in results if k.startswith(stage + "-")), key=lambda k: int(k.split("dp")[1]))
        if len(ks) >= 2:
            a, b = results[ks[-2]], results[ks[-1]]
            ra, rb = int(ks[-2].split("dp")[1]), int(ks[-1].split("dp")[1])
            per.append(f"ZeRO-{stage[1:]}: {ra:,} → {rb:,} ranks ({rb / ra:.0f}x) costs "
                       f"{b['plan_s'] / a['plan_s']:.1f}x "
                       f"the plan time; 1,024 ranks plan in {results.get(stage + '-dp1024', b)['plan_s']:.2f} s at "
                       f"{results.get(stage + '-dp1024', b)['plan_rss'] / 1e6:,.0f} MB (goal ≤ 10 s, ≤ 500 MB)")
    lines += [f"- {p}." for p in per]
    gen = ", ".join(f"ZeRO-{k.split('-')[0][1:]} {r['gen']['seconds']:.0f} s" for k, r in results.items()
                    if k.endswith("-dp1024"))
    if gen:
        lines.append(f"- Generating the 1,024-rank saves (once, cached under `.bench-cache/`) took: {gen}.")
    lines += ["", WHAT_THE_CURVE_SHOWED, meta.get("notes", ""), END]
    return "\n".join(lines)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for stage in sorted({k.split("-")[0] for k in results}):
        ks = sorted((k for k in results if k.startswith(stage + "-")), key=lambda k: int(k.split("dp")[1]))
        xs = [int(k.split("dp")[1]) for k in ks]
        ax1.plot(xs, [results[k]["plan_s"] for k in ks], "o-", label=f"ZeRO-{stage[1:]} plan")
        ax1.plot(xs, [results[k]["inspect_s"] for k in ks], "x--", label=f"ZeRO-{stage[1:]} inspect (CLI)")
        ax2.plot(xs, [results[k]["plan_rss"] / 1e6 for k in ks], "o-", label=f"ZeRO-{stage[1:]} plan")
        ax2.plot(xs, [results[k]["export_rss"] / 1e6 for k in ks], "x--", label=f"ZeRO-{stage[1:]} export")
    for ax, title in ((ax1, "seconds"), (ax2, "peak RSS, MB")):
        ax.set_xticks([8, 64, 256, 1024])  # a linear axis: linear cost is a straight line
        ax.set_xlabel("data-parallel ranks")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("80-layer / 723-tensor Llama structure, synthetic ZeRO saves", fontsize=9)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def write_doc(block: str) -> None:
    from doc_template import replace_block  # benchmarks/doc_template.py

    replace_block(DOC, START, END, block)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="8,64,256,1024")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--doc-only", action="store_true", help="re-render from the last run's results")
    ap.add_argument("--notes", default="", help="a line appended under the table")
    ap.add_argument("--moe", action="store_true", help="the DeepSeek-V3-like MoE ZeRO-3 plan simulation instead "
                    f"(--ranks default {MOE_RANKS}; prints a table and the 1,024-rank extrapolation)")
    ap.add_argument("--rank-files", action="store_true", help="verl per-rank FSDP2 files of the same MoE: the plan "
                    f"in one process against worker processes (--ranks default {RF_RANKS})")
    ap.add_argument("--dcp", action="store_true", help="torch DCP saves of the same MoE: the plan (--ranks default "
                    "8,16)")
    args = ap.parse_args(argv)
    if args.dcp:
        return dcp_main(args)
    if args.rank_files:
        return rf_main(args)
    if args.moe:
        if args.ranks == "8,64,256,1024":
            args.ranks = MOE_RANKS
        return moe_main(args)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from export_bench import machine

    if args.doc_only:
        saved = json.loads(RESULTS.read_text())
        results, meta = saved["results"], saved["meta"]
    else:
        results = {}
        for stage in map(int, args.stages.split(",")):
            for dp in map(int, args.ranks.split(",")):
                src = generate(stage, dp)
                print(f"measuring ZeRO-{stage} x {dp}", file=sys.stderr, flush=True)
                results[f"z{stage}-dp{dp}"] = measure(src, args.rounds)
                print(json.dumps(results[f"z{stage}-dp{dp}"]), file=sys.stderr, flush=True)
        meta = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"), "rounds": args.rounds,
                "machine": machine()}
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps({"results": results, "meta": meta}, indent=1))
    meta["notes"] = args.notes
    block = render(results, meta)
    print(block)
    if not args.no_doc:
        plot(results)
        write_doc(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
