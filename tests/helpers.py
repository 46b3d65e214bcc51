"""Small helpers shared by the tests (no engine imports)."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def hf_ckpt(*args, env=None, timeout=300, cwd=REPO):
    """Run the CLI in a fresh process (stdin closed: it must never prompt); return CompletedProcess (text)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "hf_ckpt_integrations", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": path, **(env or {})})


def leftovers(parent):
    """Names of ``.hfckpt-`` temp or lock entries in ``parent`` (none may survive an export)."""
    return sorted(p.name for p in Path(parent).iterdir() if ".hfckpt-" in p.name)


def assert_refused(r, *, match=None, dst=None, src=None, digest=None, code=2):
    """The CLI refused cleanly: exit ``code``, exactly one stderr line and it starts ``error: ``
    (contains ``match``: a string, or each of a tuple of strings), no traceback; ``dst`` absent
    with no temp or lock sibling; ``src`` unchanged (``tree_digest`` equal to ``digest``). Returns
    the error line. The one copy of the refusal contract (DESIGN.md, exit 2)."""
    lines = r.stderr.splitlines()
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    for m in (match,) if isinstance(match, str) else match or ():
        assert m in lines[0], lines[0]
    if dst is not None:
        assert not os.path.lexists(dst), dst
        assert leftovers(Path(dst).parent) == []
    if src is not None:
        assert tree_digest(src) == digest
    return lines[0]


def export_refused(src, dst, *args, match=None, run=hf_ckpt):
    """``export SRC DST ARGS`` (through ``run``, the CLI in a fresh process by default) is refused
    cleanly (:func:`assert_refused`): nothing at ``dst``, ``src`` unchanged. Returns the error line."""
    before = tree_digest(src)
    return assert_refused(run("export", src, dst, *args), match=match, dst=dst, src=src, digest=before)


def in_process(capsys=None):
    """A ``run`` for :func:`export` and :func:`export_refused`: the CLI's ``main()`` in this process (no
    interpreter start: tenths of a second where a fresh process takes seconds). With ``capsys`` its
    output is captured into the result; returns a CompletedProcess either way, as :func:`hf_ckpt`."""
    def run(*args):
        from hf_ckpt_integrations.cli import main

        argv = [str(a) for a in args]
        if capsys is not None:
            capsys.readouterr()
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's refusals exit as a fresh process would
            rc = e.code if isinstance(e.code, int) else 2
        out = capsys.readouterr() if capsys is not None else None
        return subprocess.CompletedProcess(argv, rc, out.out if out else "", out.err if out else "")
    return run


def export(src, dst, *args, config=None, ok=True, run=hf_ckpt):
    """``hf-ckpt export SRC DST [--config CONFIG] ARGS`` through ``run`` (a fresh process by default;
    :func:`in_process` for a fast one). ``src`` must be byte for byte unchanged after it, whatever the
    exit; with ``ok`` the exit must be 0. Returns the CompletedProcess. The one export helper of the
    tests (:func:`export_refused` is its refusal side; :func:`read_export` reads what it wrote)."""
    before = tree_digest(src)
    r = run("export", src, dst, *(("--config", config) if config is not None else ()), *args)
    assert tree_digest(src) == before, f"export changed its source {src}"
    if ok:
        assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    return r


def read_export(directory):
    """``{name: tensor}`` of every ``*.safetensors`` file in ``directory`` (an export, sharded or not)."""
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_safetensors(f))
    return out


def tree_digest(path) -> str:
    """Hash of every file's relative path, mode and bytes under ``path``, or of the file ``path``
    (the source-unchanged check)."""
    h = hashlib.sha256()
    if Path(path).is_file():
        h.update(Path(path).read_bytes())
    for p in sorted(Path(path).rglob("*")):
        h.update(str(p.relative_to(path)).encode())
        if p.is_file():
            h.update(str(p.stat().st_mode).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def load_safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def load_hf_state(directory, dtype):
    """``from_pretrained(directory)``'s state dict, asserting no missing/unexpected/mismatched keys."""
    import transformers
    from transformers import AutoModelForCausalLM

    # transformers 5 calls it ``dtype``; 4.51 (the ColossalAI line, .venv-cai) ``torch_dtype``.
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model, info = AutoModelForCausalLM.from_pretrained(directory, **{key: dtype}, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.state_dict()


def assert_bitwise_equal(state, reference):
    """Every tensor of ``reference`` is in ``state`` with the same dtype and the same bits."""
    import torch

    assert set(reference) <= set(state), sorted(set(reference) - set(state))
    for name, want in reference.items():
        assert state[name].dtype == want.dtype and torch.equal(state[name], want), name


def tampered_copy(src, tmp_path, file=None, change=None, *, edit=None, weights_only=True, name="ckpt"):
    """A copy of the (cached, shared) checkpoint directory ``src`` at ``tmp_path/name``, where the
    file ``file`` (relative) holds ``change(state)`` of what it held, or its state after
    ``edit(state)`` changed it in place. The cached original is never touched. Returns the copy."""
    import shutil

    dst = Path(tmp_path) / name
    shutil.copytree(src, dst)
    if file is not None:
        import torch

        path = dst / file
        state = torch.load(path, weights_only=weights_only)
        if edit is not None:
            edit(state)
        torch.save(state if change is None else change(state), path)
    return dst
