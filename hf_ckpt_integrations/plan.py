"""The export plan: plain, printable data saying how every output tensor is assembled.

A source builds it from metadata alone; :mod:`.writer` executes it; :mod:`.verify` re-reads
through it. Nothing here reads a file.

An output tensor is ``pieces`` laid end to end (each a byte range of one source file, in the
source dtype), then viewed as ``shape``. Where blocks of it come from different places they are
:class:`Chunk` s: pieces plus N-D ``offsets``/``sizes`` in the global tensor (torch DCP's
``ChunkStorageMetadata``), checked to tile it exactly (:func:`check_tiling`). Tensor-parallel
slices are chunks along ``cat_dim`` (``parts`` + ``part_shapes``, :func:`parts_as_chunks`); an
N-D layout (FSDP x TP) gives its chunks directly (:meth:`TensorPlan.from_chunks`). Vocabulary
unpadding is ``keep_rows``; a split into the Hub layout (one fused tensor -> N output tensors, see
:mod:`.sources.hub_layout`) as ``elem_range``, or, where the tensor is a plain byte copy, as
narrowed pieces (:func:`narrow_pieces`), so the copy stays a byte-range copy.
"""

import bisect
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from ._tiling import check_tiling
from .formats.dtypes import FLOATS, SIZES

__all__ = ["Piece", "LivePiece", "Chunk", "TensorPlan", "ExportPlan", "narrow_pieces", "box_runs", "select_box",
           "range_as_box", "check_tiling",
           "row_major_pieces", "parts_as_chunks", "check_plan", "decide_dtypes"]


@dataclass(frozen=True)
class Piece:
    """``numel`` consecutive elements of dtype ``dtype`` at byte ``offset`` of ``path``."""

    path: str
    offset: int
    numel: int
    dtype: str


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


@dataclass(frozen=True)
class Chunk:
    """A block of an output tensor, as torch DCP's ``ChunkStorageMetadata`` places one: ``pieces``
    laid end to end are its elements in row-major order, and it lands in the global tensor at
    N-D ``offsets`` with extent ``sizes``. A ZeRO partition is one chunk covering the whole tensor;
    a tensor-parallel slice a chunk offset along the split dim; an FSDP x TP shard a chunk offset
    along two dims — all the same to :func:`check_tiling` and :func:`~.assemble.assemble_chunks`."""

    pieces: Tuple[Piece, ...]
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def narrow_pieces(pieces: Sequence[Piece], start: int, count: int) -> List[Piece]:
    """Elements ``[start, start + count)`` of the flat tensor ``pieces`` lay end to end, as pieces.
    Raises ``ValueError`` for a range past the end."""
    return _Flat(pieces).take(start, count)


class _Flat:
    """``pieces`` laid end to end, indexed by element (a bisect per range: a chunk cut into many
    runs costs ``runs x log(pieces)``, not ``runs x pieces``)."""

    def __init__(self, pieces: Sequence[Piece]):
        self.pieces = list(pieces)
        self.starts: List[int] = []
        at = 0
        for p in self.pieces:
            self.starts.append(at)
            at += p.numel
        self.numel = at

    def take(self, start: int, count: int) -> List[Piece]:
        if count == 0:
            return []
        if start < 0 or count < 0 or start + count > self.numel:
            raise ValueError(f"element range past the end of the tensor "
                             f"({max(0, start + count - self.numel)} elements missing)")
        out: List[Piece] = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while count > 0:
            p, at = self.pieces[i], start - self.starts[i]
            take = min(count, p.numel - at)
            if take > 0:
                out.append(Piece(p.path, p.offset + at * SIZES[p.dtype], take, p.dtype))
                count -= take
                start += take
            i += 1
        return out


def box_runs(shape: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> Iterator[Tuple[int, int]]:
    """The elements of box ``[lo, hi)`` of a row-major tensor of ``shape``, in row-major order, as
    maximal runs ``(flat start, count)``: one per row of the dims the box cuts, the trailing dims it
    covers whole merged into each run. Nothing for an empty box; a 0-d tensor is one run of 1."""
    shape = tuple(shape)
    if any(b <= a for a, b in zip(lo, hi)):
        return
    k = len(shape)
    while k > 0 and lo[k - 1] == 0 and hi[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        yield 0, math.prod(shape)
        return
    inner = math.prod(shape[k:])
    run = (hi[k - 1] - lo[k - 1]) * inner
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    for outer in itertools.product(*(range(lo[d], hi[d]) for d in range(k - 1))):
        yield sum(i * strides[d] for d, i in enumerate(outer)) + lo[k - 1] * inner, run


def select_box(shape: Sequence[int], chunks: Sequence[Chunk], lo: Sequence[int], hi: Sequence[int]) -> List[Chunk]:
    """The sub-box ``[lo, hi)`` of a tensor of ``shape`` tiled by ``chunks``, as chunks tiling a tensor of
    shape ``hi - lo``: per chunk that meets the box, the part inside it, its pieces narrowed to the byte
    ranges of those elements (row-major runs, :func:`box_runs`), offsets relative to ``lo``. Metadata
    only: nothing is read, and a part of a tensor costs the reads of that part alone. Raises
    ``ValueError`` for a box outside ``shape`` or a chunk whose pieces do not hold its elements."""
    shape, lo, hi = tuple(shape), tuple(lo), tuple(hi)
    if len(lo) != len(shape) or len(hi) != len(shape) or any(
            not 0 <= a <= b <= d for a, b, d in zip(lo, hi, shape)):
        raise ValueError(f"box {list(lo)}..{list(hi)} is not inside the shape {list(shape)}")
    out = []
    for c in chunks:
        a = tuple(max(x, o) for x, o in zip(lo, c.offsets))
        b = tuple(min(y, o + s) for y, o, s in zip(hi, c.offsets, c.sizes))
        if any(q <= p for p, q in zip(a, b)):
            continue
        flat = _Flat(c.pieces)
        if flat.numel != c.numel:
            raise ValueError(f"a chunk at {list(c.offsets)} of sizes {list(c.sizes)} holds {flat.numel} elements")
        local_lo = tuple(p - o for p, o in zip(a, c.offsets))
        local_hi = tuple(q - o for q, o in zip(b, c.offsets))
        pieces = [q for start, n in box_runs(c.sizes, local_lo, local_hi) for q in flat.take(start, n)]
        out.append(Chunk(tuple(pieces), tuple(p - x for p, x in zip(a, lo)), tuple(q - p for p, q in zip(a, b))))
    return out


def range_as_box(shape: Sequence[int], start: int, count: int) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]]:
    """Flat elements ``[start, start + count)`` of a row-major tensor of ``shape`` as the box ``(lo, hi)``
    they are, or None when they are not one box (or none): a box fixes every dim before some dim ``d``,
    takes a run of ``d`` and every dim after it whole (a split along the leading dims is one)."""
    shape = tuple(shape)
    if count <= 0 or start < 0 or start + count > math.prod(shape):
        return None
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1:])
        if start % inner or count % inner:
            continue
        first, n = start // inner, count // inner
        if first // shape[d] != (first + n - 1) // shape[d]:  # crosses an index of a dim before d
            continue
        lo = list(_unravel(start, shape))
        hi = [i + 1 for i in lo[:d]] + [lo[d] + n] + list(shape[d + 1:])
        return tuple(lo), tuple(hi)
    return ((), ()) if not shape and start == 0 and count == 1 else None


def _unravel(flat: int, shape: Sequence[int]) -> Tuple[int, ...]:
    out = []
    for d in reversed(shape):
        out.append(flat % d if d else 0)
        flat = flat // d if d else 0
    return tuple(reversed(out))


def row_major_pieces(shape: Sequence[int], chunks: Sequence[Chunk]) -> Optional[List[Piece]]:
    """The byte-copy fast path: when the (tiling) ``chunks`` are whole-row slices along dim 0 (every
    other dim at full extent), their pieces laid end to end in offset order are the tensor's bytes;
    return them. None when some chunk is not (the tensor is then assembled)."""
    shape = tuple(shape)
    if not shape:
        return [p for c in chunks for p in c.pieces]
    out = []
    for c in sorted(chunks, key=lambda c: c.offsets[0]):
        if any(o != 0 or s != d for o, s, d in zip(c.offsets[1:], c.sizes[1:], shape[1:])):
            return None
        out.extend(c.pieces)
    return out


def parts_as_chunks(shape: Sequence[int], parts: Sequence[Sequence[Piece]], part_shapes=None,
                    cat_dim: Optional[int] = None) -> List[Chunk]:
    """Tensor-parallel slices (``parts`` of ``part_shapes``, concatenated along ``cat_dim``) as chunks:
    slice ``i`` at offset ``sum(sizes of slices before i)`` along ``cat_dim``, 0 elsewhere."""
    shapes = list(part_shapes) if part_shapes is not None else [tuple(shape)]
    if len(parts) == 1 and part_shapes is None:
        return [Chunk(tuple(parts[0]), (0,) * len(shape), tuple(shape))]
    out, at = [], 0
    for pieces, s in zip(parts, shapes):
        s = tuple(s)
        offsets = tuple(at if d == cat_dim else 0 for d in range(len(s)))
        out.append(Chunk(tuple(pieces), offsets, s))
        at += s[cat_dim] if cat_dim is not None and s else 0
    return out


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

    def flat_pieces(self) -> Optional[List[Piece]]:
        """The pieces that laid end to end are the output bytes (the hot path), or None when the
        tensor must be assembled (column slices, N-D blocks, unpadding, a Hub-layout element range)."""
        if self.keep_rows is not None or self.elem_range is not None or self.reduce is not None:
            return None
        if self.chunks is not None:
            return row_major_pieces(self.shape, self.chunks)
        return list(self.parts[0]) if len(self.parts) == 1 else None

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
    keep_fp32: Optional[object] = None

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
        pieces = [p for part in t.parts for p in part]
        if t.src_dtype not in SIZES or any(p.dtype not in SIZES or p.numel < 0 for p in pieces):
            raise LayoutError(f"{where}: dtype {short_repr(t.src_dtype)} is not one safetensors stores here")
        got = [sum(p.numel for p in part) for part in t.parts]
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
            if any(p.dtype != t.src_dtype for p in pieces):
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
