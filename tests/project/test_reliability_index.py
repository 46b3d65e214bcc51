"""docs/reliability.md's index stays true: every promise heading has a row naming its tests, and every
test file, or ``file.py::test``, the page names exists (a renamed or deleted test breaks the page)."""

import re

from helpers import REPO

PAGE = REPO / "docs" / "reliability.md"
INDEX = "Index: each promise and its tests"
# Headings that promise nothing (what is out of reach), and the index itself.
NOT_PROMISES = {"What remains undetectable", "What it does not guarantee", INDEX}


def _index_rows(text):
    """``{promise: [test paths]}`` of the index table."""
    section = text.split(f"## {INDEX}", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 2 and cells[0] not in ("Promise", "---"):
            rows[cells[0]] = re.findall(r"`(tests/[^`]+)`", cells[1])
    return rows


def _test_files():
    return {p.name: p for p in (REPO / "tests").rglob("test_*.py")}


def test_every_promise_heading_has_tests_in_the_index():
    text = PAGE.read_text()
    headings = [h.strip() for h in re.findall(r"^#{2,3} (.+)$", text, re.M)]
    rows = _index_rows(text)
    missing = [h for h in headings if h not in NOT_PROMISES and not rows.get(h)]
    assert not missing, f"promise headings with no row (or no tests) in the index of {PAGE.name}: {missing}"
    stale = sorted(set(rows) - set(headings))
    assert not stale, f"index rows naming no heading of {PAGE.name}: {stale}"


def test_every_test_the_page_names_exists():
    text = PAGE.read_text()
    files = _test_files()
    absent = []
    for path in re.findall(r"(tests/[\w/]+\.py)", text):
        if not (REPO / path).is_file():
            absent.append(path)
    for name, func in re.findall(r"\b(test_\w+\.py)::(test_\w+)", text):
        if name not in files:
            absent.append(name)
        elif not re.search(rf"^def {func}\(", files[name].read_text(), re.M):
            absent.append(f"{name}::{func}")
    assert not absent, f"{PAGE.name} names tests that do not exist: {sorted(set(absent))}"
