"""Draw ``docs/disk.png`` from the ``disk-bench`` table of ``docs/performance.md``.

``disk_bench.py --doc`` draws the plot from its results cache (``.bench-cache/disk-results.json``),
which lives on the machine that measured; rows added by hand from a later run on another machine
(the 20 GB DCP, per-rank and universal rows of 2026-12-06) are only in the table. This draws the
same two panels (cold-cache GB/s written, peak RSS, against the checkpoint's size) from the table
itself, so the plot shows every row the docs report. Rows of an extra configuration (``1GB
shards``) and superseded ones (``(before the fix below)``) stay in the table only. Usage: ``python benchmarks/plot_disk_table.py``.
"""

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "performance.md"
START, END = "<!-- disk-bench:start -->", "<!-- disk-bench:end -->"


def rows(text: str):
    """``(source, size GB, tool, cold GB/s, peak RSS MB)`` of each measured row of the table."""
    block = text[text.index(START):text.index(END)]
    extra = False  # inside an extra configuration's rows (its copy row follows its tool rows)
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not re.match(r"^[\d.]+ GB$", cells[1]):
            continue
        # an extra configuration ("1GB shards") or a superseded measurement ("(before ...)"), and its copy row
        superseded = "shards" in cells[3] or "(before" in cells[3]
        if superseded or (extra and cells[3].startswith("`cp -r`")):
            extra = superseded
            continue
        extra = False
        tool = "cp (same bytes)" if cells[3].startswith("`cp -r`") else re.sub(r"\s*\(.*\)$", "", cells[3])
        yield cells[0], float(cells[1].split()[0]), tool, float(cells[6]), float(cells[9].split()[0].replace(",", ""))


def main() -> int:
    from disk_bench import PLOT, draw  # (benchmarks/ is this script's directory: on sys.path)

    series = {}
    for source, gb, tool, gbps, rss in rows(DOC.read_text()):
        series.setdefault((tool.startswith("cp "), f"{source}: {tool}"), []).append((gb, gbps, rss))
    draw(series)
    print(f"{PLOT}: {sum(len(v) for v in series.values())} points in {len(series)} series")
    return 0


if __name__ == "__main__":
    sys.exit(main())
