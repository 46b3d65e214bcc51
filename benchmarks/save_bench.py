"""Save time under DeepSpeed: our `accelerator.save_model` hooks vs `save_pretrained` vs DeepSpeed's clone path.

1. For each ZeRO stage (2, 3) launches ``benchmarks/save_bench_case.py`` under
   ``torchrun --standalone --nproc_per_node P`` (``--nproc``, default 2; CPU, gloo,
   ``OMP_NUM_THREADS=1``, this checkout's package first on ``PYTHONPATH``): one engine
   process per rank saves the same live bf16 Llama ``--rounds`` times with each variant,
   alternating, and records per rank the wall time and the extra peak RSS of each save.
2. Checks round 1's outputs: the hooks' and Accelerate's tensors equal ``save_pretrained``'s,
   bit for bit (exits non-zero otherwise, and leaves the page alone).
3. Prints the table and writes it into ``docs/benchmarks.md`` between ``<!-- save-bench:start -->``
   and ``<!-- save-bench:end -->`` (the rest of the page is ``export_bench.py``'s, which keeps this
   block when it re-renders); results in ``.bench-cache/save-results.json``.

Not a test: nothing here asserts a time. Usage: ``.venv/bin/python benchmarks/save_bench.py
[--rounds 3] [--stages 2,3] [--nproc 2] [--small] [--no-doc] [--doc-only]``. ``--small`` is a quick smoke run
on a ~1M-parameter model (its own results file; never written into the page).
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
CACHE = REPO / ".bench-cache"
DOC = REPO / "docs" / "benchmarks.md"
CASE = HERE / "save_bench_case.py"
VARIANTS = ("save_pretrained", "hooks", "accelerate")
GOAL_RATIO = 1.1
TIMEOUT_S = 3600


def paths(small: bool):
    tag = "-small" if small else ""
    return CACHE / f"save-results{tag}.json", CACHE / f"save-out{tag}"


# ---------------------------------------------------------------- running one stage
def run_stage(stage: int, work: Path, *, size: str, rounds: int, shard: str, nproc: int = 2) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(CASE), str(work),
           "--stage", str(stage), "--size", size, "--rounds", str(rounds), "--shard", shard]
    # This checkout's package, not whichever copy the environment has installed.
    path = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONWARNINGS": "ignore", "PYTHONPATH": path}
    log = work / "torchrun.log"
    print(f"[ZeRO-{stage}] {' '.join(cmd[1:])}  (log: {log.relative_to(REPO)})", file=sys.stderr, flush=True)
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # torchrun stops its workers on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
    if rc != 0:
        tail = log.read_text(errors="replace")[-4000:]
        sys.exit(f"error: ZeRO-{stage} run failed ({rc}); see {log}:\n{tail}")
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("[stage"):
            print("  " + line, file=sys.stderr)
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(nproc)]
    checks, files = check_outputs(work, stage)
    return {"ranks": ranks, "checks": checks, "files": files}


# ---------------------------------------------------------------- equality check (round 1's outputs)
def load_tensors(d: Path):
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                if k in out:
                    raise AssertionError(f"{d}: tensor {k} is in two files")
                out[k] = fh.get_tensor(k)
    return out


def compare(a: Path, b: Path) -> str:
    """'bitwise (N tensors)' when every tensor of HF dir ``a`` equals ``b``'s of the same name
    byte for byte (same dtype, same shape); otherwise a 'DIFFERENT ...' line."""
    import torch

    ta, tb = load_tensors(a), load_tensors(b)
    if not ta:
        return f"DIFFERENT: no tensors in {a.name}"
    if set(ta) != set(tb):
        return f"DIFFERENT names: {sorted(set(ta) ^ set(tb))[:4]}"
    for k in ta:
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"DIFFERENT: {k} {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if not torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)):
            return f"DIFFERENT bytes: {k}"
    same_split = ""
    ia, ib = a / "model.safetensors.index.json", b / "model.safetensors.index.json"
    if ia.exists() and ib.exists():
        wa, wb = (json.loads(p.read_text())["weight_map"] for p in (ia, ib))
        same_split = ", same shard split" if wa == wb else ", DIFFERENT shard split (tensors equal)"
    return f"bitwise ({len(ta)} tensors{same_split})"


def check_outputs(work: Path, stage: int = 2):
    variants = VARIANTS + (("ds_gather_save",) if stage == 3 else ())
    base = work / "check-save_pretrained"
    checks = {f"{v} vs save_pretrained": compare(work / f"check-{v}", base) for v in variants[1:]}
    files = {}
    for v in variants:
        shards = sorted((work / f"check-{v}").glob("*.safetensors"))
        files[v] = {"shards": len(shards), "largest_shard": max((p.stat().st_size for p in shards), default=0),
                    "written": sum(p.stat().st_size for p in (work / f"check-{v}").iterdir() if p.is_file()),
                    "names": sorted(p.name for p in (work / f"check-{v}").iterdir())}
        shutil.rmtree(work / f"check-{v}", ignore_errors=True)
    return checks, files


# ---------------------------------------------------------------- report
def med(xs):
    return statistics.median(xs) if xs else float("nan")


def span(xs, num, unit):
    """``median unit (min–max)``."""
    return f"{num(med(xs))} {unit}" + (f" ({num(min(xs))}–{num(max(xs))})" if len(xs) > 1 else "")


def mb(n):
    return f"{n / 1e6:,.0f} MB"


def secs(xs):
    return span(xs, lambda x: f"{x:.2f}", "s")


def mbs(xs):
    return span(xs, lambda x: f"{x / 1e6:,.0f}", "MB")


def summarize(stage_result):
    """variant -> {"wall": [max over ranks per round], "extra": {rank: [per round]}}, in run order."""
    ranks = stage_result["ranks"]
    out = {}
    for v in ranks[0]["runs"]:
        per_rank = [rk["runs"][v] for rk in ranks]
        walls = [max(runs[i]["wall"] for runs in per_rank) for i in range(len(per_rank[0]))]
        out[v] = {"wall": walls, "extra": {rk["rank"]: [x["extra"] for x in rk["runs"][v]] for rk in ranks}}
    return out


WHAT_RUNS = {
    2: {"save_pretrained": "rank 0: `unwrap_model(model).save_pretrained(dir, max_shard_size)`",
        "hooks": "all ranks: hooked `accelerator.save_model(model, dir, max_shard_size)`",
        "accelerate": "all ranks: Accelerate's own `save_model` (`clone_tensors_for_torch_save`)"},
    3: {"save_pretrained": "rank 0: `save_pretrained(dir, state_dict=sd, max_shard_size)`, `sd` gathered before "
                           "the timer",
        "hooks": "all ranks: hooked `accelerator.save_model(model, dir, max_shard_size)`",
        "accelerate": "all ranks: Accelerate's own `save_model` (`_zero3_consolidated_16bit_state_dict`)",
        "ds_gather_save": "all ranks: `engine._zero3_consolidated_16bit_state_dict()`, then rank 0 "
                          "`save_pretrained(dir, state_dict=sd, max_shard_size)`: DeepSpeed's gather + save, end to end",
        "gather_only": "reference, writes nothing: every parameter once through `GatheredParameters`, "
                       "one at a time",
        "gather_largest": "reference, writes nothing: `GatheredParameters` of the largest parameter alone"},
}


def nranks(results) -> int:
    return len(next(iter(results["stages"].values()))["ranks"])


def render_table(results):
    n = nranks(results)
    L = ["| ZeRO | variant | what runs (timed) | median wall (min–max) | × save_pretrained | "
         + " | ".join(f"extra RSS rank {r} (min–max)" for r in range(n)) + " | shards |",
         "|---|---|---|---|---|" + "---|" * n + "---|"]
    for stage, res in results["stages"].items():
        s = summarize(res)
        base = med(s["save_pretrained"]["wall"])
        for v, row in s.items():
            f = res["files"].get(v)
            shards = f"{f['shards']} (largest {mb(f['largest_shard'])})" if f else "–"
            L.append(f"| {stage} | {v} | {WHAT_RUNS[int(stage)][v]} | {secs(row['wall'])} "
                     f"| {med(row['wall']) / base:.2f} | " + " | ".join(mbs(row['extra'][r]) for r in range(n))
                     + f" | {shards} |")
    return "\n".join(L)


def render_goals(results):
    L = []
    for stage, res in results["stages"].items():
        s = summarize(res)
        # ZeRO-3's goal is against DeepSpeed's own gather + save_pretrained (when measured).
        base = "ds_gather_save" if "ds_gather_save" in s else "save_pretrained"
        ratio = med(s["hooks"]["wall"]) / med(s[base]["wall"])
        extra = max(med(xs) for xs in s["hooks"]["extra"].values())
        worst = max(max(xs) for xs in s["hooks"]["extra"].values())
        shard = res["files"]["save_pretrained"]["largest_shard"]
        t_ok = "met" if ratio <= GOAL_RATIO else "**NOT met**"
        m_ok = "met" if worst <= shard else "**NOT met**"
        also = (f" (and {med(s['hooks']['wall']) / med(s['save_pretrained']['wall']):.2f}× `save_pretrained` of "
                "an already gathered state dict)" if base != "save_pretrained" else "")
        L.append(f"- ZeRO-{stage}: hooks take **{ratio:.2f}×** the time of `{base}`{also} "
                 f"(goal ≤ {GOAL_RATIO}×: {t_ok}); extra RSS of the hooks, worse rank: median {mb(extra)}, "
                 f"largest of any round {mb(worst)}, against one shard of {mb(shard)} "
                 f"(goal ≤ 1 shard: {m_ok}).")
    return "\n".join(L)


def render_checks(results):
    L = []
    for stage, res in results["stages"].items():
        for k, v in res["checks"].items():
            L.append(f"- ZeRO-{stage}: {k}: {v}")
    return "\n".join(L)


BLOCK = """{start}
## Save time: our hooks against `save_pretrained` and DeepSpeed's clone path

Generated by `.venv/bin/python benchmarks/save_bench.py` (part of `make bench`) on {date}.
Re-render from the last run without re-measuring: `.venv/bin/python benchmarks/save_bench.py --doc-only`.

**Machine:** {machine}. Shared with other jobs while it ran: compare numbers only within one run.

**Model:** `LlamaForCausalLM` hidden {hidden}, {layers} layers, intermediate {inter}, {heads} heads / {kv} KV
heads, vocab {vocab}, untied embeddings: {params:.1f}M parameters, bf16 module weights
(`bf16: {{enabled: true}}`, `mixed_precision="bf16"`), {bytes} of tensors; `torch.manual_seed(0)` init and
**one** AdamW step. Accelerate + DeepSpeed ZeRO-2 and ZeRO-3 on **{nproc} ranks** (CPU, gloo,
`OMP_NUM_THREADS=1`), `stage3_gather_16bit_weights_on_model_save: true` (so that Accelerate's own
path can run; the hooks do not need it). Every variant writes safetensors with
`max_shard_size="{shard}"`.

Each stage is one `torchrun` job: the {nproc} engine processes build the model once, then run {rounds}
rounds of the variants below, alternating (round *r* starts with variant *r*, so no variant always
runs first), every save into a fresh directory:

```
.venv/bin/python benchmarks/save_bench.py --rounds {rounds} --nproc {nproc}
# runs, for S in 2 3, with OMP_NUM_THREADS=1 and PYTHONPATH=<this checkout>:
.venv/bin/python -m torch.distributed.run --standalone --nproc_per_node={nproc} \\
    benchmarks/save_bench_case.py .bench-cache/save-out/zero$S --stage $S --size {size} \\
    --rounds {rounds} --shard {shard}
```

The variants (the timed call, on each rank, then `torch.distributed.barrier()`):

- **save_pretrained** (the baseline): plain `transformers` `save_pretrained` on rank 0 while the
  other ranks wait at the barrier. ZeRO-2: every rank holds the whole bf16 module, so rank 0 saves
  `accelerator.unwrap_model(model)` itself. ZeRO-3: parameters are partitioned, so rank 0 saves
  `save_pretrained(dir, state_dict=sd)` of a full state dict gathered *before* the timer
  starts — the cost of writing the same bytes, without any gathering.
- ZeRO-3 only, **ds_gather_save** (the baseline of the ZeRO-3 goal): DeepSpeed's own gather and
  `save_pretrained`, end to end — `engine._zero3_consolidated_16bit_state_dict()` on every rank
  (rank 0 receives every parameter), then rank 0 `save_pretrained(dir, state_dict=sd)`.
- **hooks**: `accelerator.save_model(model, dir, max_shard_size=...)` after
  `install_accelerate_hooks(accelerator)` (this package), on every rank.
- **accelerate**: Accelerate 1.16's own `save_model` (kept by the hooks at
  `accelerator._hf_ckpt_hooks["original_save_model"]`), on every rank: under ZeRO-2
  `deepspeed.checkpoint.utils.clone_tensors_for_torch_save` of the whole state dict (on every
  rank), under ZeRO-3 `engine._zero3_consolidated_16bit_state_dict()` (rank 0 keeps a clone of
  every gathered parameter), then rank 0 writes with safetensors.
- ZeRO-3 only, two references that save nothing: **gather_only** (every parameter once through
  `deepspeed.zero.GatheredParameters`, one at a time, bytes dropped: the gathers of the hooks
  without the writing) and **gather_largest** (the largest parameter alone).

Columns:

- **median wall (min–max)**: per round the slowest rank's `perf_counter` time around the call plus
  the final barrier, median over the {rounds} rounds. Untimed before each run: the previous output is
  removed, `os.sync()` (so no run pays for another's write-back), `gc.collect()`, `malloc_trim(0)`,
  a barrier.
- **× save_pretrained**: median wall / the same stage's `save_pretrained` median wall.
- **extra RSS rank r**: peak resident memory of that rank's process during the call minus its
  RSS just before the call; median over the rounds (min–max). The peak is the larger of the
  kernel's high-water mark (`VmHWM`, reset through `/proc/self/clear_refs` just before the call)
  and a thread sampling `/proc/self/statm` (= `VmRSS`) every 2 ms. Page cache is not RSS: the
  written file pages do not count, only heap copies of tensors (and gathered parameters) do.
  The other ranks write nothing in the baseline, so their extra is ~0 there.
- **shards**: safetensors files written and the largest one — "one shard" of the memory goal.

### Results

{table}

Against the goal (hooks ≤ {goal}× the baseline's time — ZeRO-2: `save_pretrained`; ZeRO-3: DeepSpeed's own
gather + `save_pretrained`, end to end — and at most one shard of extra memory per rank):

{goals}

Equality check (round 1's outputs, every tensor loaded with `safetensors` and compared byte for byte
with `save_pretrained`'s):

{checks}

### How to read this

{notes}
{end}"""

def render_notes(results):
    L = []
    stages = {int(k): (summarize(v), v) for k, v in results["stages"].items()}
    if 2 in stages:
        s, res2 = stages[2]
        L.append(
            "- ZeRO-2, time: `save_pretrained` writes every shard from rank 0; the hooks spread the shards "
            f"over the ranks (shard *i* by rank *i* mod {len(res2['ranks'])}), write each parameter's own bytes in place from "
            "ZeRO's flat buffer, and `fsync` every shard and the directory before moving the shards into "
            "place (neither `save_pretrained` nor Accelerate fsyncs). On 2 shared cores and one disk the "
            "split is far from dividing the time; the spread between rounds is as large as the differences.")
        L.append(
            "- ZeRO-2, memory: the bf16 parameters are views into one flat ZeRO buffer, so "
            "`save_pretrained`'s `remove_tied_weights_from_state_dict` sees every tensor \"sharing storage\" "
            "with the others and clones each one (rank 0's extra ≈ the whole bf16 model, "
            f"{mb(med(s['save_pretrained']['extra'][0]))}); Accelerate's path clones the whole state dict "
            f"on **every** rank ({mb(med(s['accelerate']['extra'][0]))} / "
            f"{mb(med(s['accelerate']['extra'][1]))}); the hooks copy nothing "
            f"({mb(max(med(x) for x in s['hooks']['extra'].values()))}).")
    if 3 in stages:
        s, res = stages[3]
        name, numel = res["ranks"][0]["largest_param"]
        g, gl, h, sp = s["gather_only"], s["gather_largest"], s["hooks"], s["save_pretrained"]
        part = numel * 2 / len(res["ranks"])
        n = len(res["ranks"])
        ds = s.get("ds_gather_save")
        ds_line = (f"DeepSpeed's own gather + `save_pretrained` (`ds_gather_save`, the goal's baseline) takes "
                   f"{med(ds['wall']):.2f} s, so the hooks take {med(h['wall']) / med(ds['wall']):.2f}× its time; "
                   if ds else "")
        L.append(
            "- ZeRO-3, time: `save_pretrained` is handed the gathered state dict, so its time is the write "
            "alone. The hooks never gather a parameter: its bytes are the ranks' partitions end to end, so "
            "each owner sends its partition point to point to the one rank writing that tensor's shard, "
            "which writes it straight into the shard (every rank walks every tensor in the same order, so "
            f"sends and receives pair up; each partition crosses once, where a broadcast would send it to all "
            f"{n} ranks). Their time includes that exchange and the per-shard fsync. " + ds_line +
            f"DeepSpeed's gathers alone (`gather_only`, nothing written) take {med(g['wall']):.2f} s, and "
            f"the hooks' whole save {med(h['wall']):.2f} s; against `save_pretrained` of an already gathered "
            f"dict they take {med(h['wall']) / med(sp['wall']):.2f}×, against Accelerate's path "
            f"{med(h['wall']) / med(s['accelerate']['wall']):.2f}×.")
        L.append(
            "- ZeRO-3, memory: beyond its own partition a writing rank holds two partition-sized receive "
            f"buffers (largest: `{name}`, {numel / 1e6:.1f}M parameters = {mb(numel * 2)} in bf16, so "
            f"{mb(part)} per partition on {n} ranks) and the shard's file pages, which are page cache, not "
            "RSS; a rank that does not write a tensor holds nothing for it. The hooks' extra RSS: "
            + " / ".join(mb(med(h["extra"][r])) for r in range(n)) + f" (rank 0 … {n - 1}), under one shard. "
            "DeepSpeed's gather costs more than the parameter on this CPU/gloo setup: `gather_largest` "
            "raises RSS by " + " / ".join(mb(med(gl["extra"][r])) for r in range(n)) + ", and `gather_only` "
            "(every parameter once, bytes dropped) by " + " / ".join(mb(med(g["extra"][r])) for r in range(n))
            + ". Accelerate's `_zero3_consolidated_16bit_state_dict` (also `ds_gather_save`'s gather) keeps "
            f"a copy of every parameter on rank 0 until the write ({mb(med(s['accelerate']['extra'][0]))} "
            "there).")
    L.append("- The numbers come from a 2-core VM shared with other jobs (the min–max spans show the "
             "noise), with gloo gathers in CPU memory; a GPU run (NCCL, gathers in device memory) was "
             "not measured and would differ.")
    return "\n".join(L)


def render_block(results):
    from doc_template import SAVE_END, SAVE_START  # benchmarks/doc_template.py

    meta = results["meta"]
    hidden, layers, inter, heads, kv, vocab = meta["shape"]
    first = next(iter(results["stages"].values()))
    return BLOCK.format(start=SAVE_START, end=SAVE_END, date=meta["date"], machine=meta["machine"],
                        hidden=hidden, layers=layers, inter=inter, heads=heads, kv=kv, vocab=vocab,
                        params=first["ranks"][0]["params"] / 1e6, bytes=mb(first["ranks"][0]["params"] * 2),
                        shard=meta["shard"], rounds=meta["rounds"], size=meta["size"], table=render_table(results),
                        nproc=meta.get("nproc", nranks(results)),
                        goal=GOAL_RATIO, goals=render_goals(results), checks=render_checks(results),
                        notes=render_notes(results))


def write_doc(block: str):
    from doc_template import with_save_block

    text = DOC.read_text() if DOC.exists() else ""
    DOC.write_text(with_save_block(text, block))
    print(f"\nwrote the save-time section of {DOC.relative_to(REPO)}", file=sys.stderr)


# ---------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per stage (>= 3 for the doc)")
    p.add_argument("--stages", default="2,3", help="comma-separated ZeRO stages (2, 3)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--shard", default=None, help="max_shard_size for every variant (default 100MB; 1MB with --small)")
    p.add_argument("--small", action="store_true", help="smoke run: a ~1M-parameter model, results not put in the doc")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--doc-only", action="store_true", help="re-render the section from the last results json")
    args = p.parse_args(argv)
    results_path, work = paths(args.small)
    if args.doc_only:
        results = json.loads(results_path.read_text())
    else:
        import export_bench  # benchmarks/export_bench.py: the same machine line as the rest of the page
        from save_bench_case import SHAPES

        size = "small" if args.small else "156m"
        shard = args.shard or ("1MB" if args.small else "100MB")
        started = datetime.datetime.now().astimezone()
        t0 = time.perf_counter()
        stages = {}
        for s in [int(x) for x in args.stages.split(",") if x]:
            stages[str(s)] = run_stage(s, work / f"zero{s}", size=size, rounds=args.rounds, shard=shard,
                                       nproc=args.nproc)
        meta = {"machine": export_bench.machine(), "date": started.strftime("%Y-%m-%d %H:%M %Z"),
                "rounds": args.rounds, "nproc": args.nproc, "size": size, "shape": SHAPES[size], "shard": shard,
                "seconds": round(time.perf_counter() - t0, 1)}
        results = {"meta": meta, "stages": stages}
        CACHE.mkdir(exist_ok=True)
        results_path.write_text(json.dumps(results, indent=1))
        bad = [f"ZeRO-{st}: {k}: {v}" for st, r in stages.items() for k, v in r["checks"].items()
               if not v.startswith("bitwise")]
        if bad:
            sys.exit("error: outputs differ from save_pretrained's (page left alone):\n" + "\n".join(bad))
    print(render_table(results))
    print()
    print(render_goals(results))
    print()
    print(render_checks(results))
    if not args.no_doc and not args.small:
        write_doc(render_block(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
