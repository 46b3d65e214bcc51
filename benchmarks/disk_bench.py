"""``make bench-scale``: export speed against the disk's own copy speed, 1 GB to 20+ GB, and peak RSS.

For each size and source layout (``benchmarks/big_ckpt.py``: a ZeRO-3 save, the same in torch.save's
legacy pre-zip format (``zero3-legacy``), a torch DCP directory,
verl-style per-rank ``torch.save`` files, and the DeepSpeed universal checkpoint written from the
ZeRO-3 save), generated once into ``--scratch`` (a directory on the disk under test, not tmpfs),
each round runs, side by side, as fresh processes:

- **cold**: ``sync``, drop the page cache (``/proc/sys/vm/drop_caches``; needs root), then the tool;
- **warm**: the source read once more (``cat > /dev/null``, untimed), then the tool;

for the tool ``hf-ckpt export`` (fp32; ``universal`` for the universal row; the rank-parallel
export under ``torchrun`` with ``--parallel N``) **and** ``cp -r`` + ``sync`` of the same bytes
(the export's output for ZeRO-3, whose source files also hold Adam's two states; the source
itself for the others, whose tensor bytes are the output's). The ratio ``cp seconds / export
seconds`` is the fraction of the disk's copy speed the export reaches (1.0: as fast as ``cp``).
Peak RSS is each process's own (``os.wait4``; for torchrun the largest rank). The first export
of each model derives the Hub layout with transformers (a few hundred MB and tens of seconds, cached
after: docs/hub-layout.md); it runs once, untimed, before the rounds, and is reported apart.

Peers where they fit in this machine's memory (``--peer-max-gb``): DeepSpeed's ``zero_to_fp32.py``
on the ZeRO-3 save, torch's ``dcp_to_torch_save`` on the DCP one (both hold the whole model).

Results go to ``.bench-cache/disk-results.json`` (merged per size, so sizes can run separately);
``--doc`` renders the ``disk-bench`` block of ``docs/performance.md`` and ``docs/disk.png`` from it.
Not a test: nothing asserts a time. Usage:
``.venv/bin/python benchmarks/disk_bench.py --scratch /big/disk/dir [--sizes 1,5,20] [--layouts
zero3,zero3-legacy,dcp,rank-files,universal] [--rounds 3] [--parallel 2] [--doc]``.
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
PY = sys.executable
CACHE = REPO / ".bench-cache"
RESULTS = CACHE / "disk-results.json"
DOC = REPO / "docs" / "performance.md"
PLOT = REPO / "docs" / "disk.png"
START, END = "<!-- disk-bench:start -->", "<!-- disk-bench:end -->"
LAYOUTS = ("zero3", "zero3-legacy", "dcp", "rank-files", "universal")

DCP_PEER = ("import sys\nfrom torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
            "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n")


def env(scratch: Path):
    # Bytecode caches as users have them: a shell that sets PYTHONDONTWRITEBYTECODE would make every
    # child compile the package again (~0.8 s of CPU per run here).
    base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**base, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore",
            "HF_CKPT_CACHE": str(scratch / "hub-layout-cache"), "TOKENIZERS_PARALLELISM": "false"}


def run_child(cmd, scratch, *, shell=False):
    """(wall seconds, peak RSS bytes of the largest process it waited for)."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env(scratch), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
                            shell=shell)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {cmd} failed:\n{out.decode(errors='replace')[-3000:]}")
    return wall, usage.ru_maxrss * 1024


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def read_all(path: Path):
    subprocess.run(f"find {path} -type f -print0 | xargs -0 cat > /dev/null", shell=True, check=True)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def rm(path: Path):
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["sync"], check=True)


def generate(layout: str, gb: float, scratch: Path, ranks: int) -> dict:
    base = "zero3" if layout == "universal" else layout
    where = scratch / f"{base}-{gb:g}gb"
    done = where / "DONE.json"
    if done.exists():
        return json.loads(done.read_text())
    rm(where)
    print(f"generating {base} {gb:g} GB", file=sys.stderr, flush=True)
    out = subprocess.run([PY, str(REPO / "benchmarks" / "big_ckpt.py"), str(where), "--layout", base, "--gb", str(gb),
                          "--ranks", str(ranks)], env=env(scratch), check=True, capture_output=True, text=True).stdout
    info = json.loads(out.strip().splitlines()[-1])
    done.write_text(json.dumps(info))
    return info


def tool_cmd(layout, src, out, parallel=0, shard="5GB"):
    if layout == "universal":
        return [PY, "-m", "hf_ckpt_integrations", "universal", str(src), str(out), "--quiet"]
    args = ["export", str(src), str(out), "--quiet", "--max-shard-size", shard]
    if parallel:
        return [str(Path(PY).parent / "torchrun"), "--standalone", "--nproc_per_node", str(parallel),
                "-m", "hf_ckpt_integrations", *args]
    return [PY, "-m", "hf_ckpt_integrations", *args]


def measure(layout: str, gb: float, scratch: Path, rounds: int, parallel: int, peer_max_gb: float, ranks: int,
            caches=("cold", "warm"), shard="5GB"):
    info = generate(layout, gb, scratch, ranks)
    src = Path(info["src"])
    out, copy = scratch / "out", scratch / "copy"
    rm(out)
    rm(copy)
    first = run_child(tool_cmd(layout, src, out, 0, shard), scratch)  # derives and caches the Hub layout
    out_bytes = tree_bytes(out)
    rm(out)
    copy_src = out if layout.startswith("zero3") else src  # the bytes the export writes
    rows = {"export": [], "cp": []}
    if parallel:
        rows[f"export x{parallel}"] = []
    peer = None
    if gb <= peer_max_gb and layout == "zero3":
        peer = "zero_to_fp32"
    elif gb <= peer_max_gb and layout == "dcp":
        peer = "dcp_to_torch_save"
    if peer:
        rows[peer] = []
    for _ in range(rounds):
        for cache in caches:
            def prep():
                if cache == "cold":
                    drop_caches()
                else:
                    read_all(src)

            prep()
            t, r = run_child(tool_cmd(layout, src, out, 0, shard), scratch)
            rows["export"].append({"cache": cache, "s": t, "rss": r})
            # the copy: of the output (ZeRO-3) right now, else of the source, with the output gone
            if copy_src != out:
                rm(out)
            prep()
            t, r = run_child(f"cp -r {copy_src} {copy} && sync", scratch, shell=True)
            rows["cp"].append({"cache": cache, "s": t, "rss": r})
            rm(copy)
            rm(out)
            if parallel:
                prep()
                t, r = run_child(tool_cmd(layout, src, out, parallel, shard), scratch)
                rows[f"export x{parallel}"].append({"cache": cache, "s": t, "rss": r})
                rm(out)
            if peer:
                prep()
                if peer == "zero_to_fp32":
                    cmd = [PY, "-m", "deepspeed.utils.zero_to_fp32", str(src), str(out), "--safe_serialization"]
                else:
                    out.mkdir()
                    cmd = [PY, "-c", DCP_PEER, str(src), str(out / "model.pt")]
                t, r = run_child(cmd, scratch)
                rows[peer].append({"cache": cache, "s": t, "rss": r})
                rm(out)
    return {"layout": layout, "gb": gb, "src_bytes": info["bytes"], "out_bytes": out_bytes,
            "copy_bytes": out_bytes if copy_src == out else tree_bytes(src), "copy_of": "output" if copy_src == out
            else "source", "first_export": {"s": first[0], "rss": first[1]}, "rows": rows, "ranks": info["ranks"]}


def summarize(res: dict) -> dict:
    """Medians per tool and cache state: seconds, GB/s of the bytes written, ratio to cp."""
    s = {}
    for tool, runs in res["rows"].items():
        for cache in ("cold", "warm"):
            xs = [r for r in runs if r["cache"] == cache]
            if not xs:
                continue
            cp = [r["s"] for r in res["rows"]["cp"] if r["cache"] == cache]
            # ratio per round (side by side), then the median of the ratios
            ratios = [c / r["s"] for c, r in zip(cp, xs)]
            s[(tool, cache)] = {"s": statistics.median(r["s"] for r in xs), "rss": max(r["rss"] for r in xs),
                                "gbps": res["out_bytes"] / 1e9 / statistics.median(r["s"] for r in xs),
                                "vs_cp": statistics.median(ratios), "n": len(xs)}
    return s


def tool_name(layout: str, tool: str) -> str:
    if tool.startswith("export"):
        what = "hf-ckpt universal" if layout == "universal" else "hf-ckpt export fp32"
        return what + (f", torchrun ×{tool.split('x')[-1]}" if " x" in tool else "")
    return tool


def render(results: list, meta: dict) -> str:
    L = [START, "", f"Measured by `make bench-scale` (`benchmarks/disk_bench.py`) on {meta['date']}; "
         f"{meta['machine']}. Each cell is the median of {meta['rounds']} rounds; in every round the export and "
         "the copy of the same bytes ran back to back, cold (page cache dropped) and warm. `× cp` is the copy's "
         "seconds over the tool's (the median of the per-round ratios): 1.00 is the disk's own copy speed. "
         "GB/s counts the bytes written. RSS is the largest process's peak.", "",
         "| source | size (files) | written | tool | cold s | cold × cp | cold GB/s | warm s | warm × cp | peak RSS |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        s = summarize(res)
        for tool in res["rows"]:
            if tool == "cp":
                continue
            c, w = s.get((tool, "cold")), s.get((tool, "warm"))
            warm = f"{w['s']:.1f} | {w['vs_cp']:.2f}" if w else "– | –"
            shards = f", {res['shard']} shards" if res.get("shard", "5GB") != "5GB" else ""
            L.append(f"| {res['layout']} | {res['src_bytes'] / 1e9:.1f} GB | {res['out_bytes'] / 1e9:.1f} GB | {tool_name(res['layout'], tool)}{shards} "
                     f"| {c['s']:.1f} | {c['vs_cp']:.2f} | {c['gbps']:.2f} | {warm} "
                     f"| {max(c['rss'], (w or c)['rss']) / 1e6:,.0f} MB |")
        cc, cw = s[("cp", "cold")], s.get(("cp", "warm"))
        warm = f"{cw['s']:.1f} | 1.00" if cw else "– | –"
        L.append(f"| {res['layout']} | {res['src_bytes'] / 1e9:.1f} GB | {res['copy_bytes'] / 1e9:.1f} GB | "
                 f"`cp -r` of the {res['copy_of']} + `sync` | {cc['s']:.1f} | 1.00 | {cc['gbps']:.2f} | {warm} "
                 f"| {max(cc['rss'], (cw or cc)['rss']) / 1e6:,.0f} MB |")
    L.append("")
    L.append("First export of a model (untimed above; derives the Hub layout with transformers, then cached): " +
             ", ".join(f"{r['layout']} {r['src_bytes'] / 1e9:.0f} GB {r['first_export']['s']:.0f} s / "
                       f"{r['first_export']['rss'] / 1e6:,.0f} MB" for r in results) + ".")
    L += ["", "![GB/s and peak RSS against checkpoint size](disk.png)", "", meta.get("notes", ""), END]
    return "\n".join(L)


def plot(results: list) -> None:
    series = {}
    for res in results:
        s = summarize(res)
        for tool in res["rows"]:
            if res.get("shard", "5GB") != "5GB":
                continue  # the rank-parallel comparison's extra configuration: in the table only
            c = s.get((tool, "cold"))
            is_cp = tool == "cp"
            label = f"{res['layout']}: {'cp (same bytes)' if is_cp else tool_name(res['layout'], tool)}"
            series.setdefault((is_cp, label), []).append(
                (res["src_bytes"] / 1e9, res["copy_bytes"] / 1e9 / c["s"] if is_cp else c["gbps"], c["rss"] / 1e6))
    draw(series)


def draw(series: dict) -> None:
    """``docs/disk.png`` from ``{(is the copy, label): [(size GB, cold GB/s, peak RSS MB)]}``: GB/s of every
    series on the left, RSS of the tools' on the right (also used by ``plot_disk_table.py``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (is_cp, label), pts in sorted(series.items(), key=lambda kv: kv[0][1]):
        pts.sort()
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "x:" if is_cp else "o-", label=label)
        if not is_cp:
            ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
    ax1.set_title("cold-cache write speed, GB/s")
    ax2.set_title("peak RSS per process, MB")
    ax2.set_yscale("log")
    for ax, where in ((ax1, "upper left"), (ax2, "center right")):
        ax.set_xlabel("checkpoint size, GB of tensors")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5.5, loc=where, ncol=2)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


def write_doc(block: str) -> None:
    from doc_template import replace_block  # benchmarks/doc_template.py

    replace_block(DOC, START, END, block)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", type=Path, default=None, help="a directory on the disk to measure (not tmpfs)")
    ap.add_argument("--sizes", default="1,5,20", help="GB of tensors per checkpoint")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8, help="ranks of the synthetic saves")
    ap.add_argument("--parallel", type=int, default=0, help="also torchrun the export over N processes")
    ap.add_argument("--peer-max-gb", type=float, default=1, help="run the whole-model peers up to this size")
    ap.add_argument("--parallel-max-gb", type=float, default=5, help="run --parallel up to this size")
    ap.add_argument("--warm-max-gb", type=float, default=5,
                    help="warm runs up to this size (beyond, the page cache cannot hold the source and output)")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    ap.add_argument("--shard", default="5GB", help="--max-shard-size of every export (the rank-parallel one "
                    "splits the shards between its ranks: a 5 GB checkpoint needs 1GB shards to give 2 ranks work)")
    ap.add_argument("--tag", default="", help="a suffix of the results' keys (a second configuration of a size)")
    ap.add_argument("--doc", action="store_true", help="render docs/performance.md's block and docs/disk.png")
    ap.add_argument("--notes", default="")
    args = ap.parse_args(argv)
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"results": {}, "meta": {}}
    if args.scratch:
        from export_bench import machine

        args.scratch.mkdir(parents=True, exist_ok=True)
        for gb in map(float, args.sizes.split(",")):
            for layout in args.layouts.split(","):
                print(f"measuring {layout} {gb:g} GB", file=sys.stderr, flush=True)
                par = args.parallel if layout != "universal" and gb <= args.parallel_max_gb else 0
                caches = ("cold", "warm") if gb <= args.warm_max_gb else ("cold",)
                res = measure(layout, gb, args.scratch, args.rounds, par, args.peer_max_gb, args.ranks, caches,
                              args.shard)
                res["shard"] = args.shard
                saved["results"][f"{layout}-{gb:g}{args.tag}"] = res
                print(json.dumps({f"{k[0]} {k[1]}": v for k, v in summarize(res).items()}), file=sys.stderr,
                      flush=True)
                saved["meta"] = {"date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                                 "rounds": args.rounds, "machine": machine()}
                RESULTS.parent.mkdir(exist_ok=True)
                RESULTS.write_text(json.dumps(saved, indent=1))
            if not args.keep:
                for layout in ("zero3", "zero3-legacy", "dcp", "rank-files"):
                    rm(args.scratch / f"{layout}-{gb:g}gb")
    if args.doc:
        results = sorted(saved["results"].values(), key=lambda r: (LAYOUTS.index(r["layout"]), r["gb"]))
        meta = {**saved["meta"], "notes": args.notes}
        plot(results)
        write_doc(render(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
