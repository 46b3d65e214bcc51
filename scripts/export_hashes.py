"""Hash what every cached engine case and committed fixture exports to, before and after a refactor.

    .venv/bin/python scripts/export_hashes.py OUT.json [CACHE_DIR]

For each case directory under CACHE_DIR (default ``$HFCKPT_TEST_CACHE`` or ``.test-cache``:
``engines/<key>/<case>/``) and each committed fixture, every directory up to two levels down is
exported twice (as stored, and ``dtype="bf16"``) with ``weights_only=True``; the JSON maps
``<case>/<relative dir>[#bf16]`` to ``{file: sha256}`` or to the first line of the error. Diff two
such files (``diff <(jq -S . a.json) <(jq -S . b.json)``): a refactor that must keep exports
byte-identical shows nothing. Keys are case names, not cache keys (a save-time hook case's key
changes with the package's code).
"""

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

from hf_ckpt_integrations import api

REPO = Path(__file__).resolve().parents[1]


def _digest(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


def _candidates(root: Path):
    yield root
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        yield child
        for grand in sorted(p for p in child.iterdir() if p.is_dir()):
            yield grand


def main() -> None:
    out = Path(sys.argv[1])
    cache = Path(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("HFCKPT_TEST_CACHE", REPO / ".test-cache"))
    roots = {}
    for key in sorted((cache / "engines").glob("*/*")):
        if key.is_dir() and (key / "DONE").exists():
            roots[key.name] = key
    for run in sorted((REPO / "tests" / "fixtures" / "deepspeed").glob("*/*")):
        if run.is_dir():
            roots[f"fixture-{run.parent.name}-{run.name}"] = run
    result = {}
    for name, root in sorted(roots.items()):
        for cand in _candidates(root):
            for dtype in (None, "bf16"):
                key = f"{name}/{cand.relative_to(root)}" + ("#bf16" if dtype else "")
                with tempfile.TemporaryDirectory() as tmp:
                    dst = Path(tmp) / "out"
                    try:
                        api.export_checkpoint(str(cand), str(dst), dtype=dtype, weights_only=True)
                        result[key] = _digest(dst)
                    except Exception as e:  # the refusal's text is part of the behaviour too
                        result[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(name, file=sys.stderr)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"{len(result)} exports hashed -> {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
