"""The package's import graph: no import loops among its modules, no module importing the package
root (the front door sits above everything it exports). Read from the source (milliseconds): every
import counts, including those inside functions, since a lazy import only hides a loop."""

import ast
from pathlib import Path
from helpers import REPO

PKG = REPO / "hf_ckpt_integrations"
ROOT = PKG.name


def _modules(pkg: Path) -> dict:
    """Dotted module name -> path, for every module of the package (``a.b`` for ``a/b/__init__.py``)."""
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = (pkg.name,) + path.relative_to(pkg).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(pkg: Path = PKG) -> dict:
    """Module -> the package modules it imports (a name imported from a package counts as its
    submodule when there is one, else as the package itself)."""
    modules = _modules(pkg)
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.split(".")[0] == pkg.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != pkg.name:
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in modules else target)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict) -> list:
    """The import loops of ``graph``: its strongly connected components of more than one module
    (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_loops():
    loops = cycles(import_graph())
    assert not loops, f"modules importing each other (move the shared piece down a layer): {loops}"


def test_no_module_imports_the_package_root():
    graph = import_graph()
    upward = sorted(name for name, edges in graph.items() if ROOT in edges)
    assert not upward, f"modules importing the package root {ROOT} (import the leaf module instead): {upward}"


# The stages after planning: a source (at any depth under sources/) reads files only.
LATER = ("writer", "export", "orchestrator", "commit", "_staging", "_merge_commit", "verify", "lean", "parallel",
         "integrations", "cli", "api")


def test_sources_import_no_later_stage():
    graph = import_graph()
    later = {f"{ROOT}.{m}" for m in LATER}
    bad = sorted((name, sorted(e for e in edges if e in later or e.startswith(f"{ROOT}.integrations.")))
                 for name, edges in graph.items() if name.startswith(f"{ROOT}.sources"))
    bad = [b for b in bad if b[1]]
    assert not bad, f"sources importing a later stage: {bad}"


MAX_LINES = 500  # a module past this holds several jobs: split it by job (the old module may re-export)


def test_no_module_holds_several_jobs_by_size():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules(PKG).items()}
    big = sorted((n, lines) for n, lines in sizes.items() if lines > MAX_LINES)
    assert not big, f"modules over {MAX_LINES} lines (split each by job): {big}"


def test_the_checks_find_what_they_look_for(tmp_path):
    """On a toy package: a loop through a lazy import and an import of the root are both found."""
    pkg = tmp_path / "toy"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n__version__ = '1'\n")
    (pkg / "a.py").write_text("from .b import g\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import __version__\nfrom .. import b\n")
    graph = import_graph(pkg)
    assert graph["toy.sub.c"] == {"toy", "toy.b"}
    assert cycles(graph) == [["toy.a", "toy.b"]]
