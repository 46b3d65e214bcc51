"""Run the notebooks headless, each in the venv its metadata names, keeping their outputs.

    .venv/bin/python scripts/run_notebooks.py [NAME.ipynb ...]      # or: make notebooks

Each notebook is executed with nbclient by its venv's python, with a kernel from that venv (a
kernelspec in a temporary ``JUPYTER_PATH``; ``sys.prefix`` is checked from inside the kernel). The
executed copy, outputs included, is written to ``build/notebooks/NAME.ipynb``, and the notebook's
working directory (its ``nb_*`` folder of checkpoints) is ``build/notebooks/work/NAME/``: both
ignored by git, so the committed notebooks (kept without outputs) and the tree stay clean. The
checkout's package is imported (``PYTHONPATH``), not whichever one the venv installed.
tests/project/test_notebooks.py runs the same :func:`run_notebook` in a temporary directory.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "build" / "notebooks"
CELL_TIMEOUT_S = 300
NOTEBOOK_TIMEOUT_S = 900

# Runs inside the notebook's venv: argv = notebook, workdir, kernel name, result json, cell timeout, output path.
_RUNNER = r'''
import json, sys, time
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

path, workdir, kernel, result, cell_timeout, out_path = sys.argv[1:7]
nb = nbformat.read(path, as_version=4)
probe = nbformat.v4.new_code_cell("import sys; print('HFCKPT_PREFIX=' + sys.prefix)")
probe["id"] = "hfckpt-prefix-probe"
nb.cells.insert(0, probe)
t0 = time.perf_counter()
out = {"ok": False}
try:
    NotebookClient(nb, timeout=int(cell_timeout), kernel_name=kernel, allow_errors=False,
                   resources={"metadata": {"path": workdir}}).execute()
    out["ok"] = True
except CellExecutionError as e:
    out["error"] = str(e)[-4000:]
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"[-4000:]
out["seconds"] = round(time.perf_counter() - t0, 1)
out["prefix"] = "".join(o.get("text", "") for o in nb.cells[0].get("outputs", [])).strip()
if out_path:
    del nb.cells[0]  # the probe is the runner's, not the notebook's
    nbformat.write(nb, out_path)
json.dump(out, open(result, "w"))
'''


def venv_of(nb_path: Path) -> str:
    """The venv a notebook names in its metadata (``{"hf_ckpt": {"venv": ".venv"}}``)."""
    return json.loads(Path(nb_path).read_text())["metadata"]["hf_ckpt"]["venv"]


def run_notebook(nb_path: Path, tmp: Path, *, workdir: Path = None, out_path: Path = None,
                 cell_timeout_s: int = CELL_TIMEOUT_S, env_extra=None) -> dict:
    """Execute ``nb_path`` in its venv (kernelspec and scratch files under ``tmp``, the notebook's
    working directory ``workdir``, default ``tmp/cwd``); with ``out_path`` write the executed notebook
    there. Returns ``{"ok", "error", "seconds", "prefix", "log", "wall_s", "venv"}``."""
    venv = REPO / venv_of(nb_path)
    python = venv / "bin" / "python"
    kernel = f"hfckpt-{venv.name.lstrip('.')}"
    spec_dir = tmp / "jupyter" / "kernels" / kernel
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"hf_ckpt {venv.name}", "language": "python"}))
    work = workdir or tmp / "cwd"
    work.mkdir(parents=True, exist_ok=True)
    result = tmp / f"{nb_path.stem}.result.json"
    env = dict(os.environ, JUPYTER_PATH=str(tmp / "jupyter"), IPYTHONDIR=str(tmp / "ipython"),
               PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.pop("VIRTUAL_ENV", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([str(python), "-c", _RUNNER, str(nb_path), str(work), kernel, str(result),
                               str(cell_timeout_s), str(out_path or "")], cwd=work, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=NOTEBOOK_TIMEOUT_S)
        log = proc.stdout
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "error": f"notebook timed out after {NOTEBOOK_TIMEOUT_S} s", "log": str(e.output)[-3000:]}
    out = json.loads(result.read_text()) if result.is_file() else {"ok": False, "error": "runner wrote no result"}
    out["log"] = log[-3000:]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["venv"] = str(venv)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebook names or paths (default: every notebooks/*.ipynb)")
    parser.add_argument("--cell-timeout", type=int, default=CELL_TIMEOUT_S, metavar="S",
                        help=f"seconds a cell may run (default {CELL_TIMEOUT_S}; more on a loaded machine)")
    args = parser.parse_args(argv)
    paths = [Path(n) if Path(n).is_file() else REPO / "notebooks" / Path(n).name for n in args.notebooks] or \
        sorted((REPO / "notebooks").glob("*.ipynb"))
    OUT.mkdir(parents=True, exist_ok=True)
    failed = 0
    for nb in paths:
        if not (REPO / venv_of(nb) / "bin" / "python").is_file():
            print(f"skip  {nb.name}: {venv_of(nb)} does not exist (make setup)", flush=True)
            continue
        print(f"run   {nb.name} in {venv_of(nb)} ...", flush=True)
        work = OUT / "work" / nb.stem
        shutil.rmtree(work, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="hfckpt-nb-") as tmp:
            r = run_notebook(nb, Path(tmp), workdir=work, out_path=OUT / nb.name, cell_timeout_s=args.cell_timeout,
                             env_extra={"PYTHONPATH": os.pathsep.join(
                                 p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)})
        if r["ok"]:
            print(f"ok    {nb.name}: {r['seconds']} s -> {(OUT / nb.name).relative_to(REPO)}", flush=True)
        else:
            failed += 1
            print(f"FAIL  {nb.name}: {r.get('error')}\n{r.get('log', '')}\n(partial outputs in "
                  f"{(OUT / nb.name).relative_to(REPO)})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
