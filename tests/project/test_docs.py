"""Code samples in the README and docs must match the code.

Every `hf-ckpt ...` line parses with the real argparse parser and every Python sample compiles
and imports only names the package exports. The offline samples (CLI and API on
`out/checkpoint-500`, `ds_save_dir`) run for real against checkpoints from the engine matrix
laid out at those paths. Save-time samples need a live engine; the same calls run in the engine
tests and the notebooks.
"""

import ast
import re
import shlex
import textwrap
from pathlib import Path

import pytest

import hf_ckpt_integrations
from hf_ckpt_integrations.cli import build_parser
from helpers import REPO

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
    try:
        build_parser().parse_args(argv)  # SystemExit(2) on an unknown flag or a missing argument
    except SystemExit as e:
        assert e.code == 0, f"{page}: `{line}` does not parse"  # --version, --help: exit 0


@pytest.mark.parametrize("page,code", list(_blocks("python")))
def test_python_samples_compile_and_import_real_names(page, code):
    tree = ast.parse(code)
    compile(tree, str(page), "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "hf_ckpt_integrations":
            for alias in node.names:
                assert hasattr(hf_ckpt_integrations, alias.name), f"{page}: {alias.name} is not exported"


def _nav_pages(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _nav_pages(v)
    elif isinstance(node, list):
        for v in node:
            yield from _nav_pages(v)


def _nav():
    import yaml

    text = (REPO / "mkdocs.yml").read_text()
    return yaml.safe_load(text[text.index("nav:"):])["nav"]


def test_nav_is_the_newcomer_path_and_holds_every_page():
    """Getting started -> Supported inputs -> Hooks -> CLI -> Reliability -> Internals, every page in
    it once (a page outside the nav is found only by search), the new pages first."""
    nav = _nav()
    groups = [next(iter(item)) for item in nav if isinstance(item, dict)]
    order = ["Getting started", "Supported inputs", "Hooks", "CLI and API", "Reliability", "Internals"]
    assert [g for g in groups if g in order] == order, groups
    pages = list(_nav_pages(nav))
    assert len(pages) == len(set(pages)), "a page is in the nav twice"
    on_disk = {str(p.relative_to(REPO / "docs")) for p in (REPO / "docs").rglob("*.md")}
    assert on_disk - set(pages) <= {"gpu.md"}, on_disk - set(pages)  # gpu.md: its nav line is its author's
    getting_started = list(_nav_pages(next(i for i in nav if "Getting started" in i)))
    assert getting_started[:2] == ["install.md", "getting-started.md"]
    assert "inputs.md" in list(_nav_pages(next(i for i in nav if "Supported inputs" in i)))
    internals = list(_nav_pages(next(i for i in nav if "Internals" in i)))
    seeds = sorted(p.stem[:3] for p in (REPO / "docs" / "seeds").glob("*.md"))
    assert seeds == ["000", "001", "003", "004"] and all(f"seeds/{s}" in " ".join(internals) for s in seeds)


def test_api_reference_documents_every_exported_name():
    page = (REPO / "docs" / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: [\w.]+\.(\w+)$", page, re.M))
    exported = set(hf_ckpt_integrations.__all__) - {"__version__"}
    errors = {"CheckpointError", "UnsafeCheckpointError", "LayoutError", "DestinationError"}
    assert "::: hf_ckpt_integrations.errors" in page  # the error classes, with their module
    assert exported - errors <= documented, exported - errors - documented


def test_package_sources_compile_without_warnings():
    """An invalid escape in a docstring is a SyntaxWarning today and an error in a later Python."""
    import warnings

    for path in sorted((REPO / "hf_ckpt_integrations").rglob("*.py")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compile(path.read_text(), str(path), "exec")


def test_supported_inputs_page_is_generated_from_the_table():
    import importlib.util

    from hf_ckpt_integrations.supported_inputs import markdown_table

    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    class Page:
        class file:
            src_uri = "inputs.md"

    out = hooks.on_page_markdown((REPO / "docs" / "inputs.md").read_text(), Page, None, None)
    assert markdown_table("") in out and "(fsdp.md)" in out


OFFLINE = re.compile(r"out/checkpoint-500|ds_save_dir")


def _offline_blocks(lang):
    """Samples of the offline API/CLI: runnable against a real checkpoint laid out at their paths."""
    return [(p, code) for p, code in _blocks(lang) if OFFLINE.search(code)]


@pytest.fixture
def sample_tree(engine_ckpt, tmp_path):
    """The paths the samples name, holding real checkpoints from the engine matrix."""
    import shutil

    trainer, z2 = engine_ckpt("trainer-z3"), engine_ckpt("z2-fp32")
    shutil.copytree(trainer / "run" / "checkpoint-4", tmp_path / "out" / "checkpoint-500")
    shutil.copytree(z2 / "ckpt", tmp_path / "ds_save_dir")
    shutil.copytree(z2 / "config", tmp_path / "path" / "to" / "config_dir")
    return tmp_path


@pytest.mark.engine
@pytest.mark.parametrize("page,code", _offline_blocks("bash"))
def test_offline_cli_samples_run(page, code, sample_tree):
    import subprocess
    import sys

    for line in code.splitlines():
        line = line.split("#")[0].strip()
        if not line.startswith("hf-ckpt "):
            continue
        r = subprocess.run([sys.executable, "-m", "hf_ckpt_integrations", *shlex.split(line)[1:]],
                           cwd=sample_tree, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{page}: `{line}` exited {r.returncode}: {r.stderr}"


@pytest.mark.engine
@pytest.mark.parametrize("page,code", _offline_blocks("python"))
def test_offline_python_samples_run(page, code, sample_tree, monkeypatch):
    monkeypatch.chdir(sample_tree)
    exec(compile(code, page, "exec"), {"__name__": "__sample__"})
    assert (sample_tree / "out" / "hf" / "config.json").exists()
