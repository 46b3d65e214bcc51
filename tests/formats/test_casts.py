"""The torch-free casts (hf_ckpt_integrations/casts.py) against torch's own ``Tensor.to``, bit for bit."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hf_ckpt_integrations.casts import can_cast, cast_array, iter_cast
from hf_ckpt_integrations.plan import Piece
from helpers import REPO

TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
INT = {"F32": (np.uint32, torch.int32), "BF16": (np.uint16, torch.int16), "F16": (np.uint16, torch.int16)}


def torch_cast(bits: np.ndarray, src: str, dst: str) -> np.ndarray:
    """torch's ``.to(dst)`` of the ``src`` values whose raw bits are ``bits``, as raw bits."""
    t = torch.from_numpy(bits.view(np.int32 if bits.dtype == np.uint32 else np.int16).copy())
    out = t.view(TORCH[src]).to(TORCH[dst]).view(INT[dst][1]).numpy()
    return out.view(INT[dst][0])


def edge_fp32_patterns() -> np.ndarray:
    """Every exponent, both signs, and mantissas at every rounding edge of bf16 (16 dropped bits) and
    of fp16 (13 dropped bits, more in its subnormal range): exact halves with an odd and an even kept
    bit, one below and one above, carries into the exponent; plus every NaN class (quiet,
    signalling, payloads) and the infinities."""
    mant = {0, 1, 0x7FFFFF, 0x400000, 0x3FFFFF, 0x400001, 0x200000, 0x1FFFFF}
    for k in range(23):
        for m in (1 << k, (1 << k) - 1, (1 << k) + 1, 3 << k, (3 << k) - 1, (3 << k) + 1, 0x7FFFFF ^ ((1 << k) - 1)):
            mant.add(m & 0x7FFFFF)
    mant = np.array(sorted(mant), dtype=np.uint32)
    exps = np.arange(256, dtype=np.uint32) << 23
    body = (exps[:, None] | mant[None, :]).ravel()
    return np.concatenate([body, body | 0x80000000])


def test_edge_patterns_cover_the_classes():
    u = edge_fp32_patterns()
    f = u.view(np.float32)
    assert np.isnan(f).sum() > 100 and np.isinf(f).sum() == 2
    assert ((u & 0x7F800000) == 0).sum() > 100  # fp32 subnormals
    assert ((u & 0xFFFF) == 0x8000).sum() > 500  # bf16 ties


@pytest.mark.parametrize("dst", ["BF16", "F16"])
def test_fp32_edge_patterns_match_torch(dst):
    u = edge_fp32_patterns()
    got, want = cast_array("F32", dst, u), torch_cast(u, "F32", dst)
    bad = np.nonzero(got != want)[0]
    assert not len(bad), [(hex(u[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("dst", ["BF16", "F16"])
def test_fp32_random_bits_match_torch(dst):
    u = np.random.default_rng(18).integers(0, 2**32, size=4_000_000, dtype=np.uint64).astype(np.uint32)
    got, want = cast_array("F32", dst, u), torch_cast(u, "F32", dst)
    bad = np.nonzero(got != want)[0]
    assert not len(bad), [(hex(u[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("src,dst", [("BF16", "F32"), ("F16", "F32"), ("BF16", "F16"), ("F16", "BF16")])
def test_every_16_bit_pattern_matches_torch(src, dst):
    h = np.arange(65536, dtype=np.uint16)
    got, want = cast_array(src, dst, h), torch_cast(h, src, dst)
    bad = np.nonzero(got != want)[0]
    assert not len(bad), [(hex(h[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def test_nan_stays_nan_and_inf_stays_inf():
    u = edge_fp32_patterns()
    f = u.view(np.float32)
    for dst in ("BF16", "F16"):
        out = cast_array("F32", dst, u)
        wide = cast_array(dst, "F32", out).view(np.float32)
        assert np.array_equal(np.isnan(wide), np.isnan(f))
        assert np.array_equal(wide[np.isinf(f)], f[np.isinf(f)])  # finite values may round up to inf
    big = np.array([65520.0, -65520.0, 65519.99], dtype=np.float32).view(np.uint32)  # fp16 overflow edge
    assert cast_array("F32", "F16", big).view(np.float16).tolist() == [np.inf, -np.inf, 65504.0]


def test_pairs():
    assert can_cast("F32", "BF16") and can_cast("F16", "F32") and can_cast("BF16", "F16")
    assert not can_cast("F64", "BF16") and not can_cast("F32", "F32") and not can_cast("I64", "F32")


class _Owner:
    pass


def test_iter_cast_reads_pieces_across_files_and_chunks(tmp_path):
    """Pieces at odd offsets in two files, chunks smaller than a piece: the bytes equal torch's cast of
    the pieces laid end to end, and each chunk is handed over before its buffer is reused."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal(5000).astype(np.float32)
    b = rng.standard_normal(3001).astype(np.float32)
    pa, pb = tmp_path / "a.bin", tmp_path / "b.bin"
    pa.write_bytes(b"x" * 12 + a.tobytes() + b"tail")
    pb.write_bytes(b"y" * 4 + b.tobytes())
    pieces = [Piece(str(pa), 12 + 4 * 100, 4000, "F32"), Piece(str(pb), 4, 0, "F32"), Piece(str(pb), 4, 3001, "F32")]
    flat = np.concatenate([a[100:4100], b]).view(np.uint32)
    for dst in ("BF16", "F16"):
        got = b"".join(bytes(c) for c in iter_cast(pieces, dst, _Owner(), chunk=777))
        assert got == torch_cast(flat, "F32", dst).tobytes()
    short = [Piece(str(pb), 4, 3002, "F32")]
    with pytest.raises(Exception, match="b.bin: ends before byte"):
        list(iter_cast(short, "BF16", _Owner()))


def _synthetic_zero3(tmp_path):
    """A small synthetic fp32 ZeRO-3 save (benchmarks/synth_ckpt.py) with its config.json and masters."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from synth_ckpt import make_checkpoint
    finally:
        sys.path.pop(0)
    src = tmp_path / "ckpt"
    make_checkpoint(src, stage=3, dp=3, layers=2, hidden=16, vocab=50, reference=True)
    return src


def test_bf16_export_of_fp32_masters_never_imports_torch(tmp_path):
    """The data path: the CLI's bf16 export of a byte-copyable fp32 checkpoint runs without torch in
    the process, and its bytes are torch's cast of the masters. (Without a config.json: with one, on
    transformers 5 the *planning* imports transformers to derive the Hub layout — see
    test_bf16_export_with_a_config_plans_with_transformers below and docs/performance.md.)"""
    src = _synthetic_zero3(tmp_path)
    (tmp_path / "away").mkdir()  # not beside the checkpoint nor in its parent, where export looks
    os.rename(src / "config.json", tmp_path / "away" / "config.json")
    out = tmp_path / "hf"
    code = ("import sys; from hf_ckpt_integrations.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH', 'torch' in sys.modules, 'numpy' in sys.modules); sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code, "export", str(src), str(out), "--dtype", "bf16", "--quiet",
                          "--weights-only"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "TORCH False True" in run.stdout
    # The fp32 byte copy and inspect need neither (numpy is half of the CLI's start-up time).
    for args in (["inspect", str(src)], ["export", str(src), str(tmp_path / "hf32"), "--quiet", "--weights-only"]):
        run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=REPO,
                             timeout=300)
        assert run.returncode == 0 and "TORCH False False" in run.stdout, (args, run.stdout[-500:], run.stderr)
    from safetensors.torch import load_file

    got = load_file(str(out / "model.safetensors"))
    masters = torch.load(src / "reference_fp32.pt")
    assert set(got) == set(masters)
    for name, t in masters.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name].view(torch.int16), t.to(torch.bfloat16).view(torch.int16)), name


def test_bf16_export_with_a_config_plans_with_transformers(tmp_path):
    """With a config.json the plan asks transformers for the Hub layout (identity for Llama); the
    bytes are the same as the torch-free data path's."""
    src = _synthetic_zero3(tmp_path)
    outs = []
    for i, config in enumerate((True, False)):
        if not config:
            (tmp_path / "away").mkdir()
            os.rename(src / "config.json", tmp_path / "away" / "config.json")
        outs.append(tmp_path / f"hf{i}")
        run = subprocess.run([sys.executable, "-m", "hf_ckpt_integrations", "export", str(src), str(outs[-1]),
                              "--dtype", "bf16", "--quiet"] + ([] if config else ["--weights-only"]),
                             capture_output=True, text=True, cwd=REPO, timeout=300)
        assert run.returncode == 0, run.stderr
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()
    assert (outs[0] / "config.json").exists() and not (outs[1] / "config.json").exists()
