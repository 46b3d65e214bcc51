"""Floating-point casts between F32, BF16 and F16 from file byte ranges, without torch.

A cast is a pure function of the bits, so the export's hot cast (``--dtype bf16`` from fp32
masters) reads each piece with ``os.preadv`` into one reused buffer, converts it with numpy
bit operations and yields the result: memory stays at a few chunk-sized buffers (~5 MB),
nothing is mapped, and torch is never imported.

Every result is bitwise equal to torch's ``Tensor.to`` as torch 2.x runs on an x86-64 CPU with
AVX-512 (with AVX2 too, except the NaN bits of fp16 → fp32); ``tests/formats/test_casts.py`` sweeps every
bit-pattern class and ~4M random patterns against the installed torch, and every 16-bit
pattern exhaustively:

- finite values and infinities: IEEE round-to-nearest-even (the only correct rounding; fp16
  overflows to ±inf, subnormals in and out as IEEE says, the sign of zero kept);
- NaN stays NaN. torch's NaN *bits* come from the instruction that converts, and these are
  the ones reproduced: fp32 → bf16 gives ``0xFFFF`` for every NaN (AVX2/AVX-512
  ``cvtfp32_bf16``); fp32 → fp16 gives ``sign | 0x7E00 | top 9 payload bits`` (F16C
  ``vcvtps2ph``: quieted, payload kept); fp16 → fp32 gives ``sign | 0x7FC00000 | payload << 13``
  (AVX-512 ``vcvtph2ps``: quieted, payload kept); bf16 → fp32 is exact (a shift). torch's
  scalar build (``ATEN_CPU_CAPABILITY=default``) writes other NaN bits (bf16 ``0x7FC0``), and
  its AVX2 fp16 → fp32 path ``0x7FFFFFFF``; values other than NaN agree everywhere.

F16 ↔ BF16 go through fp32, as torch does (its fp16 → bf16 NaN is ``0x7FC0``: that copy kernel
is scalar). Other pairs (F64) are not handled here
(:func:`can_cast` says so) and take the torch path of :mod:`.assemble`.
"""

import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Dict, Iterator, Optional, Sequence

import numpy as np

from .formats.dtypes import NUMPY_BITS
from .formats.file_ranges import read_into

if TYPE_CHECKING:
    from .boxes import Piece

__all__ = ["can_cast", "cast_array", "cast_bytes", "iter_cast", "CHUNK_ELEMENTS"]

# Elements per chunk: 1 MiB of fp32 in, small enough to stay in the CPU caches between the
# numpy passes (measured: 4x larger chunks are 2.5x slower), large enough that the per-call
# overhead is noise.
CHUNK_ELEMENTS = 1 << 18

_NP = {d: np.dtype(bits).type for d, bits in NUMPY_BITS.items()}
_PAIRS = {("F32", "BF16"), ("F32", "F16"), ("BF16", "F32"), ("F16", "F32"), ("F16", "BF16"), ("BF16", "F16")}
_LITTLE = sys.byteorder == "little"


def can_cast(src: str, dst: str) -> bool:
    """True when :func:`iter_cast` converts ``src`` to ``dst`` (safetensors dtype names)."""
    return _LITTLE and (src, dst) in _PAIRS


class _Scratch:
    """The reused buffers of one cast stream (one per generator, so threads never share)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.inp: np.ndarray = np.empty(4 * n, np.uint8)  # the bytes read
        self.out: np.ndarray = np.empty(4 * n, np.uint8)  # the bytes yielded
        self.tmp: np.ndarray = np.empty(n, np.uint32)
        self.wide: np.ndarray = np.empty(n, np.uint32)
        self.mid: np.ndarray = np.empty(n, np.uint32)  # F16 <-> BF16 go through fp32
        self.mask: np.ndarray = np.empty(n, np.bool_)


def _f32_to_bf16(u32: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    n = len(u32)
    t, mask = s.tmp[:n], s.mask[:n]
    # Round to nearest even: add 0x7FFF plus the lowest kept bit, keep the high half.
    np.right_shift(u32, 16, out=t)
    np.bitwise_and(t, 1, out=t)
    np.add(t, 0x7FFF, out=t)
    np.add(t, u32, out=t)
    np.right_shift(t, 16, out=t)
    np.copyto(out, t, casting="unsafe")
    np.isnan(u32.view(np.float32), out=mask)
    if mask.any():
        np.copyto(out, 0xFFFF, where=mask)


def _f32_to_f16(u32: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    """IEEE round-to-nearest-even with the float unit doing the rounding (the FP16 library's
    ``fp16_ieee_from_fp32_value``, which torch's scalar path uses): about twice numpy's own
    float16 conversion loop."""
    n = len(u32)
    t, w, mask = s.tmp[:n], s.wide[:n], s.mask[:n]
    f: np.ndarray = u32.view(np.float32)
    tf: np.ndarray = t.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        # base = |f| scaled so that the fp32 addition below rounds at fp16's precision (overflow -> inf)
        np.abs(f, out=tf)
        np.multiply(tf, 2.0 ** 112, out=tf)
        np.multiply(tf, 2.0 ** -110, out=tf)
        np.left_shift(u32, 1, out=w)
        np.bitwise_and(w, 0xFF000000, out=w)
        np.maximum(w, 0x71000000, out=w)  # subnormal fp16 results round at a fixed exponent
        np.right_shift(w, 1, out=w)
        np.add(w, 0x07800000, out=w)
        np.add(w.view(np.float32), tf, out=tf)
    np.right_shift(t, 13, out=w)
    np.bitwise_and(w, 0x7C00, out=w)
    np.bitwise_and(t, 0x0FFF, out=t)
    np.add(w, t, out=w)
    np.right_shift(u32, 16, out=t)
    np.bitwise_and(t, 0x8000, out=t)
    np.bitwise_or(w, t, out=w)
    np.copyto(out, w, casting="unsafe")
    np.isnan(f, out=mask)
    if mask.any():
        bad = u32[mask]
        out[mask] = (((bad >> 16) & 0x8000) | 0x7E00 | ((bad >> 13) & 0x3FF)).astype(np.uint16)


def _bf16_to_f32(u16: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    np.copyto(out, u16, casting="unsafe")
    np.left_shift(out, 16, out=out)


def _f16_to_f32(u16: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    n = len(u16)
    mask = s.mask[:n]
    f: np.ndarray = out.view(np.float32)
    np.copyto(f, u16.view(np.float16), casting="unsafe")  # exact
    np.isnan(f, out=mask)
    if mask.any():
        np.bitwise_or(out, 0x00400000, out=out, where=mask)  # quiet a signalling NaN, keep its payload


def cast_array(src: str, dst: str, a: np.ndarray, out: Optional[np.ndarray] = None,
               scratch: Optional[_Scratch] = None) -> np.ndarray:
    """Cast the raw bits ``a`` (a uint16/uint32 array of dtype ``src``) to ``dst`` bits.

    ``out`` and ``scratch`` let a caller reuse buffers; the result is ``out`` (or a new array).
    """
    n = len(a)
    if scratch is None or scratch.n < n:
        scratch = _Scratch(max(n, 1))
    if out is None:
        out = np.empty(n, _NP[dst])
    if (src, dst) == ("F32", "BF16"):
        _f32_to_bf16(a, out, scratch)
    elif (src, dst) == ("F32", "F16"):
        _f32_to_f16(a, out, scratch)
    elif (src, dst) == ("BF16", "F32"):
        _bf16_to_f32(a, out, scratch)
    elif (src, dst) == ("F16", "F32"):
        _f16_to_f32(a, out, scratch)
    elif (src, dst) in (("F16", "BF16"), ("BF16", "F16")):
        wide = scratch.mid[:n]
        cast_array(src, "F32", a, wide, scratch)
        cast_array("F32", dst, wide, out, scratch)
        if dst == "BF16" and scratch.mask[:n].any():
            # torch converts half -> bfloat16 element by element (c10's scalar rounding): NaN is 0x7FC0.
            np.copyto(out, 0x7FC0, where=scratch.mask[:n])
    else:
        raise ValueError(f"no torch-free cast from {src} to {dst}")
    return out


def cast_bytes(raw: "bytes | bytearray | memoryview", src: str, dst: str) -> bytes:
    """The little-endian bytes ``raw`` of ``src`` values cast to ``dst`` (:func:`cast_array`): the
    same bits the export writes, for a caller holding a few values (the planner's placement
    samples). ``src == dst`` returns the bytes unchanged."""
    if src == dst:
        return bytes(raw)
    if not can_cast(src, dst):
        raise ValueError(f"no torch-free cast from {src} to {dst}")
    return cast_array(src, dst, np.frombuffer(bytes(raw), _NP[src])).tobytes()


# Open file descriptors per MappedFiles instance (the run's file set): one open per source file,
# closed when that instance goes away.
_fds: "weakref.WeakKeyDictionary[object, Dict[str, int]]" = weakref.WeakKeyDictionary()
_fds_lock = threading.Lock()


def _close_all(fds: Dict[str, int]) -> None:
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass


def _fd(owner: object, path: str) -> int:
    with _fds_lock:
        fds = _fds.get(owner)
        if fds is None:
            fds = _fds[owner] = {}
            weakref.finalize(owner, _close_all, fds)
        fd = fds.get(path)
        if fd is None:
            fd = fds[path] = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):  # pieces are read front to back: ask for larger read-ahead
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd


def iter_cast(pieces: Sequence["Piece"], dst: str, owner: object, *, chunk: int = CHUNK_ELEMENTS
              ) -> Iterator[memoryview]:
    """Yield the bytes of ``pieces`` (each with ``path``, ``offset``, ``numel``, ``dtype``) cast
    to ``dst``, a chunk at a time.

    Each yielded view is only valid until the next one is requested (the buffers are reused).
    ``owner`` is the object whose lifetime the source file descriptors share (the run's
    ``MappedFiles``).
    """
    total = sum(p.numel for p in pieces)
    if not total:
        return
    s = _Scratch(min(chunk, total))
    osize = np.dtype(_NP[dst]).itemsize
    for p in pieces:
        fd = _fd(owner, p.path) if p.numel else None
        itype = _NP[p.dtype]
        isize = np.dtype(itype).itemsize
        done = 0
        while done < p.numel:
            n = min(s.n, p.numel - done)
            raw = s.inp[:n * isize]
            assert fd is not None  # opened: p.numel > 0
            read_into(fd, raw.data, p.offset + done * isize, p.path)  # (.data: the array's memoryview)
            out = s.out[:n * osize]
            cast_array(p.dtype, dst, raw.view(itype), out.view(_NP[dst]), s)
            yield out.data
            done += n
