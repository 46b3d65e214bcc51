#!/usr/bin/env python3
"""Break each guard in turn and check that the fast suite notices (``make mutants``).

The mutations are listed in ``tests/mutants.toml``: one line of a package file, its replacement,
the promise it breaks and the test files to run. The repository is copied once into a scratch
directory (the working tree is never touched); each mutation is written there, the test files run
on it (``-m "not engine" -x``, no engine launch allowed; an entry with ``engine = true`` runs its
engine tests too, on the checkpoints cached in ``HFCKPT_TEST_CACHE`` or ``.test-cache``: a guard
only a real engine save exercises), and the original line is put back. A
mutation is *caught* when a test fails, *survived* when they all pass. An entry whose line is not
found exactly once, or whose mutation does not compile, fails the run: the guard moved or changed,
so its entry (and its test) need a look.

Usage: ``scripts/mutants.py [--only TEXT] [--list] [--keep] [--no-baseline]``. Exit 0 when every mutation is caught.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIST = REPO / "tests" / "mutants.toml"
# What the scratch copy leaves out: version control, environments, caches, build output.
SKIP = shutil.ignore_patterns(".git", ".venv", ".venv-cai", ".test-cache", "site", "__pycache__", "*.pyc",
                              ".pytest_cache", ".hypothesis", "*.egg-info")


def load(path=LIST):
    entries = tomllib.loads(path.read_text())["mutant"]
    for i, m in enumerate(entries):
        missing = {"file", "line", "replace", "breaks", "tests"} - set(m)
        if missing:
            raise SystemExit(f"error: {path}: entry {i + 1} lacks {sorted(missing)}")
    return entries


def apply(text: str, m: dict) -> str:
    """``text`` with the one line equal to ``m["line"]`` (ignoring indentation) replaced; raises
    ValueError when that line is not there exactly once."""
    lines = text.splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if ln.strip() == m["line"].strip()]
    if len(hits) != 1:
        raise ValueError(f"{m['file']}: the line `{m['line']}` occurs {len(hits)} times (want exactly once); "
                         "the guard moved or changed: update tests/mutants.toml")
    ln = lines[hits[0]]
    indent = ln[:len(ln) - len(ln.lstrip())]
    lines[hits[0]] = indent + m["replace"].strip() + "\n"
    return "".join(lines)


def run_tests(scratch: Path, tests, timeout: int, engine: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(scratch), "HFCKPT_NO_ENGINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    select = ["-m", "not engine"]
    if engine:  # built once into the repository's cache, shared by every mutation (not the scratch copy)
        del env["HFCKPT_NO_ENGINE"]
        env.setdefault("HFCKPT_TEST_CACHE", str(REPO / ".test-cache"))
        select = []
    cmd = [sys.executable, "-m", "pytest", *tests, *select, "-x", "-q", "-p", "no:cacheprovider",
           "--no-header", "-W", "ignore"]
    try:
        return subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # a mutation that hangs a test is caught too
        return subprocess.CompletedProcess(cmd, 124, str(e.stdout or ""), "timed out")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the mutations whose file, line or 'breaks' contains this text")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per mutation's test run")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the run of the unmutated tests (only when they are known to pass)")
    args = ap.parse_args(argv)
    entries = load()
    if args.only:
        entries = [m for m in entries if any(args.only in m[k] for k in ("file", "line", "breaks"))]
    if args.list:
        for m in entries:
            print(f"{m['file']}: {m['breaks']}\n    - {m['line']}\n    + {m['replace']}")
        print(f"{len(entries)} mutations")
        return 0

    # Every entry must apply and compile before anything runs (a moved guard fails here, loudly).
    problems = []
    for m in entries:
        try:
            mutated = apply((REPO / m["file"]).read_text(), m)
            compile(mutated, m["file"], "exec")
        except (ValueError, SyntaxError, FileNotFoundError) as e:
            problems.append(str(e))
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2

    scratch = Path(tempfile.mkdtemp(prefix="hfckpt-mutants-")) / "repo"
    shutil.copytree(REPO, scratch, ignore=SKIP, symlinks=True)
    for venv in (".venv", ".venv-cai"):  # tests that name a venv find the real one
        if (REPO / venv).exists():
            os.symlink((REPO / venv).resolve(), scratch / venv)
    print(f"scratch copy: {scratch}", flush=True)
    try:
        all_tests = sorted({t for m in entries for t in m["tests"]})
        t0 = time.perf_counter()
        base = None if args.no_baseline else run_tests(scratch, all_tests, args.timeout)
        if base is not None and base.returncode != 0:
            print(base.stdout[-3000:] + base.stderr[-2000:])
            print(f"error: the unmutated tests fail ({' '.join(all_tests)}); fix them first", file=sys.stderr)
            return 2
        if base is not None:
            print(f"baseline: {' '.join(all_tests)} pass ({time.perf_counter() - t0:.0f} s)", flush=True)
        survived = []
        for n, m in enumerate(entries, 1):
            target = scratch / m["file"]
            original = target.read_text()
            target.write_text(apply(original, m))
            t0 = time.perf_counter()
            try:
                r = run_tests(scratch, m["tests"], args.timeout, engine=m.get("engine", False))
            finally:
                target.write_text(original)
            caught = r.returncode != 0
            failed = next((ln.split(" ", 1)[1].split(" - ")[0] for ln in r.stdout.splitlines()
                           if ln.startswith("FAILED ") or ln.startswith("ERROR ")), "")
            status = "caught  " if caught else "SURVIVED"
            print(f"[{n:2}/{len(entries)}] {status} {m['file']}: {m['breaks']} ({time.perf_counter() - t0:.0f} s)"
                  + (f" by {failed}" if failed else ""), flush=True)
            if not caught:
                survived.append(m)
        print(f"\n{len(entries) - len(survived)} of {len(entries)} mutations caught")
        for m in survived:
            print(f"survived: {m['file']}: {m['breaks']}\n    - {m['line']}\n    + {m['replace']}")
        return 1 if survived else 0
    finally:
        if args.keep:
            print(f"kept: {scratch}")
        else:
            shutil.rmtree(scratch.parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
