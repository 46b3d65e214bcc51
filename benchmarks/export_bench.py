"""``make bench``: hf-ckpt export against DeepSpeed's ``zero_to_fp32.py`` and torch DCP's consolidation.

1. Builds the benchmark checkpoints once (``benchmarks/make_ckpt.py`` under torchrun, 2 ranks,
   cached under ``.bench-cache/`` keyed by the package versions and that script).
2. For every case runs the tools **alternately** (z2f, ours fp32, ours bf16, [DCP fp32, DCP bf16],
   repeated ``--pairs`` times), each as a fresh child process on a warm page cache, output removed
   before each run; then ``cp -r`` of our output as the floor, and (main case) the rank-parallel
   export under ``torchrun --nproc_per_node 2``.
3. One extra *cold* run of each tool per case after evicting the source files from the page cache
   (``posix_fadvise(DONTNEED)``, only those files): the bytes of the checkpoint then resident
   (``mincore``) are what the tool read.
4. Checks: ours fp32 == zero_to_fp32's tensors bitwise; ours == DCP's consolidated tensors (fp32
   and bf16) bitwise; the rank-parallel output == the 1-process output, every file byte for byte.
5. Prints the tables as Markdown and writes ``docs/benchmarks.md``.

Not a test: nothing here asserts a time. Usage: ``.venv/bin/python benchmarks/export_bench.py
[--pairs 3] [--cases z3-156m,...] [--build-only] [--no-doc]``.
"""
import argparse
import ctypes
import datetime
import hashlib
import importlib.metadata as md
import json
import mmap
import os
import platform
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
MAIN_CASE = "z3-156m"
PAR_SHARD = "200MB"
RESULTS = CACHE / "results.json"

# name -> (make_ckpt --size, --stage, also save torch DCP copies)
CASES = {
    "z3-156m": ("156m", 3, True),  # the checkpoint of the issue
    "z2-156m": ("156m", 2, False),
    "z3-40m": ("40m", 3, False),
    "z3-300m": ("300m", 3, False),
}
CHILD_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}

DCP_CONSOLIDATE = ("import json, os, sys\n"
                   "from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files\n"
                   "os.makedirs(sys.argv[2])\n"
                   "consolidate_safetensors_files(sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])))\n")


# ---------------------------------------------------------------- building the checkpoints
def cache_dir() -> Path:
    h = hashlib.sha256()
    for pkg in ("torch", "deepspeed", "transformers"):
        h.update(f"{pkg}={md.version(pkg)};".encode())
    h.update((REPO / "benchmarks" / "make_ckpt.py").read_bytes())
    return CACHE / f"ckpt-{h.hexdigest()[:12]}"


def build(name) -> Path:
    size, stage, dcp = CASES[name]
    out = cache_dir() / name
    if (out / "DONE").exists():
        return out
    tmp = out.with_name(name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "benchmarks" / "make_ckpt.py"), str(tmp), "--size", size, "--stage", str(stage)]
    cmd += ["--dcp"] if dcp else []
    print(f"building {name} (once): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with open(tmp.parent / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**CHILD_ENV, "OMP_NUM_THREADS": "1"}).returncode
    if rc != 0:
        sys.exit(f"error: building {name} failed ({rc}); see {tmp.parent / (name + '.log')}")
    (tmp / "DONE").write_text(f"{time.perf_counter() - started:.1f} s\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


# ---------------------------------------------------------------- measuring one child
def run_child(cmd, *, cwd=REPO):
    """Run ``cmd``; return (wall seconds, peak RSS bytes of the child (max over the process tree it
    waited for), stdout text). ``os.wait4`` gives this child's own rusage, not the sum of all."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(map(str, cmd))} failed ({proc.returncode}):\n{out.decode(errors='replace')[-3000:]}")
    return wall, usage.ru_maxrss * 1024, out.decode(errors="replace")


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def source_files(case: Path, subdir="ckpt"):
    return [p for p in (case / subdir).rglob("*") if p.is_file()]


def evict(files):
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # only clean pages can be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)


def resident_bytes(files) -> int:
    """Bytes of ``files`` now in the page cache (``mincore`` over a private, never-written mapping)."""
    page = mmap.PAGESIZE
    total = 0
    for p in files:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as fh:
            # ACCESS_COPY only so ctypes can take the address; nothing is written, so every page
            # mincore reports is the file's page-cache page.
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        anchor = ctypes.c_char.from_buffer(m)
        try:
            vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            total += sum(v & 1 for v in vec) * page
        finally:
            del anchor
            m.close()
    return total


# ---------------------------------------------------------------- the tools
def tools_for(case: Path, out: Path, has_dcp: bool):
    """name -> (command, output dir, output dtype)."""
    src, cfg = case / "ckpt", case / "config"
    t = {
        "zero_to_fp32": ([PY, str(src / "zero_to_fp32.py"), str(src), str(out / "z2f"), "--safe_serialization"],
                         out / "z2f", "fp32"),
        "hf-ckpt fp32": ([PY, "-m", "hf_ckpt_integrations", "export", str(src), str(out / "ours-fp32"),
                          "--config", str(cfg)], out / "ours-fp32", "fp32"),
        "hf-ckpt bf16": ([PY, "-m", "hf_ckpt_integrations", "export", str(src), str(out / "ours-bf16"),
                          "--config", str(cfg), "--dtype", "bf16"], out / "ours-bf16", "bf16"),
    }
    if has_dcp:
        for d in ("fp32", "bf16"):
            t[f"DCP consolidate {d}"] = ([PY, "-c", DCP_CONSOLIDATE, str(case / f"dcp-{d}"), str(out / f"dcp-{d}"),
                                          str(case / "dcp-fqn.json")], out / f"dcp-{d}", d)
    return t


def parallel_cmd(case: Path, dst: Path, nproc=2, extra=()):
    return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "tests" / "scripts" / "parallel_export.py"), str(case / "ckpt"), str(dst),
            "--config", str(case / "config"), *extra]


def write_seconds(stdout: str):
    """The writer's own timing from ``hf-ckpt export``'s summary line (``..., 1.23 s``)."""
    for line in stdout.splitlines():
        if line.startswith("wrote ") and line.endswith(" s"):
            return float(line.rsplit(",", 1)[1].strip()[:-2])
    return None


# ---------------------------------------------------------------- equality checks
def tensors_equal(a: Path, b: Path) -> str:
    """'bitwise' when every tensor of HF dir ``a`` equals the one of the same name in ``b`` bit for bit."""
    from safetensors import safe_open

    def load(d):
        out = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                for k in fh.keys():
                    out[k] = fh.get_tensor(k)
        return out

    ta, tb = load(a), load(b)
    if set(ta) != set(tb):
        return f"DIFFERENT names: {sorted(set(ta) ^ set(tb))[:4]}"
    for k in ta:
        x, y = ta[k], tb[k]
        if x.dtype != y.dtype or x.shape != y.shape or x.contiguous().view(-1).view(dtype=__import__("torch").uint8) \
                .ne(y.contiguous().view(-1).view(dtype=__import__("torch").uint8)).any():
            return f"DIFFERENT: {k}"
    return f"bitwise ({len(ta)} tensors)"


def in_child(func, a: Path, b: Path) -> str:
    """Run a check in a child process. The bench process itself must stay small: a child's
    ``ru_maxrss`` starts from the RSS of the process it was forked from, so loading tensors here
    would inflate every later measurement."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import export_bench as b; " \
           f"print(b.{func.__name__}(*map(b.Path, sys.argv[1:])))"
    return subprocess.run([PY, "-c", code, str(a), str(b)], capture_output=True, text=True, env=CHILD_ENV,
                          check=True).stdout.strip()


def files_identical(a: Path, b: Path) -> str:
    na = sorted(p.name for p in a.iterdir())
    nb = sorted(p.name for p in b.iterdir())
    if na != nb:
        return f"DIFFERENT file lists {na} vs {nb}"
    for n in na:
        if (a / n).read_bytes() != (b / n).read_bytes():
            return f"DIFFERENT bytes in {n}"
    return f"identical ({len(na)} files)"


# ---------------------------------------------------------------- the run
def median(xs):
    return statistics.median(xs) if xs else float("nan")


def bench_case(name: str, case: Path, pairs: int, parallel: bool):
    size, stage, has_dcp = CASES[name]
    out = CACHE / "out" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tools = tools_for(case, out, has_dcp)
    walls = {k: [] for k in tools}
    rss = {k: [] for k in tools}
    writes = []
    print(f"[{name}] alternating {list(tools)} x{pairs}", file=sys.stderr, flush=True)
    for _ in range(pairs):
        for k, (cmd, dst, _) in tools.items():
            shutil.rmtree(dst, ignore_errors=True)
            w, r, text = run_child(cmd)
            walls[k].append(w)
            rss[k].append(r)
            if k == "hf-ckpt fp32":
                writes.append(write_seconds(text))
    rows = {k: {"wall": walls[k], "rss": max(rss[k]), "written": tree_bytes(tools[k][1]), "dtype": tools[k][2]}
            for k in tools}
    rows["hf-ckpt fp32"]["write_phase"] = median([w for w in writes if w is not None])

    # The floor: a raw copy of the output bytes on the same file system, fsynced like ours
    # (hf-ckpt fsyncs every shard; coreutils `sync FILE...` fsyncs the named files).
    for label, srcdir in (("cp -r output fp32", out / "ours-fp32"), ("cp -r output bf16", out / "ours-bf16")):
        ws = []
        for _ in range(pairs):
            shutil.rmtree(out / "copy", ignore_errors=True)
            w, r, _ = run_child(["sh", "-c", 'cp -r "$0" "$1" && sync "$1"/*', str(srcdir), str(out / "copy")])
            ws.append(w)
        rows[label] = {"wall": ws, "rss": r, "written": tree_bytes(out / "copy"), "dtype": label.rsplit(" ", 1)[1]}
        shutil.rmtree(out / "copy", ignore_errors=True)

    if parallel:
        # Rank-parallel needs several shards to split: both sides use the same smaller shard size.
        small = ["--max-shard-size", PAR_SHARD]
        extra_rows = [
            (f"hf-ckpt fp32, {PAR_SHARD} shards", tools["hf-ckpt fp32"][0][:] + small, out / "one-fp32"),
            (f"hf-ckpt torchrun x2 fp32, {PAR_SHARD} shards", parallel_cmd(case, out / "par-fp32", extra=small),
             out / "par-fp32"),
        ]
        extra_rows[0][1][extra_rows[0][1].index(str(out / "ours-fp32"))] = str(out / "one-fp32")
        ws = {label: [] for label, _, _ in extra_rows}
        rs = {label: [] for label, _, _ in extra_rows}
        for _ in range(pairs):
            for label, cmd, dst in extra_rows:
                shutil.rmtree(dst, ignore_errors=True)
                w, r, _ = run_child(cmd)
                ws[label].append(w)
                rs[label].append(r)
        for label, _, dst in extra_rows:
            rows[label] = {"wall": ws[label], "rss": max(rs[label]), "written": tree_bytes(dst), "dtype": "fp32"}
        w, _, text = run_child([PY, str(REPO / "benchmarks" / "workers_bench.py"), str(case), "--shard", PAR_SHARD])
        rows["_workers"] = text.strip()

    # Cold runs: what each tool reads of the checkpoint.
    files = source_files(case)
    for k in ("zero_to_fp32", "hf-ckpt fp32", "hf-ckpt bf16"):
        cmd, dst, _ = tools[k]
        shutil.rmtree(dst, ignore_errors=True)
        evict(files)
        before = resident_bytes(files)
        w, _, _ = run_child(cmd)
        rows[k]["read"] = resident_bytes(files) - before
        rows[k]["cold"] = w
    if has_dcp:
        for d in ("fp32", "bf16"):
            k = f"DCP consolidate {d}"
            cmd, dst, _ = tools[k]
            shutil.rmtree(dst, ignore_errors=True)
            dfiles = source_files(case, f"dcp-{d}")
            evict(dfiles)
            before = resident_bytes(dfiles)
            w, _, _ = run_child(cmd)
            rows[k]["read"] = resident_bytes(dfiles) - before
            rows[k]["cold"] = w

    checks = {"hf-ckpt fp32 vs zero_to_fp32": in_child(tensors_equal, out / "ours-fp32", out / "z2f")}
    if has_dcp:
        checks["hf-ckpt fp32 vs DCP fp32"] = in_child(tensors_equal, out / "ours-fp32", out / "dcp-fp32")
        checks["hf-ckpt bf16 vs DCP bf16"] = in_child(tensors_equal, out / "ours-bf16", out / "dcp-bf16")
    if parallel:
        checks[f"torchrun x2 vs 1 process, {PAR_SHARD} shards (every file)"] = in_child(files_identical, out / "par-fp32",
                                                                                    out / "one-fp32")
    info = {"ckpt_bytes": tree_bytes(case / "ckpt"), "params": rows["hf-ckpt fp32"]["written"] // 4,
            "optim_bytes": sum(p.stat().st_size for p in files if p.name.endswith("optim_states.pt"))}
    shutil.rmtree(out, ignore_errors=True)
    return rows, checks, info


def import_costs(pairs):
    out = {}
    for label, code in (("python -c pass", "pass"), ("import torch", "import torch"),
                        ("import deepspeed", "import deepspeed"),
                        ("import hf_ckpt_integrations.cli", "import hf_ckpt_integrations.cli"),
                        ("transformers Hub-layout question (Llama, uncached)",
                         "import transformers.core_model_loading, transformers.models.llama.modeling_llama")):
        out[label] = median([run_child([PY, "-c", code])[0] for _ in range(pairs)])
    return out


# ---------------------------------------------------------------- report
def mb(n):
    return f"{n / 1e6:,.0f} MB"


def fmt_s(xs):
    return f"{median(xs):.2f} s" + (f" ({min(xs):.2f}–{max(xs):.2f})" if len(xs) > 1 else "")


def render(results, imports):
    L = []
    L.append("| case | tool | out | median wall (min–max) | cold wall | peak RSS | read of ckpt (cold) | written |")
    L.append("|---|---|---|---|---|---|---|---|")
    for name, (rows, _, info) in results.items():
        for k, r in rows.items():
            if k.startswith("_"):
                continue
            cold = f"{r['cold']:.2f} s" if "cold" in r else "–"
            read = mb(r["read"]) if "read" in r else "–"
            L.append(f"| {name} | {k} | {r['dtype']} | {fmt_s(r['wall'])} | {cold} | {mb(r['rss'])} | {read} "
                     f"| {mb(r['written'])} |")
    L.append("")
    L.append("Ratios (medians of the same run; target in brackets):")
    L.append("")
    L.append("| case | params | ckpt | ours/z2f wall [≤0.2] | ours/z2f RSS [≤0.25] | ours/DCP wall [≤1.0] "
             "| ours/cp wall [≤2] | bf16: ours/DCP | bf16: ours/cp bf16 | bf16/ours fp32 [≤1.3] "
             "| bf16/cp fp32 [≤2.5] | bf16 RSS [≤100 MB] | write phase of ours |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    def ratio(a, b):
        return f"{median(a['wall']) / median(b['wall']):.2f}" if a and b else "–"

    for name, (rows, _, info) in results.items():
        o, z, ob = rows["hf-ckpt fp32"], rows["zero_to_fp32"], rows["hf-ckpt bf16"]
        L.append(f"| {name} | {info['params'] / 1e6:.0f}M | {info['ckpt_bytes'] / 1e9:.2f} GB | {ratio(o, z)} "
                 f"| {o['rss'] / z['rss']:.2f} | {ratio(o, rows.get('DCP consolidate fp32'))} "
                 f"| {ratio(o, rows['cp -r output fp32'])} | {ratio(ob, rows.get('DCP consolidate bf16'))} "
                 f"| {ratio(ob, rows['cp -r output bf16'])} | {ratio(ob, o)} | {ratio(ob, rows['cp -r output fp32'])} "
                 f"| {mb(ob['rss'])} | {o['write_phase']:.2f} s |")
    L.append("")
    L.append("Against the bf16 goals (medians of this run; the machine is shared, see the min–max spans):")
    L.append("")
    for name, (rows, _, info) in results.items():
        o, ob, cp = rows["hf-ckpt fp32"], rows["hf-ckpt bf16"], rows["cp -r output fp32"]
        a, b = median(ob["wall"]) / median(o["wall"]), median(ob["wall"]) / median(cp["wall"])
        L.append(f"- {name}: bf16 export {a:.2f}x our fp32 export "
                 f"(goal ≤ 1.3: {'met' if a <= 1.3 else '**not met**'}), "
                 f"{b:.2f}x `cp -r` + sync of the fp32 output (goal ≤ 2.5: {'met' if b <= 2.5 else '**not met**'}), "
                 f"peak RSS {mb(ob['rss'])} (goal ≤ 100 MB: {'met' if ob['rss'] <= 100e6 else '**not met**'})")
        par = rows.get(f"hf-ckpt torchrun x2 fp32, {PAR_SHARD} shards")
        if par:
            one = rows[f"hf-ckpt fp32, {PAR_SHARD} shards"]
            L.append(f"- {name}: rank-parallel export (torchrun, 2 ranks, {PAR_SHARD} shards) {fmt_s(par['wall'])} "
                     f"against {fmt_s(one['wall'])} in one process ({ratio(par, one)}x), byte-identical (below)")
    # ZeRO-3 only: there bf16 is a cast of the masters (ZeRO-1/2 copy their saved bf16 module weights).
    rss = sorted((info["params"], rows["hf-ckpt bf16"]["rss"]) for name, (rows, _, info) in results.items()
                 if CASES[name][1] == 3)
    if len(rss) > 1:
        L.append("- bf16 (a cast, ZeRO-3 cases) peak RSS against model size: " +
                 ", ".join(f"{p / 1e6:.0f}M params {mb(r)}" for p, r in rss))
    L.append("")
    L.append("Equality checks:")
    L.append("")
    for name, (_, checks, _) in results.items():
        for k, v in checks.items():
            L.append(f"- {name}: {k}: {v}")
    for name, (rows, _, _) in results.items():
        if "_workers" in rows:
            L.append("")
            L.append(f"Threads in one process ({name}, {PAR_SHARD} shards, write phase only, in-process "
                     f"medians): {rows['_workers']}")
    L.append("")
    L.append("Fixed costs (median of fresh interpreters): " +
             ", ".join(f"`{k}` {v:.2f} s" for k, v in imports.items()))
    return "\n".join(L)


def machine():
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fs = subprocess.run(["findmnt", "-no", "FSTYPE,SOURCE", "--target", str(CACHE)], capture_output=True,
                        text=True).stdout.strip() or "unknown"
    vers = ", ".join(f"{p} {md.version(p)}" for p in ("torch", "deepspeed", "transformers", "safetensors"))
    return (f"{platform.node()}: {os.cpu_count()} CPU cores ({cpu}), {mem / 2**30:.0f} GiB RAM, no GPU, "
            f"file system {fs}; Python {platform.python_version()}, {vers}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="alternating rounds per case (>= 3 for the doc)")
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    p.add_argument("--doc-only", action="store_true", help="re-render the doc from the last run's results.json")
    args = p.parse_args(argv)
    # The Hub-layout answers in a cache of this run (doc_template: "How to read this").
    import tempfile

    CHILD_ENV["HF_CKPT_CACHE"] = os.environ["HF_CKPT_CACHE"] = tempfile.mkdtemp(prefix="hfckpt-bench-layout-")
    names = [n for n in args.cases.split(",") if n]
    if args.doc_only:
        saved = json.loads(RESULTS.read_text())
        results, imports, meta = saved["results"], saved["imports"], saved["meta"]
    else:
        started = datetime.datetime.now().astimezone()
        built = {n: build(n) for n in names}
        if args.build_only:
            return 0
        results = {n: bench_case(n, built[n], args.pairs, parallel=(n == MAIN_CASE)) for n in names}
        imports = import_costs(args.pairs)
        meta = {"machine": machine(), "date": started.strftime("%Y-%m-%d %H:%M %Z"), "pairs": args.pairs}
        RESULTS.write_text(json.dumps({"results": results, "imports": imports, "meta": meta}, indent=1))
    table = render(results, imports)
    print(table)
    if not args.no_doc:
        from doc_template import render_doc, save_block  # benchmarks/doc_template.py

        DOC.parent.mkdir(exist_ok=True)
        old = DOC.read_text() if DOC.exists() else ""
        kept = save_block(old)  # save_bench.py's section, as is
        tail = []  # scale_bench.py's and dcp_bench.py's sections, as they are
        for block in ("scale-bench", "dcp-bench"):
            i, j = old.find(f"<!-- {block}:start -->"), old.find(f"<!-- {block}:end -->")
            if 0 <= i < j:
                tail.append(old[i:j + len(f"<!-- {block}:end -->")])
        doc = render_doc(table=table, save_bench=kept, **meta).rstrip("\n")
        DOC.write_text(doc + "".join("\n\n" + t for t in tail) + "\n")
        print(f"\nwrote {DOC.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
