"""Run a :class:`~.rules.RuleSet` over a source's tensors as plan data.

Every operation is a choice of boxes of source tensors (:class:`_View`): a rename is the whole
tensor, an unstack one index of the leading axis, a split a run of one dim, an interleaved split
one run per group, a concat the views side by side. An output is then the boxes' pieces placed in
its shape (:func:`~..plan.select_box`): the byte-copy path reads each element it writes once and
never assembles a source tensor to take a part of it. Two operations are not boxes: a transpose
becomes one chunk per output line, each element its own piece (correct for any layout, and paid
per element: meant for small tensors, refused above :data:`TRANSPOSE_LIMIT` elements); a sum of
TP slices stays :attr:`~..plan.TensorPlan.reduce` (added in rank order by the writer).
"""

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import LayoutError
from ..plan import Chunk, TensorPlan, select_box
from .tp_rules import Rule as TpRule, concat_shape, merge_slices, rule_from_tp
from .rules import Rule, RuleSet, Size, fill, variables

__all__ = ["TRANSPOSE_LIMIT", "Converted", "apply_rules", "merge_tp", "target_names"]

TRANSPOSE_LIMIT = 1 << 20
Slices = Union[TensorPlan, Sequence[TensorPlan]]


@dataclass
class Converted:
    """What :func:`apply_rules` made: the output ``tensors`` (in rule-application order), the ``dropped``
    source names with their reasons, and per converted source a ``conversions`` entry (what ``inspect``
    shows: ``{"source", "shape", "into", "op", "rule"}``)."""

    tensors: List[TensorPlan]
    dropped: Dict[str, str]
    conversions: List[dict]


@dataclass(frozen=True)
class _View:
    """Box ``[lo, hi)`` of ``src`` (its logical shape), seen with the dims in ``dims`` only (the others
    are fixed at one index: an unstacked axis)."""

    src: TensorPlan
    lo: Tuple[int, ...]
    hi: Tuple[int, ...]
    dims: Tuple[int, ...]

    @classmethod
    def whole(cls, t: TensorPlan) -> "_View":
        return cls(t, (0,) * len(t.shape), tuple(t.shape), tuple(range(len(t.shape))))

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.hi[d] - self.lo[d] for d in self.dims)

    def cut(self, dim: int, a: int, b: int) -> "_View":
        """Elements ``[a, b)`` along the view's dim ``dim``."""
        d = self.dims[dim]
        lo, hi = list(self.lo), list(self.hi)
        lo[d], hi[d] = self.lo[d] + a, self.lo[d] + b
        return _View(self.src, tuple(lo), tuple(hi), self.dims)

    def index(self, dim: int, i: int) -> "_View":
        """Index ``i`` of the view's dim ``dim``, that dim dropped."""
        v = self.cut(dim, i, i + 1)
        return _View(self.src, v.lo, v.hi, tuple(d for k, d in enumerate(self.dims) if k != dim))

    def chunks(self) -> List[Chunk]:
        """The view's elements as chunks in view coordinates (fixed dims dropped)."""
        src = self.src
        out = select_box(src.assembled_shape(), src.placement(), self.lo, self.hi)
        return [Chunk(c.pieces, tuple(c.offsets[d] for d in self.dims), tuple(c.sizes[d] for d in self.dims))
                for c in out]


def _value(size: Size, params: Mapping[str, Any], where: str) -> int:
    if type(size) is int:
        return size
    name = str(size)[1:-1]
    value = params.get(name)
    if type(value) is not int or value <= 0:
        raise LayoutError(f"{where}: needs the param {name!r} as a positive integer, the source gave {value!r}; "
                          "please report this with `hf-ckpt inspect --json`")
    return value


def merge_tp(name: str, slices: Sequence[TensorPlan], tp: Optional[str], params: Mapping[str, Any],
             where: str, override: Optional[TpRule] = None) -> TensorPlan:
    """The TP slices of one tensor (rank order) merged into one plan named ``name`` by ``override`` (a TP
    rule the source took from elsewhere: the checkpoint's own record, ``--tp-rule``), else by the rule's
    ``tp`` (:data:`~.rules.TP_VALUES`), through :func:`.tp_rules.merge_slices`. One slice: itself, renamed,
    except ``tp: vocab`` on a tensor given whole, which keeps its first ``vocab_size`` rows (the same
    function cuts the padding of merged slices: one place decides vocabulary padding)."""
    if len(slices) == 1:  # given whole: only a vocabulary cut applies
        vocab = rule_from_tp(tp, where, params) if tp == "vocab" and override is None else None
        return merge_slices(name, slices, vocab, "fix the rule")
    rule = override or rule_from_tp(tp, where, params)
    if rule is None:
        raise LayoutError(f"{name}: {len(slices)} TP slices and {where} gives no 'tp'; add one to the rule")
    return merge_slices(name, slices, rule, "fix the rule")


def _place(name: str, shape: Tuple[int, ...], views: Sequence[Tuple[_View, Tuple[int, ...]]], rule: Rule
           ) -> TensorPlan:
    """Output ``name`` of ``shape`` = each view's elements at its offsets (views tiling the shape)."""
    if len(views) == 1 and views[0][0].shape == shape:
        view = views[0][0]
        src = view.src
        if view.lo == (0,) * len(src.shape) and view.hi == tuple(src.shape):
            return dataclasses.replace(src, name=name, rule=src.rule or rule.where)
        start = sum(a * math.prod(src.shape[d + 1:]) for d, a in enumerate(view.lo))
        if _contiguous(view):  # a run of the flat tensor: narrowed keeps its checks (replicas, module copy)
            return dataclasses.replace(src.narrowed(name, shape, start), hub_source=None, rule=src.rule or rule.where)
    chunks: List[Chunk] = []
    for view, at in views:
        if view.src.replicas or view.src.reduce is not None or view.src.tied_copies:
            raise LayoutError(f"{view.src.name}: {rule.where} takes parts of it into {name}, but it is checked "
                              "against replicas or summed; such a tensor converts by rename or a run of rows only")
        chunks.extend(Chunk(c.pieces, tuple(o + a for o, a in zip(c.offsets, at)), c.sizes) for c in view.chunks())
    src = views[0][0].src
    return TensorPlan.from_chunks(name, shape, src.src_dtype, chunks, kind=src.kind, rule=rule.where)


def _contiguous(view: _View) -> bool:
    """The view's box is one run of its source's row-major elements (and drops only leading unit dims)."""
    shape = view.src.shape
    k = len(shape)
    while k > 0 and view.lo[k - 1] == 0 and view.hi[k - 1] == shape[k - 1]:
        k -= 1
    return all(view.hi[d] - view.lo[d] == 1 for d in range(k - 1)) and \
        all(d in view.dims for d in range(k, len(shape)))


def _transposed(name: str, view: _View, perm: Tuple[int, ...], rule: Rule) -> TensorPlan:
    """Output = ``view`` with its dims permuted: one chunk per output line (the last output dim), each
    element a piece (a transpose is not a run of bytes)."""
    shape = view.shape
    if len(perm) != len(shape):
        raise LayoutError(f"{view.src.name}: {rule.where} transposes {len(perm)} dims of a {len(shape)}-D tensor; "
                          "fix the rule")
    out_shape = tuple(shape[p] for p in perm)
    if math.prod(out_shape) > TRANSPOSE_LIMIT:
        raise LayoutError(f"{view.src.name}: {rule.where} transposes {math.prod(out_shape)} elements (a piece each); "
                          f"hf-ckpt transposes at most {TRANSPOSE_LIMIT}: report the model family")
    chunks = []
    for idx in itertools.product(*(range(n) for n in out_shape[:-1])):
        line = view
        fixed = {perm[k]: i for k, i in enumerate(idx)}
        for d in sorted(fixed, reverse=True):  # index from the last dim so earlier dim numbers stay valid
            line = line.index(d, fixed[d])
        chunks.append(Chunk(_in_order(line), tuple(idx) + (0,), (1,) * len(idx) + (out_shape[-1],)))
    return TensorPlan.from_chunks(name, out_shape, view.src.src_dtype, chunks, kind=view.src.kind, rule=rule.where)


def _in_order(line: _View) -> Tuple:
    """The pieces of a 1-D view in index order (its chunks may come in any order)."""
    return tuple(p for c in sorted(line.chunks(), key=lambda c: c.offsets[0]) for p in c.pieces)


def _outputs(rule: Rule, view: _View, values: Dict[str, Any], params: Mapping[str, Any]) -> List[TensorPlan]:
    """The rule's outputs for one (possibly unstacked, concatenated) view."""
    names = [fill(t, {**params, **values}) for t in rule.to]
    if rule.split is None:
        parts = [[(view, (0,) * len(view.shape))]]
        shapes = [view.shape]
    else:
        s = rule.split
        dim = s.dim if s.dim >= 0 else s.dim + len(view.shape)
        if not 0 <= dim < len(view.shape):
            raise LayoutError(f"{view.src.name}: {rule.where} splits dim {s.dim} of a {len(view.shape)}-D tensor; "
                              "fix the rule")
        sizes = [_value(z, params, rule.where) for z in s.sizes]
        groups = _value(s.groups, params, rule.where) if s.groups is not None else 1
        if groups * sum(sizes) != view.shape[dim]:
            raise LayoutError(f"{view.src.name}: {rule.where} splits dim {dim} of {list(view.shape)} into {groups} x "
                              f"{sizes}, which is {groups * sum(sizes)} elements; the config and the checkpoint "
                              "disagree, or the rule is wrong")
        parts, shapes = [], []
        for k, size in enumerate(sizes):
            start = sum(sizes[:k])
            views = []
            for g in range(groups):
                at = tuple(g * size if d == dim else 0 for d in range(len(view.shape)))
                views.append((view.cut(dim, g * sum(sizes) + start, g * sum(sizes) + start + size), at))
            parts.append(views)
            shapes.append(tuple(groups * size if d == dim else n for d, n in enumerate(view.shape)))
    out = []
    for name, views, shape in zip(names, parts, shapes):
        if rule.transpose is not None:
            if len(views) != 1:
                raise LayoutError(f"{view.src.name}: {rule.where} transposes an interleaved split; split and "
                                  "transpose in two rules")
            out.append(_transposed(name, views[0][0], rule.transpose, rule))
        else:
            out.append(_place(name, shape, views, rule))
    return out


def _bindings(rules: RuleSet, names: Sequence[str]) -> Dict[str, Dict[str, int]]:
    """Per numbered variable (:class:`~.rules.Numbering`), its table over the source ``names``."""
    return {n.var: n.table(names) for n in rules.numbers}


def _variables(rule: Rule, name: str, groups: Dict[str, str], rules: RuleSet, tables: Mapping[str, Mapping[str, int]]
               ) -> Dict[str, Any]:
    """The match's groups plus the numbered variables the rule's templates use, for the source ``name``."""
    values: Dict[str, Any] = dict(groups)
    used = {v for t in rule.to + (rule.concat.with_ if rule.concat else ()) for v in variables(t)}
    for n in rules.numbers:
        if n.var not in used or n.group not in groups:
            continue
        number = tables[n.var].get(groups[n.group])
        if number is None:
            raise LayoutError(f"{name}: {rule.where} names its {n.var} number, but no tensor of the checkpoint matching "
                              f"{n.among.pattern!r} has {n.group} {groups[n.group]}; fix the rules file "
                              "(or the checkpoint is incomplete)")
        values[n.var] = number
    return values


def target_names(rules: RuleSet, names: Sequence[str], params: Optional[Mapping[str, Any]] = None
                 ) -> Dict[str, str]:
    """The output name of each of ``names`` that a rename rule (no split, unstack or concat) converts:
    what a source matches a user's own TP rules against before :func:`apply_rules` runs."""
    params = dict(params or {})
    tables = _bindings(rules, names)
    out = {}
    for name in names:
        found = rules.find(name)
        if found is None or found[0].drop is not None or found[0].split or found[0].unstack or found[0].concat:
            continue
        rule, groups = found
        out[name] = fill(rule.to[0], {**params, **_variables(rule, name, groups, rules, tables)})
    return out


def apply_rules(rules: RuleSet, tensors: Mapping[str, Slices], params: Optional[Mapping[str, Any]] = None,
                tp: Optional[Mapping[str, TpRule]] = None) -> Converted:
    """Convert ``tensors`` (source name -> its plan, or its TP slices in rank order) by ``rules``.

    Per source name, in order: the first matching rule; its TP merge, unstack, concat (the named
    partners consumed), split, transpose; output names filled from the match's named groups, the
    unstacked index, the numbered variables (the rules' ``number``) and ``params``. ``tp``: per source
    name a TP rule the source took from elsewhere (the checkpoint's record, the user's), which merges
    its slices instead of the rule's ``tp``. Raises :class:`~..errors.LayoutError` naming the tensor and the
    rule where one does not fit (a name no rule matches under ``"unmatched": "refuse"``, a split
    that does not add up, a partner missing, two rules writing one name)."""
    params = dict(params or {})
    missing = [p for p in rules.params if p not in params]
    if missing:
        raise LayoutError(f"{rules.source}: the source gave no value for params {missing}; please report this")
    out: List[TensorPlan] = []
    dropped: Dict[str, str] = {}
    conversions: List[dict] = []
    consumed = set()
    tp = tp or {}
    tables = _bindings(rules, list(tensors))
    for name in tensors:
        if name in consumed:
            continue
        found = rules.find(name)
        if found is None:
            if rules.unmatched == "keep":
                out.append(merge_tp(name, _as_slices(tensors[name]), None, params, rules.source, tp.get(name)))
                continue
            raise LayoutError(f"{name}: no rule of {rules.source} matches it; the checkpoint holds a tensor the "
                              f"{rules.family or ''} rules do not know: add a rule (docs: conversions)")
        rule, groups = found
        if rule.drop is None:
            groups = _variables(rule, name, groups, rules, tables)
        if rule.drop is not None:
            dropped[name] = rule.drop
            conversions.append({"source": name, "into": [], "op": f"drop: {rule.drop}", "rule": rule.where})
            continue
        src = merge_tp(name, _as_slices(tensors[name]), rule.tp, params, rule.where, tp.get(name))
        view = _View.whole(src)
        if rule.concat is not None:
            views, at = [(view, 0)], view.shape[rule.concat.dim]
            for template in rule.concat.with_:
                partner = fill(template, {**params, **groups})
                if partner not in tensors or partner in consumed or partner == name:
                    raise LayoutError(f"{name}: {rule.where} concatenates it with {partner}, which the checkpoint "
                                      "does not hold (or another rule took); the checkpoint is incomplete or the rule "
                                      "is wrong")
                consumed.add(partner)
                partner_plan = merge_tp(partner, _as_slices(tensors[partner]), rule.tp, params, rule.where,
                                        tp.get(partner))
                views.append((_View.whole(partner_plan), at))
                at += views[-1][0].shape[rule.concat.dim]
            dim = rule.concat.dim
            try:
                shape = concat_shape([v.shape for v, _ in views], dim)
            except ValueError as e:
                raise LayoutError(f"{name}: {e} ({rule.where})") from None
            joined = _place(name, shape, [(v, tuple(a if d == dim else 0 for d in range(len(shape))))
                                          for v, a in views], rule)
            view = _View.whole(joined)
        if rule.unstack is not None:
            if len(view.shape) < len(rule.unstack):
                raise LayoutError(f"{name}: {rule.where} unstacks {len(rule.unstack)} leading axes of a "
                                  f"{len(view.shape)}-d tensor; fix the rule")
            made = []
            for index in itertools.product(*(range(n) for n in view.shape[:len(rule.unstack)])):
                part = view
                for i in index:
                    part = part.index(0, i)
                made.extend(_outputs(rule, part, {**groups, **dict(zip(rule.unstack, index))}, params))
        else:
            made = _outputs(rule, view, groups, params)
        out.extend(made)
        if [t.name for t in made] != [name]:
            conversions.append({"source": name, "shape": list(src.shape), "into": [t.name for t in made],
                                "op": _describe(rule), "rule": rule.where})
    seen: Dict[str, int] = {}
    for t in out:
        if t.name in seen:
            raise LayoutError(f"{t.name}: written twice by the rules of {rules.source}; fix the rules file")
        seen[t.name] = 1
    return Converted(out, dropped, conversions)


def _as_slices(value: Slices) -> List[TensorPlan]:
    return [value] if isinstance(value, TensorPlan) else list(value)


def _describe(rule: Rule) -> str:
    ops = []
    if rule.tp:
        ops.append(f"tp {rule.tp}")
    if rule.concat:
        ops.append(f"concat dim {rule.concat.dim}")
    if rule.unstack:
        ops.append(f"unstack {', '.join(rule.unstack)}")
    if rule.split:
        ops.append(f"{'interleaved ' if rule.split.groups is not None else ''}split dim {rule.split.dim}")
    if rule.transpose:
        ops.append(f"transpose {list(rule.transpose)}")
    return ", ".join(ops) or "rename"
