"""The export plan: plain, printable data saying how every output tensor is assembled.

A source builds it from metadata alone; :mod:`.writer` executes it; :mod:`.verify` re-reads
through it. Nothing here reads a file.

An output tensor is ``pieces`` laid end to end (each a byte range of one source file, in the
source dtype), then viewed as ``shape``. Where blocks of it come from different places they are
:class:`Chunk` s: pieces plus N-D ``offsets``/``sizes`` in the global tensor (torch DCP's
``ChunkStorageMetadata``), checked to tile it exactly (:func:`check_tiling`). Tensor-parallel
slices are chunks along ``cat_dim`` (``parts`` + ``part_shapes``, :func:`parts_as_chunks`); an
N-D layout (FSDP x TP) gives its chunks directly (:meth:`TensorPlan.from_chunks`). Vocabulary
unpadding is ``keep_rows``. A part of a tensor (a Hub-layout split, :mod:`.convert.hub_layout`; a
conversion rule, :mod:`.convert`) is the pieces of that box alone (:meth:`TensorPlan.narrowed`,
:func:`~.boxes.select_box`), so a byte copy stays one; only a range that is not a box is an
``elem_range`` of the assembled tensor. Pieces, chunks and the box helper live in :mod:`.boxes`.
"""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._tiling import check_tiling
from .boxes import (Chunk, Piece, StridedPieces, box_runs, narrow_pieces, parts_as_chunks, pieces_dtypes,
                    pieces_numel, range_as_box, row_major_pieces, select_box)
from .formats.dtypes import FLOATS, SIZES

if TYPE_CHECKING:  # annotations only: plan imports dtype_rule at call time, keeping the layering
    from .dtype_rule import KeepFp32

__all__ = ["Piece", "LivePiece", "Chunk", "StridedPieces", "TensorPlan", "ExportPlan", "narrow_pieces", "box_runs", "select_box",
           "range_as_box", "check_tiling",
           "row_major_pieces", "parts_as_chunks", "check_plan", "decide_dtypes"]


@dataclass(frozen=True)
class LivePiece:
    """Elements ``[lo, hi)`` of a tensor produced when the writer asks (a live engine's parameter,
    a LoRA merge): ``read(lo, hi, writer, dtype)`` yields their bytes in ``dtype`` (the tensor's
    decided ``out_dtype``; ``self.dtype`` is what the producer holds, the plan's ``src_dtype``) on
    rank ``writer`` — the rank the writer assigned the tensor to — and nothing elsewhere. A read
    may be a collective (ZeRO-3 partitions, TP slices sent to the writer): every rank calls it, in
    the writer's order, and the others drop what it yields."""

    read: Callable
    lo: int
    hi: int
    dtype: str

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass
class TensorPlan:
    """One output tensor.

    ``parts`` holds one list of pieces per tensor-parallel slice; a plain (unsplit) tensor has
    exactly one part. Slice ``i`` has shape ``part_shapes[i]``; slices are concatenated along
    ``cat_dim``, then only the first ``keep_rows`` rows are kept (vocabulary padding), giving
    ``shape``. ``replicas`` are further copies of the single part (flat pieces each) that must
    be byte-for-byte equal to it; they are checked, never written. ``elem_range`` ``(a, b)``:
    only elements ``[a, b)`` of the assembled flat tensor are this output (a Hub-layout split of
    a merged tensor), viewed as ``shape``; ``hub_source`` names the trained tensor it came from.
    """

    name: str
    shape: Tuple[int, ...]
    src_dtype: str
    parts: List[List[Piece]]
    kind: str = "master"  # master | module | frozen | buffer
    cat_dim: Optional[int] = None
    part_shapes: Optional[List[Tuple[int, ...]]] = None
    keep_rows: Optional[int] = None
    rule: Optional[str] = None  # where a TP merge rule came from
    replicas: List[List[Piece]] = field(default_factory=list)
    elem_range: Optional[Tuple[int, int]] = None
    hub_source: Optional[str] = None
    # (fp32 master parts, module-weight parts): the model's own copy of this tensor (ZeRO-1/2 saves
    # the module weights whole), which the masters cast to its dtype must equal part by part;
    # ``verify`` checks every element (the source samples a few while planning).
    module_check: Optional[Tuple[List[List[Piece]], List[List[Piece]]]] = None
    out_dtype: Optional[str] = None  # the dtype written (:func:`decide_dtypes`); None until decided
    # N-D placement given by the source (FSDP x TP...); None: derived from ``parts`` (:meth:`placement`).
    chunks: Optional[List[Chunk]] = None
    # (name, chunks tiling ``shape``) of a tied copy held under another name (an FSDP ``lm_head.weight``
    # beside the embedding): bitwise equal to this tensor whatever either's layout; checked, never written.
    tied_copies: List[Tuple[str, List[Chunk]]] = field(default_factory=list)
    # "sum": the output is the element-wise sum of ``parts`` (each of ``shape``, added in order) — a
    # row-parallel bias that every TP rank adds before the all-reduce (GPT-NeoX's parallel residual).
    reduce: Optional[str] = None

    @classmethod
    def from_chunks(cls, name: str, shape: Tuple[int, ...], src_dtype: str, chunks: Sequence[Chunk],
                    **kwargs) -> "TensorPlan":
        """A tensor of ``shape`` tiled by ``chunks`` (checked by :func:`check_plan`); ``parts`` and
        ``part_shapes`` list the same pieces chunk by chunk (what verify's CRC check and file lists read)."""
        chunks = list(chunks)
        return cls(name, tuple(shape), src_dtype, [list(c.pieces) for c in chunks],
                   part_shapes=[tuple(c.sizes) for c in chunks], chunks=chunks, **kwargs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def assembled_shape(self) -> Tuple[int, ...]:
        """The shape the chunks tile, before ``keep_rows`` / ``elem_range``."""
        if self.reduce is not None:
            return tuple(self.shape)
        if self.chunks is not None:
            if self.keep_rows is None and self.elem_range is None:
                return tuple(self.shape)
            return tuple(max((c.offsets[d] + c.sizes[d] for c in self.chunks), default=0)
                         for d in range(len(self.chunks[0].sizes) if self.chunks else len(self.shape)))
        if self.part_shapes is None or len(self.parts) == 1:
            return tuple(self.part_shapes[0]) if self.part_shapes else tuple(self.shape)
        first = tuple(self.part_shapes[0])
        dim = self.cat_dim or 0
        return first[:dim] + (sum(s[dim] for s in self.part_shapes),) + first[dim + 1:]

    def placement(self) -> List[Chunk]:
        """Where each block lands in :meth:`assembled_shape`: the source's chunks, or ``parts`` as chunks."""
        if self.chunks is not None:
            return list(self.chunks)
        return parts_as_chunks(self.assembled_shape(), self.parts, self.part_shapes if len(self.parts) > 1 else None,
                               self.cat_dim)

    def flat_pieces(self) -> Optional[Sequence[Piece]]:
        """The pieces that laid end to end are the output bytes (the hot path), or None when the
        tensor must be assembled (column slices, N-D blocks, unpadding, a Hub-layout element range).
        A :class:`~.boxes.StridedPieces` part is returned as it is (its pieces made while iterated)."""
        if self.keep_rows is not None or self.elem_range is not None or self.reduce is not None:
            return None
        if self.chunks is not None:
            return row_major_pieces(self.shape, self.chunks)
        if len(self.parts) != 1:
            return None
        part = self.parts[0]
        return part if isinstance(part, StridedPieces) else list(part)

    @property
    def is_byte_copy(self) -> bool:
        """True when the output bytes are the source pieces laid end to end (the hot path)."""
        return self.flat_pieces() is not None

    def narrowed(self, name: str, shape: Tuple[int, ...], start: int) -> "TensorPlan":
        """Output ``name`` = elements ``[start, start + numel(shape))`` of this tensor, as ``shape``."""
        count = math.prod(shape)
        flat = self.flat_pieces()
        if flat is not None:
            check = self.module_check
            if check is not None and len(check[0]) == 1 and len(check[1]) == 1:  # the same range of both copies
                check = ([narrow_pieces(check[0][0], start, count)], [narrow_pieces(check[1][0], start, count)])
            else:
                check = None
            return TensorPlan(name, tuple(shape), self.src_dtype, [narrow_pieces(flat, start, count)],
                              kind=self.kind, rule=self.rule, hub_source=self.name,
                              replicas=[narrow_pieces(r, start, count) for r in self.replicas], module_check=check)
        boxed = self._boxed(name, tuple(shape), start, count)
        if boxed is not None:
            return boxed
        a, b = self.elem_range or (0, self.numel)
        if start + count > b - a:
            raise ValueError(f"{name}: elements [{start}, {start + count}) past the end of {self.name}")
        return TensorPlan(name, tuple(shape), self.src_dtype, self.parts, kind=self.kind, cat_dim=self.cat_dim,
                          part_shapes=self.part_shapes, keep_rows=self.keep_rows, rule=self.rule,
                          replicas=self.replicas, elem_range=(a + start, a + start + count),
                          hub_source=self.name, chunks=self.chunks)

    def _boxed(self, name: str, shape: Tuple[int, ...], start: int, count: int) -> Optional["TensorPlan"]:
        """:meth:`narrowed` of an assembled tensor (TP slices, N-D chunks, unpadded rows) where the range
        is a box whose shape, leading 1s dropped, is ``shape``: the chunks' parts inside it
        (:func:`select_box`), so only that part is read. A row-parallel sum narrows every addend. None
        where that does not apply (the range is not such a box, or the tensor is already a range)."""
        if self.elem_range is not None:
            return None
        if self.reduce == "sum":
            parts = [narrow_pieces(p, start, count) for p in self.parts]
            return TensorPlan(name, shape, self.src_dtype, parts, kind=self.kind, rule=self.rule,
                              part_shapes=[shape] * len(parts), hub_source=self.name, reduce=self.reduce)
        if self.reduce is not None:
            return None
        box = range_as_box(self.shape, start, count)
        drop = len(self.shape) - len(shape)
        if box is None or drop < 0:
            return None
        lo, hi = box
        sizes = tuple(b - a for a, b in zip(lo, hi))
        if any(n != 1 for n in sizes[:drop]) or sizes[drop:] != shape:
            return None
        whole, placement = self.assembled_shape(), self.placement()
        if self.replicas and len(placement) != 1:
            return None
        chunks = [Chunk(c.pieces, c.offsets[drop:], c.sizes[drop:]) for c in select_box(whole, placement, lo, hi)]
        replicas = [list(select_box(whole, [Chunk(tuple(r), placement[0].offsets, placement[0].sizes)], lo, hi)[0]
                         .pieces) for r in self.replicas]
        return TensorPlan.from_chunks(name, shape, self.src_dtype, chunks, kind=self.kind, rule=self.rule,
                                      replicas=replicas, hub_source=self.name)


@dataclass
class ExportPlan:
    """Everything ``export`` will do, decided before a byte is written.

    ``detail`` holds what only one source knows about its checkpoint, shown by ``inspect`` beside
    the common fields (DeepSpeed: ``zero_stage``, ``dp_size``, ``mp_size``, ``mp_axis``,
    ``mp_axis_reason``; torch DCP: ``dp_size``); JSON-able values only."""

    engine: str
    source: str
    tag: Optional[str]
    tensors: List[TensorPlan]
    aliases: Dict[str, str] = field(default_factory=dict)  # tied name -> stored name
    dtypes: Dict[str, str] = field(default_factory=dict)  # what the checkpoint holds: kind -> dtype
    config_dir: Optional[str] = None
    files: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    padding_removed: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # name -> (rows before, after)
    detail: Dict[str, Any] = field(default_factory=dict)  # the source's own facts (see the class doc)
    engine_version: Optional[str] = None  # the engine release that wrote the files (DeepSpeed's ds_version)
    conversions: List[dict] = field(default_factory=list)  # Hub-layout splits/renames (hub_layout)
    out_dtype: Optional[str] = None  # floating tensors are written in it; None: each as stored
    # A PEFT adapter (sources/peft.py): what `inspect` shows of adapter_config.json; the export is
    # then the adapter directory PeftModel.save_pretrained writes.
    adapter: Optional[dict] = None
    # The model class's fp32-kept modules (:class:`~.dtype_rule.KeepFp32`), read from the config
    # when a 16-bit export or ``inspect`` needs them; None: nothing known to be kept.
    keep_fp32: Optional["KeepFp32"] = None

    def tensor_bytes(self, out_dtype: Optional[str] = None) -> int:
        return sum(t.numel * SIZES[out_dtype or t.src_dtype] for t in self.tensors)

    def kept_fp32(self) -> Optional[dict]:
        """What ``inspect`` shows of the fp32-kept modules: the class and its lists, and per tensor
        kept in a 16-bit export, when (``["bf16", "fp16"]`` or ``["fp16"]``), why (the list entry)
        and from what (the fp32 masters, or an upcast of the 16-bit copy). None when not known."""
        from .dtype_rule import kept_reason

        keep = self.keep_fp32
        if keep is None:
            return None
        tensors = []
        for t in self.tensors:
            name = t.hub_source or t.name
            when = [u for u, d in (("bf16", "BF16"), ("fp16", "F16")) if kept_reason(name, d, keep)]
            if when and t.src_dtype in FLOATS:
                masters = t.src_dtype == "F32" or (t.module_check is not None and not t.replicas and
                                                   all(p.dtype == "F32" for part in t.module_check[0] for p in part))
                stored = "fp32 masters" if t.kind == "master" or t.src_dtype != "F32" else "fp32 as stored"
                tensors.append({"name": t.name, "when": when, "why": kept_reason(name, "F16", keep),
                                "from": stored if masters else f"upcast from {t.src_dtype}"})
        return {"model_class": keep.model_class, "_keep_in_fp32_modules": list(keep.modules),
                "_keep_in_fp32_modules_strict": list(keep.strict), "tensors": tensors}

    def summary(self) -> dict:
        """A JSON-able description (what ``inspect --json`` prints)."""
        by_kind: Dict[str, int] = {}
        for t in self.tensors:
            by_kind[t.kind] = by_kind.get(t.kind, 0) + 1
        head = {"engine": self.engine, "engine_version": self.engine_version, "source": self.source, "tag": self.tag}
        rest = {
            "dtypes": self.dtypes,
            "out_dtype": self.out_dtype,
            "tensor_count": len(self.tensors),
            "tensors_by_kind": by_kind,
            "parameters": sum(t.numel for t in self.tensors),
            "bytes_fp32": self.tensor_bytes("F32"),
            "aliases": self.aliases,
            "config_dir": self.config_dir,
            "files": self.files,
            "notes": self.notes,
            "padding_removed": {k: list(v) for k, v in self.padding_removed.items()},
            "conversions": self.conversions,
            "adapter": self.adapter,
            "keep_fp32": self.kept_fp32(),
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.src_dtype, "out_dtype": t.out_dtype,
                 "kind": t.kind,
                 "pieces": sum(len(p) for p in t.parts), "cat_dim": t.cat_dim, "rule": t.rule,
                 "replicas": len(t.replicas), "hub_source": t.hub_source, "reduce": t.reduce,
                 "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "pieces": len(c.pieces)}
                            for c in t.placement()]}
                for t in self.tensors
            ],
        }
        detail = {k: v for k, v in self.detail.items() if k not in head and k not in rest}  # never overrides
        return {**head, **detail, **rest}


def decide_dtypes(plan: ExportPlan, dtype: Optional[str] = None, keep=None) -> ExportPlan:
    """Decide, once, the dtype every tensor of ``plan`` is written in, by the one rule
    (:func:`~.dtype_rule.output_dtype`): floating tensors take ``dtype`` (``"fp32"``/``"bf16"``/
    ``"fp16"``), by default the fp32 masters' dtype when the checkpoint has them (every other float
    follows), else each tensor's stored dtype; the model class's fp32-kept modules
    (``keep``, default ``plan.keep_fp32``) stay fp32, matched on their in-memory names
    (``hub_source``); integer tensors never change. A kept tensor comes from the fp32 masters where
    the source had planned the 16-bit module copy (ZeRO-1/2), else it is upcast from what is stored
    (a note says so). Sets ``plan.out_dtype`` and each ``TensorPlan.out_dtype``; returns ``plan``.
    Raises :class:`~.errors.OptionError` for an unknown ``dtype``."""
    from .dtype_rule import output_dtype, request

    if keep is not None:
        plan.keep_fp32 = keep
    requested = request(dtype, masters="F32" in plan.dtypes.values())
    plan.out_dtype = requested
    upcast = []
    for t in plan.tensors:
        t.out_dtype = output_dtype(t.hub_source or t.name, t.src_dtype, requested, plan.keep_fp32)
        if t.out_dtype == "F32" and requested != "F32" and t.src_dtype != "F32" and not _use_masters(t):
            upcast.append(t.name)
    plan.notes = [n for n in plan.notes if not n.startswith(_UPCAST_NOTE)]
    if upcast:
        more = f" and {len(upcast) - 5} more" if len(upcast) > 5 else ""
        plan.notes.append(f"{_UPCAST_NOTE} from their 16-bit copy (the checkpoint holds no fp32 master of "
                          f"them): {', '.join(upcast[:5])}{more}")
    return plan


_UPCAST_NOTE = "kept in fp32 by the model class, upcast"


def _use_masters(t: "TensorPlan") -> bool:
    """Make a tensor the source planned from its 16-bit module copy (ZeRO-1/2 saves it whole) read
    its fp32 masters instead (``module_check`` holds both, part by part); False when it has none."""
    check = t.module_check
    if t.kind != "module" or check is None or t.chunks is not None or t.replicas or len(check[0]) != len(t.parts) or \
            any(p.dtype != "F32" for part in check[0] for p in part):
        return False
    t.parts = [list(part) for part in check[0]]
    t.src_dtype, t.kind = "F32", "master"
    return True


def check_plan(plan: ExportPlan) -> None:
    """Refuse, before anything is written, a plan whose output safetensors could not load: names
    that are not non-empty strings or are ``__metadata__``, a name twice, negative or non-integer
    dimensions, unknown dtypes, or pieces that do not add up to the shape.

    Raises :class:`~.errors.LayoutError` naming the tensor.
    """
    from .errors import LayoutError, short_repr
    from .formats.dtypes import MAX_NDIM

    seen = set()
    for t in plan.tensors:
        name = t.name
        where = f"{plan.source}: tensor {short_repr(name)}"
        if type(name) is not str or not name or name == "__metadata__" or not _utf8(name):
            raise LayoutError(f"{where}: not a valid tensor name for safetensors; the checkpoint is corrupt or "
                              "crafted: copy it again from the training run")
        if name in seen:
            raise LayoutError(f"{where}: appears twice in the output; the checkpoint is corrupt: copy it again")
        seen.add(name)
        shapes = [t.shape] + list(t.part_shapes or [])
        if any(type(s) is not tuple or len(s) > MAX_NDIM or any(type(d) is not int or d < 0 for d in s)
               for s in shapes):
            raise LayoutError(f"{where}: shape {short_repr(t.shape)} is not a list of non-negative integers; "
                              "the checkpoint is corrupt: copy it again")
        # (a StridedPieces part answers without making its pieces: its counts are non-negative by construction)
        dtypes = {d for part in t.parts for d in pieces_dtypes(part)}
        if t.src_dtype not in SIZES or any(d not in SIZES for d in dtypes) or any(
                p.numel < 0 for part in t.parts if not isinstance(part, StridedPieces) for p in part):
            raise LayoutError(f"{where}: dtype {short_repr(t.src_dtype)} is not one safetensors stores here")
        got = [pieces_numel(part) for part in t.parts]
        want = ([math.prod(s) for s in t.part_shapes] if t.part_shapes is not None else
                [math.prod(t.shape)] if t.keep_rows is None else got)
        if got != want:
            raise LayoutError(f"{where}: its pieces hold {got} elements, its shape needs {want}; please "
                              "report this with `hf-ckpt inspect --json`")
        if t.reduce is not None and (t.reduce != "sum" or t.chunks is not None or
                                     any(tuple(s) != tuple(t.shape) for s in t.part_shapes or [()])):
            raise LayoutError(f"{where}: a reduce {short_repr(t.reduce)} of parts not all of its shape; please "
                              "report this with `hf-ckpt inspect --json`")
        if t.reduce is None and (t.chunks is not None or len(t.parts) > 1):
            if any(d != t.src_dtype for d in dtypes):
                raise LayoutError(f"{where}: its chunks are of several dtypes; files from different saves are "
                                  "mixed: copy one save's files again")
            try:
                check_tiling(t.assembled_shape(), t.placement())
            except ValueError as e:
                raise LayoutError(f"{where}: its chunks do not tile its shape {list(t.assembled_shape())} ({e}); "
                                  "files from different saves are mixed, or the layout is not read right: "
                                  "please report it with `hf-ckpt inspect --json`") from None


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate: JSON would carry it, safetensors refuses it
        return False
