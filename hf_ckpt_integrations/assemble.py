"""Execute the reads of a :class:`~.plan.TensorPlan`: output bytes for one tensor.

The hot path (a plain tensor kept in its stored dtype) yields the source byte ranges straight
from ``mmap`` with no tensor library; a plain tensor cast between fp32 and bf16/fp16 is read and
converted a chunk at a time by :mod:`.casts` (numpy, no torch). Tensor-parallel merges and
unpadding import torch and hold one tensor in memory.
"""

from typing import Iterator, NamedTuple

from .errors import LayoutError
from .formats.dtypes import FLOATS as FLOAT_DTYPES, SIZES as DTYPE_SIZES, to_torch as _torch_dtype
from .plan import TensorPlan
from .safe_load import MappedFiles

__all__ = ["out_dtype_for", "iter_bytes", "to_torch", "check_replicas", "check_module_copy",
           "FileRange", "FLOAT_DTYPES"]


class FileRange(NamedTuple):
    """``nbytes`` bytes at ``offset`` of ``path``, to be copied by the kernel (``os.copy_file_range``)
    rather than read: the pages never enter this process, so memory stays flat whatever the model size."""

    path: str
    offset: int
    nbytes: int

    def __len__(self):
        return self.nbytes


def out_dtype_for(t: TensorPlan, requested):
    """Floating tensors take the requested dtype (default: as stored); integer ones never change."""
    if requested is None or t.src_dtype not in FLOAT_DTYPES:
        return t.src_dtype
    return requested


def _flat(pieces, files: MappedFiles):
    import torch

    chunks = [torch.frombuffer(files.read(p.path, p.offset, p.numel * DTYPE_SIZES[p.dtype]),
                               dtype=_torch_dtype(p.dtype)) if p.numel else torch.empty(0, dtype=_torch_dtype(p.dtype))
              for p in pieces]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def to_torch(t: TensorPlan, files: MappedFiles):
    """The tensor ``t`` describes, in its source dtype (a copy only where merging needs one)."""
    import warnings

    with warnings.catch_warnings():
        # frombuffer on a read-only mmap warns; the tensor is never written to.
        warnings.simplefilter("ignore", UserWarning)
        shapes = t.part_shapes or [t.shape]
        if len(t.parts) == 1:
            out = _flat(t.parts[0], files).view(shapes[0])
        else:
            import torch

            out = torch.cat([_flat(p, files).view(s) for p, s in zip(t.parts, shapes)], dim=t.cat_dim)
        if t.keep_rows is not None:
            out = out[: t.keep_rows]
        if t.elem_range is not None:  # one tensor of a Hub-layout split of the merged tensor
            a, b = t.elem_range
            out = out.contiguous().view(-1)[a:b]
            if out.numel() == t.numel:
                out = out.view(t.shape)
    if tuple(out.shape) != tuple(t.shape):
        raise LayoutError(f"{t.name}: assembled shape {tuple(out.shape)} != recorded {tuple(t.shape)}")
    return out


def _read_all(pieces, files: MappedFiles) -> bytes:
    return b"".join(files.read(p.path, p.offset, p.numel * DTYPE_SIZES[p.dtype]) for p in pieces)


def check_replicas(t: TensorPlan, files: MappedFiles) -> None:
    """Raise :class:`LayoutError` naming the file whose copy of ``t`` differs from the first copy."""
    if not t.replicas:
        return
    primary = _read_all(t.parts[0], files)
    for replica in t.replicas:
        if _read_all(replica, files) != primary:
            raise LayoutError(
                f"{replica[0].path}: its copy of {t.name} differs from the copy in {t.parts[0][0].path}; "
                "the model-parallel ranks were meant to be replicas. Export is refused: check which rank "
                "diverged (use --tag for an earlier save), or treat the axis as tensor parallel with --tp-rule")


def check_module_copy(t: TensorPlan, files: MappedFiles) -> bool:
    """Every fp32 master of ``t`` cast to the module weights' dtype equals the module weight
    (``t.module_check``, see :class:`~.plan.TensorPlan`); True when there is nothing to check."""
    if t.module_check is None:
        return True
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer on a read-only mmap (never written)
        for masters, module in zip(*t.module_check):
            want = _flat(module, files)
            got = _flat(masters, files).to(want.dtype)
            if got.numel() != want.numel() or not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                return False
    return True


def iter_bytes(t: TensorPlan, out_dtype: str, files: MappedFiles, *, ranges: bool = False) -> Iterator:
    """Yield the output bytes of ``t`` in ``out_dtype``, in order, a chunk at a time.

    With ``ranges``, stored bytes are yielded as :class:`FileRange` (for a writer that copies them
    file to file); otherwise every chunk is a bytes-like object, valid until the next one is
    requested (cast chunks reuse one buffer). Replicas are compared with the
    first copy before anything is yielded.
    """
    check_replicas(t, files)
    if t.is_byte_copy and all(p.dtype == out_dtype for p in t.parts[0]):
        for p in t.parts[0]:
            n = p.numel * DTYPE_SIZES[p.dtype]
            yield FileRange(p.path, p.offset, n) if ranges else files.read(p.path, p.offset, n)
        return
    if t.is_byte_copy:
        from .casts import can_cast, iter_cast  # numpy: imported by casts only (half the CLI's start-up)

        if all(can_cast(p.dtype, out_dtype) for p in t.parts[0]):
            yield from iter_cast(t.parts[0], out_dtype, files)  # numpy bit operations, no torch
            return
    tensor = to_torch(t, files).to(_torch_dtype(out_dtype)).contiguous()
    import torch

    yield memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
