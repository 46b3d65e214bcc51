"""Type annotations, checked: mypy runs on the package with pyproject.toml's [tool.mypy] (annotated
defs checked, engines' imports skipped), and the share of fully annotated functions is counted from
the source (AST). Both are ratchets: raise FLOOR and lower MYPY_CEILING as annotations land (issue 36's
target: 80% annotated, 0 mypy errors)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "hf_ckpt_integrations"
FLOOR = 866  # fully annotated functions on main (of 960, 90%): raise it, never lower it
MYPY_CEILING = 36  # mypy errors on annotated code (169 before the annotation round): lower it as they are fixed


def annotated(pkg: Path = PKG):
    """(fully annotated functions, all functions) of ``pkg``: every argument but ``self``/``cls``
    annotated, and the return (``__init__`` excepted)."""
    full = total = 0
    for path in sorted(pkg.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            total += 1
            a = node.args
            args = a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]
            args = [x for i, x in enumerate(args) if not (i == 0 and x.arg in ("self", "cls"))]
            full += all(x.annotation is not None for x in args) and (node.returns is not None or node.name == "__init__")
    return full, total


def test_annotated_functions_do_not_fall_below_the_floor():
    full, total = annotated()
    assert full >= FLOOR, f"{full} of {total} functions fully annotated, below the floor {FLOOR}: annotate new code"


def test_the_count_sees_what_it_counts(tmp_path):
    (tmp_path / "m.py").write_text("def a(x: int) -> int: ...\ndef b(x): ...\nclass C:\n"
                                   "    def __init__(self, y: str): ...\n    def d(self) -> None: ...\n")
    assert annotated(tmp_path) == (3, 4)


def test_mypy_errors_do_not_grow():
    pytest.importorskip("mypy")  # requirements/main.txt pins it; the ColossalAI venv has none
    env = {**os.environ, "MYPY_CACHE_DIR": os.environ.get("MYPY_CACHE_DIR", str(REPO / ".mypy_cache"))}
    out = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")], cwd=REPO,
                         capture_output=True, text=True, env=env, timeout=600)
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert out.returncode in (0, 1) and "error:" not in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(errors) <= MYPY_CEILING, (f"{len(errors)} mypy errors (ceiling {MYPY_CEILING}); new ones:\n"
                                         + "\n".join(errors[:30]))
