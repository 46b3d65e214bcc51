"""The export plan: plain, printable data saying how every output tensor is assembled.

A source builds it from metadata alone; :mod:`.writer` executes it; :mod:`.verify` re-reads
through it. Nothing here reads a file.

An output tensor is ``pieces`` laid end to end (each a byte range of one source file, in the
source dtype), then viewed as ``shape``. Tensor-parallel merges and vocabulary unpadding are
expressed as ``parts`` (one flat list of pieces per slice, merged along ``cat_dim``) and
``keep_rows``; a split into the Hub layout (one fused tensor -> N output tensors, see
:mod:`.sources.hub_layout`) as ``elem_range``, or, where the tensor is a plain byte copy, as
narrowed pieces (:func:`narrow_pieces`), so the copy stays a byte-range copy.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .formats.dtypes import SIZES, USER_NAMES as DTYPE_NAMES, from_user as dtype_from_name

__all__ = ["Piece", "TensorPlan", "ExportPlan", "DTYPE_NAMES", "dtype_from_name", "narrow_pieces",
           "check_plan"]
# DTYPE_NAMES / dtype_from_name: the user dtype names of :mod:`.formats.dtypes`, kept importable here.


@dataclass(frozen=True)
class Piece:
    """``numel`` consecutive elements of dtype ``dtype`` at byte ``offset`` of ``path``."""

    path: str
    offset: int
    numel: int
    dtype: str


def narrow_pieces(pieces: List[Piece], start: int, count: int) -> List[Piece]:
    """Elements ``[start, start + count)`` of the flat tensor ``pieces`` lay end to end, as pieces."""
    out = []
    for p in pieces:
        if count <= 0:
            break
        if start >= p.numel:
            start -= p.numel
            continue
        take = min(count, p.numel - start)
        out.append(Piece(p.path, p.offset + start * SIZES[p.dtype], take, p.dtype))
        count -= take
        start = 0
    if count > 0:
        raise ValueError(f"element range past the end of the tensor ({count} elements missing)")
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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_byte_copy(self) -> bool:
        """True when the output bytes are the source pieces laid end to end (the hot path)."""
        return len(self.parts) == 1 and self.keep_rows is None and self.elem_range is None

    def narrowed(self, name: str, shape: Tuple[int, ...], start: int) -> "TensorPlan":
        """Output ``name`` = elements ``[start, start + numel(shape))`` of this tensor, as ``shape``."""
        count = math.prod(shape)
        if self.is_byte_copy:
            check = self.module_check
            if check is not None and len(check[0]) == 1 and len(check[1]) == 1:  # the same range of both copies
                check = ([narrow_pieces(check[0][0], start, count)], [narrow_pieces(check[1][0], start, count)])
            else:
                check = None
            return TensorPlan(name, tuple(shape), self.src_dtype, [narrow_pieces(self.parts[0], start, count)],
                              kind=self.kind, rule=self.rule, hub_source=self.name,
                              replicas=[narrow_pieces(r, start, count) for r in self.replicas], module_check=check)
        a, b = self.elem_range or (0, self.numel)
        if start + count > b - a:
            raise ValueError(f"{name}: elements [{start}, {start + count}) past the end of {self.name}")
        return TensorPlan(name, tuple(shape), self.src_dtype, self.parts, kind=self.kind, cat_dim=self.cat_dim,
                          part_shapes=self.part_shapes, keep_rows=self.keep_rows, rule=self.rule,
                          replicas=self.replicas, elem_range=(a + start, a + start + count),
                          hub_source=self.name)


@dataclass
class ExportPlan:
    """Everything ``export`` will do, decided before a byte is written."""

    engine: str
    source: str
    tag: Optional[str]
    stage: Optional[int]
    dp_size: int
    mp_size: int
    mp_axis: str  # "none" | "tp" | "replica"
    tensors: List[TensorPlan]
    aliases: Dict[str, str] = field(default_factory=dict)  # tied name -> stored name
    dtypes: Dict[str, str] = field(default_factory=dict)  # what the checkpoint holds: kind -> dtype
    config_dir: Optional[str] = None
    files: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    padding_removed: Dict[str, Tuple[int, int]] = field(default_factory=dict)  # name -> (rows before, after)
    mp_axis_reason: Optional[str] = None
    engine_version: Optional[str] = None  # the engine release that wrote the files (DeepSpeed's ds_version)
    conversions: List[dict] = field(default_factory=list)  # Hub-layout splits/renames (hub_layout)
    # A PEFT adapter (sources/peft.py): what `inspect` shows of adapter_config.json; the export is
    # then the adapter directory PeftModel.save_pretrained writes.
    adapter: Optional[dict] = None

    def tensor_bytes(self, out_dtype: Optional[str] = None) -> int:
        return sum(t.numel * SIZES[out_dtype or t.src_dtype] for t in self.tensors)

    def summary(self) -> dict:
        """A JSON-able description (what ``inspect --json`` prints)."""
        by_kind: Dict[str, int] = {}
        for t in self.tensors:
            by_kind[t.kind] = by_kind.get(t.kind, 0) + 1
        return {
            "engine": self.engine,
            "engine_version": self.engine_version,
            "source": self.source,
            "tag": self.tag,
            "zero_stage": self.stage,
            "dp_size": self.dp_size,
            "mp_size": self.mp_size,
            "mp_axis": self.mp_axis,
            "mp_axis_reason": self.mp_axis_reason,
            "dtypes": self.dtypes,
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
            "tensors": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.src_dtype, "kind": t.kind,
                 "pieces": sum(len(p) for p in t.parts), "cat_dim": t.cat_dim, "rule": t.rule,
                 "replicas": len(t.replicas), "hub_source": t.hub_source}
                for t in self.tensors
            ],
        }


def check_plan(plan: ExportPlan) -> None:
    """Refuse, before anything is written, a plan whose output safetensors could not load: names
    that are not non-empty strings or are ``__metadata__``, a name twice, negative or non-integer
    dimensions, unknown dtypes, or pieces that do not add up to the shape.

    Raises :class:`~.errors.LayoutError` naming the tensor.
    """
    from .errors import LayoutError
    from .safe_load import MAX_NDIM, short_repr

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


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate: JSON would carry it, safetensors refuses it
        return False
