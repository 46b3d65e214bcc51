"""The notebooks under ``notebooks/``: committed without outputs, and each runs top to bottom.

Every notebook names its environment in its metadata (``{"hf_ckpt": {"venv": ".venv"}}`` or
``".venv-cai"``). It is executed with nbclient by *that* venv's python (a subprocess), with a
kernel from that venv: a kernelspec written into a temporary ``JUPYTER_PATH`` whose ``argv`` is
the venv's python, checked from inside the kernel (``sys.prefix``). The working directory is a
temporary directory; a cell error or a cell running past 300 s fails the test. The runner is
scripts/run_notebooks.py's, which ``make notebooks`` uses to keep the outputs (build/notebooks/).
The ``.venv-cai`` notebook is skipped only when ``.venv-cai`` does not exist.

The notebooks run two at a time (each launches 2-process ``torchrun`` jobs) in one module-scoped
fixture, so the whole module takes about 2-4 minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import refuse_engine_launch
from helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
from run_notebooks import run_notebook, venv_of as _venv_of  # noqa: E402  (make notebooks runs the same)

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
VENVS = (".venv", ".venv-cai")
PARALLEL = 2


def _run_notebook(nb_path: Path, tmp: Path) -> dict:
    refuse_engine_launch(f"notebook {nb_path.name}")  # each notebook launches torchrun jobs
    return run_notebook(nb_path, tmp)


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
