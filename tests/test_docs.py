"""Code samples in the README and docs must match the code: every `hf-ckpt ...` command line
parses with the real argparse parser, and every Python sample compiles and imports only names
the package exports."""

import ast
import re
import shlex
import textwrap
from pathlib import Path

import pytest

import hf_ckpt_integrations
from hf_ckpt_integrations.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```(\w+)\n(.*?)^\s*```", re.S | re.M)


def _blocks(lang):
    for page in PAGES:
        for m in BLOCK.finditer(page.read_text()):
            if m.group(1) == lang:
                yield str(page.relative_to(REPO)), textwrap.dedent(m.group(2))


def test_there_are_samples_to_check():
    assert len(list(_blocks("bash"))) >= 2 and len(list(_blocks("python"))) >= 2


@pytest.mark.parametrize("page,line", [(p, ln.split("#")[0].strip()) for p, b in _blocks("bash")
                                      for ln in b.splitlines() if ln.strip().startswith("hf-ckpt ")])
def test_cli_samples_parse(page, line):
    argv = shlex.split(line)[1:]
    build_parser().parse_args(argv)  # SystemExit on an unknown flag or a missing argument


@pytest.mark.parametrize("page,code", list(_blocks("python")))
def test_python_samples_compile_and_import_real_names(page, code):
    tree = ast.parse(code)
    compile(tree, str(page), "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "hf_ckpt_integrations":
            for alias in node.names:
                assert hasattr(hf_ckpt_integrations, alias.name), f"{page}: {alias.name} is not exported"
