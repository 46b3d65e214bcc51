"""The notebooks under ``notebooks/``: committed without outputs, and each runs top to bottom.

Every notebook names its environment in its metadata (``{"hf_ckpt": {"venv": ".venv"}}`` or
``".venv-cai"``). It is executed with nbclient by *that* venv's python (a subprocess), with a
kernel from that venv: a kernelspec written into a temporary ``JUPYTER_PATH`` whose ``argv`` is
the venv's python, checked from inside the kernel (``sys.prefix``). The working directory is a
temporary directory; a cell error or a cell running past ``CELL_TIMEOUT_S`` fails the test.
The ``.venv-cai`` notebook is skipped only when ``.venv-cai`` does not exist.

The notebooks run two at a time (each launches 2-process ``torchrun`` jobs) in one module-scoped
fixture, so the whole module takes about 2-4 minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import refuse_engine_launch

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
VENVS = (".venv", ".venv-cai")
CELL_TIMEOUT_S = 300
NOTEBOOK_TIMEOUT_S = 900
PARALLEL = 2

# Runs inside the notebook's venv: argv = notebook, workdir, kernel name, result json.
_RUNNER = r'''
import json, sys, time
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

path, workdir, kernel, result, cell_timeout = sys.argv[1:6]
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
json.dump(out, open(result, "w"))
'''


def _venv_of(nb_path: Path) -> str:
    return json.loads(nb_path.read_text())["metadata"]["hf_ckpt"]["venv"]


def _run_notebook(nb_path: Path, tmp: Path) -> dict:
    refuse_engine_launch(f"notebook {nb_path.name}")  # each notebook launches torchrun jobs
    venv = REPO / _venv_of(nb_path)
    python = venv / "bin" / "python"
    kernel = f"hfckpt-{venv.name.lstrip('.')}"
    spec_dir = tmp / "jupyter" / "kernels" / kernel
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"hf_ckpt {venv.name}", "language": "python"}))
    work = tmp / "cwd"
    work.mkdir(parents=True)
    result = tmp / f"{nb_path.stem}.result.json"
    env = dict(os.environ, JUPYTER_PATH=str(tmp / "jupyter"), IPYTHONDIR=str(tmp / "ipython"),
               PYTHONUNBUFFERED="1")
    env.pop("VIRTUAL_ENV", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([str(python), "-c", _RUNNER, str(nb_path), str(work), kernel, str(result),
                               str(CELL_TIMEOUT_S)], cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=NOTEBOOK_TIMEOUT_S)
        log = proc.stdout
    except subprocess.TimeoutExpired as e:
        return {"ok": False, "error": f"notebook timed out after {NOTEBOOK_TIMEOUT_S} s", "log": str(e.output)[-3000:]}
    out = json.loads(result.read_text()) if result.is_file() else {"ok": False, "error": "runner wrote no result"}
    out["log"] = log[-3000:]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["venv"] = str(venv)
    return out


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """{notebook name: result}; runnable notebooks executed PARALLEL at a time."""
    todo = [nb for nb in NOTEBOOKS if (REPO / _venv_of(nb) / "bin" / "python").is_file()]
    root = tmp_path_factory.mktemp("notebooks")
    with ThreadPoolExecutor(PARALLEL) as pool:
        futures = {nb.name: pool.submit(_run_notebook, nb, root / nb.stem) for nb in todo}
        return {name: f.result() for name, f in futures.items()}


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"trainer_deepspeed.ipynb", "accelerate_save_model.ipynb",
                                          "colossalai_padded_vocab.ipynb", "doctor.ipynb"}


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(nb_path):
    """Outputs are stripped in git: no outputs, no execution counts (re-strip before committing)."""
    nb = json.loads(nb_path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{nb_path.name}: code cells {dirty} have outputs or execution counts; "
                       f"strip them (e.g. `jupyter nbconvert --clear-output --inplace {nb_path.relative_to(REPO)}`)")
    assert _venv_of(nb_path) in VENVS, f"{nb_path.name}: metadata.hf_ckpt.venv must be one of {VENVS}"


@pytest.mark.engine
@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(nb_path, executed):
    venv = _venv_of(nb_path)
    if not (REPO / venv / "bin" / "python").is_file():
        if venv == ".venv-cai":
            pytest.skip(f"{venv} does not exist (build it with `make setup`); {nb_path.name} runs only there")
        pytest.fail(f"{venv} does not exist: run `make setup`")
    r = executed[nb_path.name]
    assert r["ok"], f"{nb_path.name} failed in {venv}:\n{r.get('error')}\n--- runner log ---\n{r.get('log')}"
    prefix = r["prefix"].removeprefix("HFCKPT_PREFIX=")
    assert Path(prefix).resolve() == (REPO / venv).resolve(), f"kernel ran {prefix}, not {venv}"
    print(f"{nb_path.name}: {r['seconds']} s in {venv}")
