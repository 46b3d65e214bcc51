"""setup.cfg promises ``python_requires >= 3.9``: no annotation the interpreter evaluates at import may
use what 3.9 cannot (PEP 604 ``X | Y``; PEP 585 ``list[int]`` is fine), unless the module postpones its
annotations (``from __future__ import annotations``). Read from the source (milliseconds); a module
that breaks it fails on import under 3.9, which no machine here runs."""

import ast
import configparser
from pathlib import Path

from helpers import REPO


def runtime_unions(pkg: Path) -> list:
    out = []
    for path in sorted(pkg.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
               for n in tree.body):
            continue
        anns = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                anns += [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [y for y in (a.vararg, a.kwarg) if y]
                         if x.annotation is not None]
                anns += [node.returns] if node.returns is not None else []
            elif isinstance(node, ast.AnnAssign):
                anns.append(node.annotation)
        out += [f"{path.relative_to(pkg.parent)}:{an.lineno}" for an in anns
                if any(isinstance(m, ast.BinOp) and isinstance(m.op, ast.BitOr) for m in ast.walk(an))
                and not isinstance(an, ast.Constant)]
    return out


def test_the_floor_is_3_9():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert cfg["options"]["python_requires"].strip() == ">=3.9", "update this test's rule with the floor"


def test_no_pep604_annotation_is_evaluated_at_import():
    bad = runtime_unions(REPO / "hf_ckpt_integrations")
    assert not bad, f"`X | Y` annotations Python 3.9 evaluates and cannot (use Optional/Union): {bad}"


def test_the_check_sees_a_runtime_union(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f(x: int | None) -> 'int | None': ...\n")
    (tmp_path / "pkg" / "b.py").write_text("from __future__ import annotations\ndef f(x: int | None): ...\n")
    assert runtime_unions(tmp_path / "pkg") == ["pkg/a.py:1"]
