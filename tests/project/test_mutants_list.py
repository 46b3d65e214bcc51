"""tests/mutants.toml stays applicable (milliseconds): every entry's quoted line occurs exactly once in
its file, its test paths exist, and its mutation compiles. ``make mutants`` finds a stale entry only when
someone runs it (tens of minutes); a renamed module or an edited guard line is caught here instead."""

import importlib.util
import sys

import pytest

from helpers import REPO

_spec = importlib.util.spec_from_file_location("mutants_script", REPO / "scripts" / "mutants.py")
mutants = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("mutants_script", mutants)
_spec.loader.exec_module(mutants)
ENTRIES = mutants.load()


@pytest.mark.parametrize("m", ENTRIES, ids=[f"{i}:{m['file'].rsplit('/', 1)[-1]}" for i, m in enumerate(ENTRIES)])
def test_entry_applies_and_names_real_tests(m):
    path = REPO / m["file"]
    assert path.is_file(), f"tests/mutants.toml names {m['file']}, which does not exist (moved? update the entry)"
    mutated = mutants.apply(path.read_text(), m)  # raises when the line is not there exactly once
    compile(mutated, str(path), "exec")
    for t in m["tests"]:
        assert (REPO / t.split("::")[0]).exists(), f"{m['file']}: its test {t} does not exist"


def test_a_stale_entry_is_caught():
    with pytest.raises(ValueError, match="occurs 0 times"):
        mutants.apply("x = 1\n", {"file": "f.py", "line": "y = 2", "replace": "y = 3"})
