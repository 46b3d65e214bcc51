"""Execute the reads of a :class:`~.plan.TensorPlan`: output bytes for one tensor.

The hot path (a plain tensor kept in its stored dtype) yields the source byte ranges straight
from ``mmap`` with no tensor library; a plain tensor cast between fp32 and bf16/fp16 is read and
converted a chunk at a time by :mod:`.casts` (numpy, no torch). A tensor whose chunks are not
whole rows in order (tensor-parallel column slices, FSDP x TP blocks) is assembled by
:func:`assemble_chunks` (numpy, byte blocks, one tensor in memory); unpadding and Hub-layout
element ranges then use torch.
"""

from typing import Iterator

from .errors import LayoutError
from .formats.dtypes import FLOATS as FLOAT_DTYPES, SIZES as DTYPE_SIZES, to_torch as _torch_dtype
from .formats.file_ranges import FileRange  # what iter_bytes yields with ranges=True
from .mapped_files import MappedFiles
from .plan import Piece, TensorPlan
from .boxes import pieces_dtypes

__all__ = ["assemble_chunks", "iter_bytes", "torch_tensor", "check_replicas", "check_module_copy",
           "FileRange", "FLOAT_DTYPES"]


def _flat(pieces, files: MappedFiles):
    import torch

    chunks = [torch.frombuffer(files.read(p.path, p.offset, p.numel * DTYPE_SIZES[p.dtype]),
                               dtype=_torch_dtype(p.dtype)) if p.numel else torch.empty(0, dtype=_torch_dtype(p.dtype))
              for p in pieces]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def assemble_chunks(shape, chunks, files: MappedFiles):
    """The row-major bytes of the tensor of ``shape`` that ``chunks`` tile (checked by
    :func:`~.plan.check_tiling`), as a flat uint8 numpy array: each chunk's pieces read in order
    and written into its N-D box. Dtype-agnostic (bytes), no torch."""
    import numpy as np

    shape = tuple(shape)
    dtypes = {p.dtype for c in chunks for p in c.pieces}
    if len(dtypes) > 1:
        raise LayoutError(f"chunks of several dtypes {sorted(dtypes)}; files from different saves are mixed")
    size = DTYPE_SIZES[dtypes.pop()] if dtypes else 1
    out = np.empty(shape + (size,), np.uint8)
    for c in chunks:
        if not c.numel:
            continue
        raw = _read_all(c.pieces, files)
        box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
        out[box] = np.frombuffer(raw, np.uint8).reshape(tuple(c.sizes) + (size,))
    return out.reshape(-1)


def torch_tensor(t: TensorPlan, files: MappedFiles):
    """The tensor ``t`` describes, in its source dtype (a copy only where merging needs one)."""
    import warnings

    with warnings.catch_warnings():
        # frombuffer on a read-only mmap warns; the tensor is never written to.
        warnings.simplefilter("ignore", UserWarning)
        shapes = t.part_shapes or [t.shape]
        if t.reduce == "sum":  # every part holds the whole tensor: their sum, added in order
            out = _flat(t.parts[0], files).view(t.shape).clone()
            for part in t.parts[1:]:
                out += _flat(part, files).view(t.shape)
        elif t.chunks is None and len(t.parts) == 1:
            out = _flat(t.parts[0], files).view(shapes[0])
        else:  # TP slices and N-D blocks alike: chunks written into their boxes
            import torch

            full = t.assembled_shape()
            raw = assemble_chunks(full, t.placement(), files)
            dtype = _torch_dtype(t.src_dtype)
            out = (torch.from_numpy(raw).view(dtype) if raw.size else torch.empty(0, dtype=dtype)).view(full)
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
    """Raise :class:`LayoutError` naming the file whose copy of ``t`` differs from the first copy
    (``replicas``), or the tied copy (``tied_copies``) that differs from ``t``."""
    for name, chunks in t.tied_copies:
        if not _tied_copy_equal(t, chunks, files):
            where = next((p.path for c in chunks for p in c.pieces if isinstance(p, Piece)), t.name)
            if name == t.name:  # a replica of the tensor itself (a DTensor's Replicate mesh dim): name its block's file
                own = {(tuple(c.offsets), tuple(c.sizes)): c for c in t.placement()}
                where = next((c.pieces[0].path for c in chunks if c.pieces and (tuple(c.offsets), tuple(c.sizes)) in own
                              and _read_all(c.pieces, files) != _read_all(own[tuple(c.offsets), tuple(c.sizes)].pieces,
                                                                           files)), where)
                raise LayoutError(
                    f"{where}: its copy of {t.name} differs from the copy written (the ranks were meant to hold "
                    "replicas); export is refused: check which rank diverged, or export an earlier save")
            raise LayoutError(
                f"{where}: {name} differs from {t.name}, which config.json ties it to (tie_word_embeddings): "
                f"save_pretrained writes {t.name} alone and from_pretrained loads it into both, so {name} would be "
                "lost. Export is refused: if the model was trained with untied weights, pass --config a directory "
                "whose config.json says tie_word_embeddings: false")
    if not t.replicas:
        return
    primary = _read_all(t.parts[0], files)
    for replica in t.replicas:
        if _read_all(replica, files) != primary:
            raise LayoutError(
                f"{replica[0].path}: its copy of {t.name} differs from the copy in {t.parts[0][0].path}; "
                "the model-parallel ranks were meant to be replicas. Export is refused: check which rank "
                "diverged (use --tag for an earlier save), or treat the axis as tensor parallel with --tp-rule")


def _tied_copy_equal(t: TensorPlan, chunks, files: MappedFiles) -> bool:
    """``chunks`` (tiling ``t.shape``) hold exactly ``t``'s bytes: chunk by chunk where both are tiled
    by the same boxes and ``t`` is stored whole, else both assembled and compared."""
    own = t.placement() if t.keep_rows is None and t.elem_range is None else None
    boxes = {(tuple(c.offsets), tuple(c.sizes)): c for c in own or ()}
    if own is not None and len(boxes) == len(own) == len(chunks) and all(
            (tuple(c.offsets), tuple(c.sizes)) in boxes for c in chunks):
        return all(_read_all(c.pieces, files) == _read_all(boxes[(tuple(c.offsets), tuple(c.sizes))].pieces, files)
                   for c in chunks)
    copy = TensorPlan.from_chunks(t.name, tuple(t.shape), t.src_dtype, chunks)
    a, b = torch_tensor(t, files).contiguous(), torch_tensor(copy, files).contiguous()
    import torch

    return a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


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
    flat = t.flat_pieces()
    if flat is not None and all(d == out_dtype for d in pieces_dtypes(flat)):
        for p in flat:
            n = p.numel * DTYPE_SIZES[p.dtype]
            yield FileRange(p.path, p.offset, n) if ranges else files.read(p.path, p.offset, n)
        return
    if flat is not None:
        from .casts import can_cast, iter_cast  # numpy: imported by casts only (half the CLI's start-up)

        if all(can_cast(d, out_dtype) for d in pieces_dtypes(flat)):
            yield from iter_cast(flat, out_dtype, files)  # numpy bit operations, no torch
            return
    if t.chunks is not None and t.keep_rows is None and t.elem_range is None:
        from .casts import can_cast, cast_array

        raw = assemble_chunks(t.shape, t.chunks, files)  # N-D blocks: numpy, no torch
        if t.src_dtype == out_dtype:
            yield memoryview(raw)
            return
        if can_cast(t.src_dtype, out_dtype):
            from .formats.dtypes import NUMPY_BITS

            yield memoryview(cast_array(t.src_dtype, out_dtype, raw.view(NUMPY_BITS[t.src_dtype])).view("uint8"))
            return
    tensor = torch_tensor(t, files).to(_torch_dtype(out_dtype)).contiguous()
    import torch

    yield memoryview(tensor.view(-1).view(torch.uint8).numpy()) if tensor.numel() else memoryview(b"")
