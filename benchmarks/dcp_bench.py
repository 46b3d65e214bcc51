"""``make bench``: hf-ckpt export of an FSDP2 / torch DCP checkpoint against torch's and Accelerate's consolidation.

1. Builds the checkpoint once (``benchmarks/make_dcp_ckpt.py`` under torchrun, 2 ranks, CPU/gloo,
   cached under ``.bench-cache/`` keyed by the package versions and the scripts that make it): the
   same weights saved by DCP's ``FileSystemWriter`` and by ``HuggingFaceStorageWriter(save_distributed=True)``.
2. Runs the tools **alternately** (``--rounds`` rounds), each a fresh child process, output removed
   and ``sync`` run (untimed) before each run, peak RSS from the child's own rusage (``export_bench.run_child``):
   ``hf-ckpt export`` fp32 and bf16 (FileSystemWriter input; fp32 also from the HF-writer input),
   ``dcp_to_torch_save`` + ``from_config`` + ``load_state_dict`` + ``save_pretrained``,
   ``accelerate merge-weights``, ``consolidate_safetensors_files`` (HF-writer input), then, in the same
   round, ``cp -r`` + ``sync`` of our fp32 output (the floor).
3. Checks once, outside the timing, that every output's tensors equal ours bitwise (bf16: equal to
   torch's round-to-nearest-even cast of ours fp32).
4. Prints the tables and replaces the ``dcp-bench`` block of ``docs/benchmarks.md``.

Not a test: nothing asserts a time. Usage: ``.venv/bin/python benchmarks/dcp_bench.py [--size 156m|40m]
[--rounds 3] [--no-doc] [--doc-only] [--build-only] [--note TEXT]``.
"""
import argparse
import datetime
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import export_bench as eb  # noqa: E402  (run_child, tree_bytes, tensors_equal, machine, formatting)

REPO, PY, CACHE = eb.REPO, eb.PY, eb.CACHE
DOC = REPO / "docs" / "benchmarks.md"
START, END = "<!-- dcp-bench:start -->", "<!-- dcp-bench:end -->"
BIN = Path(PY).parent
MAKE = HERE / "make_dcp_ckpt.py"
# What the checkpoint depends on: the builder, the test engines' FSDP2 helpers, the model sizes.
MAKE_INPUTS = (MAKE, REPO / "tests" / "engines" / "fsdp_train.py", REPO / "tests" / "engines" / "common.py",
               HERE / "make_ckpt.py")

# dcp_to_torch_save, then what users do with the torch save: the model from its config, the state
# dict loaded into it, save_pretrained. The model is built on the meta device and the tensors
# assigned (load_state_dict(assign=True)): the cheapest form of that path, no random init.
TORCH_SAVE_PRETRAINED = (
    "import sys, torch\n"
    "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
    "from transformers import AutoConfig, AutoModelForCausalLM\n"
    "src, cfg, pt, out = sys.argv[1:5]\n"
    "dcp_to_torch_save(src, pt)\n"
    "sd = torch.load(pt, weights_only=True)\n"
    "with torch.device('meta'):\n"
    "    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg), dtype=torch.float32)\n"
    "model.load_state_dict(sd, assign=True, strict=True)\n"
    "model.save_pretrained(out)\n")


# ---------------------------------------------------------------- the checkpoint
def cache_dir() -> Path:
    h = hashlib.sha256()
    for pkg in ("torch", "transformers", "accelerate"):
        h.update(f"{pkg}={md.version(pkg)};".encode())
    for p in MAKE_INPUTS:
        h.update(p.read_bytes())
    return CACHE / f"dcp-{h.hexdigest()[:12]}"


def build(size: str) -> Path:
    out = cache_dir() / f"fsdp2-{size}"
    if (out / "DONE").exists():
        return out
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(MAKE), str(tmp),
           "--size", size]
    print(f"building fsdp2-{size} (once): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    log = tmp.parent / f"fsdp2-{size}.log"
    with open(log, "w") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**eb.CHILD_ENV, "OMP_NUM_THREADS": "1"}).returncode
    if rc != 0 or not (tmp / "dcp" / ".metadata").exists():
        sys.exit(f"error: building fsdp2-{size} failed ({rc}); see {log}")
    (tmp / "DONE").write_text(f"{time.perf_counter() - started:.1f} s\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ---------------------------------------------------------------- the tools
OURS, OURS_BF16 = "hf-ckpt export fp32", "hf-ckpt export bf16"
OURS_HF = "hf-ckpt export fp32 (HF-writer input)"
TORCH = "dcp_to_torch_save + save_pretrained"
ACC = "accelerate merge-weights"
CONS = "consolidate_safetensors_files (HF-writer input)"
PEERS = (TORCH, ACC, CONS)
FLOOR = "cp -r + sync of our fp32 output"


def tools_for(case: Path, out: Path):
    """name -> (command, output dir, output dtype, input dir). Every path is absolute."""
    src, hf, cfg = case / "dcp", case / "dcp-hf", case / "config"
    ours = [PY, "-m", "hf_ckpt_integrations", "export"]
    return {
        OURS: (ours + [str(src), str(out / "ours-fp32"), "--config", str(cfg)], out / "ours-fp32", "fp32", src),
        OURS_BF16: (ours + [str(src), str(out / "ours-bf16"), "--config", str(cfg), "--dtype", "bf16"],
                    out / "ours-bf16", "bf16", src),
        OURS_HF: (ours + [str(hf), str(out / "ours-hf"), "--config", str(cfg)], out / "ours-hf", "fp32", hf),
        TORCH: ([PY, "-c", TORCH_SAVE_PRETRAINED, str(src), str(cfg), str(out / "torch-save" / "model.pt"),
                 str(out / "torch-hf")], out / "torch-hf", "fp32", src),
        ACC: ([str(BIN / "accelerate"), "merge-weights", str(src), str(out / "accelerate")], out / "accelerate",
              "fp32", src),
        CONS: ([PY, "-c", eb.DCP_CONSOLIDATE, str(hf), str(out / "consolidated"), str(case / "dcp-fqn.json")],
               out / "consolidated", "fp32", hf),
    }


def prepare(name, out: Path):
    # dcp_to_torch_save writes into an existing directory; its output counts in "written"
    shutil.rmtree(out / "torch-save", ignore_errors=True)
    if name == TORCH:
        (out / "torch-save").mkdir()


# ---------------------------------------------------------------- checks (in children: the bench stays small)
def bf16_of(fp32_dir: Path, bf16_dir: Path) -> str:
    """'bitwise' when every tensor of ``bf16_dir`` is torch's bf16 cast of the one in ``fp32_dir``."""
    import torch
    from safetensors.torch import load_file

    def load(d):
        out = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            out.update(load_file(str(f)))
        return out

    a, b = load(fp32_dir), load(bf16_dir)
    if set(a) != set(b):
        return f"DIFFERENT names: {sorted(set(a) ^ set(b))[:4]}"
    for k in a:
        x = a[k].to(torch.bfloat16)
        if b[k].dtype != torch.bfloat16 or x.shape != b[k].shape or not torch.equal(x.view(torch.int16),
                                                                                      b[k].view(torch.int16)):
            return f"DIFFERENT: {k}"
    return f"bitwise ({len(a)} tensors)"


def in_child(func, a: Path, b: Path) -> str:
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import dcp_bench as d; "
            f"print(d.{func}(*map(d.Path, sys.argv[1:])))")
    return subprocess.run([PY, "-c", code, str(a), str(b)], capture_output=True, text=True, env=eb.CHILD_ENV,
                          check=True).stdout.strip()


# ---------------------------------------------------------------- the run
def bench(case: Path, rounds: int):
    out = CACHE / "out" / "dcp"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tools = tools_for(case, out)
    walls = {k: [] for k in tools}
    rss = {k: [] for k in tools}
    writes, floor = [], []
    # The peers' modules in .venv have their .pyc files (pip compiled them); this checkout's package
    # has none when PYTHONDONTWRITEBYTECODE is set (it is here): compile it as `pip install` would,
    # or every hf-ckpt run pays ~0.2 s of compiling its own source.
    subprocess.run([PY, "-m", "compileall", "-q", str(REPO / "hf_ckpt_integrations")], check=True,
                   env={k: v for k, v in eb.CHILD_ENV.items() if k != "PYTHONDONTWRITEBYTECODE"})
    # The first hf-ckpt run of a fresh HF_CKPT_CACHE asks transformers for the Hub layout (once per
    # model and release, as the first checkpoint-N of a real run does): a warm-up outside the rounds.
    # The cache key holds the tensor names in the source's order, which differs between the two
    # DCP writers: one warm-up for each input.
    first = {}
    for k in (OURS, OURS_HF):
        cmd, dst, _, _ = tools[k]
        shutil.rmtree(dst, ignore_errors=True)
        first[k] = eb.run_child(cmd)[:2]
    print(f"alternating {list(tools)} x{rounds}", file=sys.stderr, flush=True)
    for i in range(rounds):
        for k, (cmd, dst, _, _) in tools.items():
            shutil.rmtree(dst, ignore_errors=True)
            prepare(k, out)
            os.sync()  # no tool waits on the writeback of the one before it (the peers do not fsync)
            w, r, text = eb.run_child(cmd)
            walls[k].append(w)
            rss[k].append(r)
            if k == OURS:
                writes.append(eb.write_seconds(text))
            print(f"  round {i + 1}: {k}: {w:.2f} s, {r / 1e6:.0f} MB", file=sys.stderr, flush=True)
        shutil.rmtree(out / "copy", ignore_errors=True)
        os.sync()
        w, r, _ = eb.run_child(["sh", "-c", 'cp -r "$0" "$1" && sync "$1"/*', str(out / "ours-fp32"),
                                str(out / "copy")])
        floor.append((w, r))
    rows = {k: {"wall": walls[k], "rss": max(rss[k]), "written": eb.tree_bytes(tools[k][1])
                + (eb.tree_bytes(out / "torch-save") if k == TORCH else 0), "dtype": tools[k][2]}
            for k in tools}
    rows[FLOOR] = {"wall": [w for w, _ in floor], "rss": max(r for _, r in floor),
                   "written": eb.tree_bytes(out / "copy"), "dtype": "fp32"}

    # What bounds ours: a bare interpreter, and the imports every peer pays before its work.
    fixed = {}
    for label, code in (("python -c pass", "pass"), ("import torch", "import torch"),
                        ("import hf_ckpt_integrations.cli", "import hf_ckpt_integrations.cli")):
        fixed[label] = eb.median([eb.run_child([PY, "-c", code])[0] for _ in range(rounds)])

    ours = out / "ours-fp32"
    checks = {f"{k} vs {OURS}": in_child("tensors_equal", tools[k][1], ours) for k in (OURS_HF,) + PEERS}
    checks[f"{OURS_BF16} vs torch's bf16 cast of {OURS}"] = in_child("bf16_of", ours, out / "ours-bf16")
    info = {"ckpt_bytes": eb.tree_bytes(case / "dcp"), "hf_bytes": eb.tree_bytes(case / "dcp-hf"),
            "params": rows[OURS]["written"] // 4, "first_run": list(first[OURS]),
            "write_phase": eb.median([w for w in writes if w is not None]), "fixed": fixed}
    shutil.rmtree(out, ignore_errors=True)
    return rows, checks, info


def tensors_equal(a: Path, b: Path) -> str:
    return eb.tensors_equal(a, b)


# ---------------------------------------------------------------- rendering
def goals(rows):
    """(fastest peer, wall ratio, RSS ratio against it, RSS ratio against the smallest peer, fp32/cp)."""
    med = {k: eb.median(rows[k]["wall"]) for k in rows}
    fastest = min(PEERS, key=lambda k: med[k])
    o = rows[OURS]
    return (fastest, med[OURS] / med[fastest], o["rss"] / rows[fastest]["rss"],
            o["rss"] / min(rows[k]["rss"] for k in PEERS), med[OURS] / med[FLOOR])


def render(rows, checks, info, meta):
    L = ["| tool | input | out | median wall (min–max) | ours / it (wall) | peak RSS | ours / it (RSS) | written |",
         "|---|---|---|---|---|---|---|---|"]
    tools = tools_for(Path("CKPT"), Path("OUT"))
    ow, orss = eb.median(rows[OURS]["wall"]), rows[OURS]["rss"]
    for k, r in rows.items():
        src = {"dcp": "FileSystemWriter", "dcp-hf": "HF writer"}.get(tools[k][3].name, "our output") \
            if k in tools else "our output"
        ratio_w = f"{ow / eb.median(r['wall']):.3f}" if k != OURS else "1"
        ratio_r = f"{orss / r['rss']:.3f}" if k not in (OURS, FLOOR) else ("1" if k == OURS else "–")
        L.append(f"| {k} | {src} | {r['dtype']} | {eb.fmt_s(r['wall'])} | {ratio_w} | {eb.mb(r['rss'])} "
                 f"| {ratio_r} | {eb.mb(r['written'])} |")
    fastest, wr, rr, rr_min, cp = goals(rows)
    ok = lambda c: "met" if c else "**not met**"  # noqa: E731
    L += ["", f"Against the issue's goals (medians of this run, {meta['rounds']} rounds):", "",
          f"- wall: ours fp32 {wr:.3f}x the fastest peer (`{fastest}`), goal ≤ 0.2: {ok(wr <= 0.2)}",
          f"- memory: ours fp32 peak RSS {rr:.3f}x that peer's, goal ≤ 0.1: {ok(rr <= 0.1)} "
          f"({rr_min:.3f}x the smallest peer's)",
          f"- fp32 {cp:.2f}x `cp -r` + `sync` of its own output, goal ≤ 2: {ok(cp <= 2)}",
          f"- bf16: {eb.median(rows[OURS_BF16]['wall']) / eb.median(rows[fastest]['wall']):.3f}x the fastest peer's "
          f"wall (which writes fp32), peak RSS {eb.mb(rows[OURS_BF16]['rss'])}",
          "", "" if "fixed" not in info else f"What bounds ours (medians): its write phase (the byte copy and per-shard `fsync`, from the "
          f"summary line) {info['write_phase']:.2f} s; fixed costs of a fresh interpreter: " +
          ", ".join(f"`{k}` {v:.2f} s" for k, v in info["fixed"].items()) + ".",
          "", "Equality checks (once, after the timed rounds):", ""]
    L += [f"- {k}: {v}" for k, v in checks.items()]
    first, first_rss = info["first_run"]
    L += ["", f"Checkpoint: {info['params'] / 1e6:.0f}M parameters; FileSystemWriter directory "
          f"{eb.mb(info['ckpt_bytes'])}, HF-writer directory {eb.mb(info['hf_bytes'])}. The first `hf-ckpt` run of "
          f"the fresh layout cache (outside the rounds: it asks transformers for the Hub layout, once per model "
          f"and release) took {first:.2f} s and {eb.mb(first_rss)}."]
    return "\n".join(L)


SECTION = """{start}
## FSDP / torch DCP: hf-ckpt export against torch's and Accelerate's consolidation

Generated by `.venv/bin/python benchmarks/dcp_bench.py --size {size} --rounds {rounds}` (part of `make bench`)
on {date}. Re-render from the last run: `.venv/bin/python benchmarks/dcp_bench.py --doc-only`.

**Machine:** {machine}. {note}

### What is measured

The checkpoint (built once by `benchmarks/make_dcp_ckpt.py` under `torchrun --standalone
--nproc_per_node=2`, CPU/gloo, cached under `.bench-cache/dcp-<key>/`): a Llama
({model}, vocab 32000, untied embeddings; 156m is the issue's model), `fully_shard` per
decoder layer and at the root (`tests/engines/fsdp_train.py`), one AdamW
step, then its sharded model state dict saved by `torch.distributed.checkpoint.save` twice: with
the default `FileSystemWriter` (`CKPT/dcp`: `.metadata` + one `.distcp` per rank, as in
Accelerate's and the Trainer's `pytorch_model_fsdp_0/`; the optimizer goes to its own directory
there, so this one holds the model only and no peer pays for reading optimizer state) and with
`HuggingFaceStorageWriter(save_distributed=True)` (`CKPT/dcp-hf`: one safetensors file per rank).

Each tool runs as a fresh child process (interpreter start and imports count), output removed
and `sync` run (untimed) before each run, so no tool waits on the writeback of the one before it,
**alternating** in {rounds} rounds on a warm page cache (each round ends with the floor, a copy
of that round's fp32 output); the package is byte-compiled first (`compileall`), as `pip install`
leaves it and as the peers' modules in `.venv` are; peak RSS is the child's `ru_maxrss`
(`os.wait4`). The commands (`CKPT=.bench-cache/dcp-<key>/fsdp2-{size}`):

```
python -m hf_ckpt_integrations export CKPT/dcp OUT --config CKPT/config [--dtype bf16]
python -m hf_ckpt_integrations export CKPT/dcp-hf OUT --config CKPT/config
python -c "dcp_to_torch_save(CKPT/dcp, PT); sd = torch.load(PT, weights_only=True)
           with torch.device('meta'): m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CKPT/config))
           m.load_state_dict(sd, assign=True); m.save_pretrained(OUT)"      # torch + transformers
accelerate merge-weights CKPT/dcp OUT                                         # Accelerate {acc}
python -c "consolidate_safetensors_files(CKPT/dcp-hf, OUT, fqn_to_index={{all: 1}})"   # torch DCP
sh -c 'cp -r OURS_FP32 COPY && sync COPY/*'                                   # the floor
```

The `dcp_to_torch_save` row is the cheapest form of what users do with the torch save (the model
built on the meta device, no random init); its "written" includes the intermediate `.pt`. `hf-ckpt`
fsyncs every shard before its rename; none of the peers fsyncs, the floor does.

### Results

{table}

### How to read this

- `hf-ckpt export` reads `.metadata` with its restricted unpickler, finds each rank's dim-0 chunk
  as a byte range of a `.distcp` file and copies the bytes into the safetensors shard
  (`os.copy_file_range`): it imports neither torch nor transformers (the Hub layout comes from its
  cache after the first run) and holds no tensor in memory, so its wall is interpreter start +
  planning + a copy of the bytes, and its RSS is the interpreter's. Each peer imports torch,
  loads every tensor into memory (the whole model: RSS ≥ the checkpoint's size) and writes it.
- Against `cp -r`: ours pays what a copy does not, a fresh interpreter importing the package
  (`import hf_ckpt_integrations.cli` in the fixed costs), unpickling `.metadata` and planning, and
  the restricted parse of each chunk's `torch.save` archive header; the rest is its write phase
  (copy + `fsync`, shown above), the same bytes the copy moves.
- {load}
- The ratios are of medians of one run; compare only within a run.
{end}"""


def model_shape(size: str) -> str:
    """``make_ckpt.SIZES[size]`` in words, read without importing make_ckpt (it imports torch, and a
    child's ``ru_maxrss`` starts from the RSS of this process)."""
    import ast

    tree = ast.parse((HERE / "make_ckpt.py").read_text())
    sizes = next(ast.literal_eval(n.value) for n in tree.body
                 if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "SIZES")
    hidden, layers, inter, heads, kv = sizes[size]
    return f"{size}: hidden {hidden}, {layers} layers, intermediate {inter}, {heads}/{kv} heads"


def render_section(rows, checks, info, meta):
    load = ("The machine is shared and was loaded during this run (the lead's full CI ran in parallel on its "
            "2 cores): spans are wide, and every absolute time here is inflated; the fixed cost of a fresh "
            "interpreter importing torch weighs on every peer row.")
    if meta.get("load"):
        (a, _, _), (b, _, _) = meta["load"]
        load += f" 1-minute load average {a:.1f} when the rounds started, {b:.1f} when they ended."
    return SECTION.format(start=START, end=END, table=render(rows, checks, info, meta), load=load,
                          acc=md.version("accelerate"), model=model_shape(meta["size"]), note=meta.get("note", ""),
                          **{k: meta[k] for k in ("size", "rounds", "date", "machine")})


def write_doc(section: str):
    text = DOC.read_text()
    i, j = text.find(START), text.find(END)
    if 0 <= i < j:
        text = text[:i] + section + text[j + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOC.write_text(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="156m", choices=("40m", "156m", "300m"),
                   help="model of benchmarks/make_ckpt.py (156m: the issue's)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (>= 3 for the doc)")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--doc-only", action="store_true", help="re-render the doc from the last run's results")
    p.add_argument("--note", default="", help="a sentence on the machine's state, printed under it")
    args = p.parse_args(argv)
    results = CACHE / f"dcp-results-{args.size}.json"
    if args.doc_only:
        saved = json.loads(results.read_text())
        rows, checks, info, meta = saved["rows"], saved["checks"], saved["info"], saved["meta"]
        meta["note"] = args.note or meta.get("note", "")
    else:
        import tempfile

        eb.CHILD_ENV["HF_CKPT_CACHE"] = tempfile.mkdtemp(prefix="hfckpt-dcp-bench-layout-")
        started = datetime.datetime.now().astimezone()
        case = build(args.size)
        if args.build_only:
            return 0
        load = os.getloadavg()
        rows, checks, info = bench(case, args.rounds)
        meta = {"load": [load, os.getloadavg()], "machine": eb.machine(),
                "date": started.strftime("%Y-%m-%d %H:%M %Z"), "rounds": args.rounds, "size": args.size,
                "note": args.note}
        results.write_text(json.dumps({"rows": rows, "checks": checks, "info": info, "meta": meta}, indent=1))
    print(render(rows, checks, info, meta))
    if not args.no_doc:
        write_doc(render_section(rows, checks, info, meta))
        print(f"\nwrote {DOC.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
