"""Conversion rules as data: how a source's tensor names and layouts become the HF ones.

A rules file is JSON (data, never code: a user may pass one, and loading it runs nothing), one per
engine and model family, beside the source that uses it. It is parsed and checked in full when
loaded (:func:`load_rules`, :func:`parse_rules`): a bad rule fails there, as one
:class:`RuleError` naming the file and the rule, never later in an export. The format and the
operations are documented in ``docs/conversions.md``; :mod:`.execute` runs a :class:`RuleSet` as
plan data (boxes of the source tensors, :func:`~..plan.select_box`).
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .. import guards
from ..errors import CheckpointError

__all__ = ["FORMAT", "TP_VALUES", "RuleError", "Split", "Concat", "Rule", "Numbering", "RuleSet", "parse_rules",
           "load_rules", "fill", "variables"]

FORMAT = 1
# How the tensor-parallel slices of one tensor merge: concatenated along dim 0 / 1, one copy (the others
# checked equal), concatenated along dim 0 then cut to the ``vocab_size`` param (vocabulary padding), summed
# in rank order, or a row-parallel bias (summed when the ``parallel_residual`` param is true, else one copy).
TP_VALUES = ("0", "1", "replicated", "vocab", "sum", "row_bias")
_MAX_BYTES = 1 << 20
_VAR = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_RULE_KEYS = {"match", "to", "unstack", "split", "transpose", "concat", "tp", "drop", "comment"}
_TOP_KEYS = {"format", "engine", "family", "reference", "params", "number", "unmatched", "rules", "comment"}

Size = Union[int, str]  # an element count, or "{param}" given by the source when the rules run


class RuleError(CheckpointError):
    """A rules file that is not valid: the message names the file, the rule and the fix."""


@dataclass(frozen=True)
class Split:
    """Cut dim ``dim`` into parts of ``sizes`` elements (one output per part). With ``groups`` G the
    dim is G blocks of ``sum(sizes)``, and part ``k`` is part ``k`` of every block, in block order
    (an interleaved split: Megatron's fused QKV per query group)."""

    dim: int
    sizes: Tuple[Size, ...]
    groups: Optional[Size] = None


@dataclass(frozen=True)
class Concat:
    """The output is the matched tensor followed, along ``dim``, by the tensors named by ``with_``
    (templates over the match's groups); those are consumed, never written on their own."""

    dim: int
    with_: Tuple[str, ...]


@dataclass(frozen=True)
class Rule:
    """One rule: a source name that ``match`` (a regex, matched whole) accepts becomes ``to`` (templates;
    one per split part), after, in this order: the TP slices merged by ``tp``, the leading axis unstacked
    (``unstack``: the variable its index binds; several leading axes with several variables), ``concat``, ``split``, ``transpose`` (a permutation of
    the dims). ``drop``: the reason the tensor is not written (then nothing else)."""

    index: int
    where: str  # "<file>: rules[<i>] (match '<pattern>')", for every message about this rule
    match: "re.Pattern[str]"
    to: Tuple[str, ...] = ()
    unstack: Optional[Tuple[str, ...]] = None  # one variable per leading axis unstacked
    split: Optional[Split] = None
    transpose: Optional[Tuple[int, ...]] = None
    concat: Optional[Concat] = None
    tp: Optional[str] = None
    drop: Optional[str] = None


@dataclass(frozen=True)
class Numbering:
    """A variable numbered from the checkpoint's names (the top-level ``number``): ``var`` of a source
    name is the rank, in integer order from 0, of its ``group`` value among the ``group`` values of
    the source names ``among`` matches whole. (A pipeline's transformer block: the rank of its layer
    index among the layers that hold a QKV weight.)"""

    var: str
    group: str
    among: "re.Pattern[str]"

    def table(self, names: Sequence[str]) -> Dict[str, int]:
        """``group`` value -> number, over the source ``names``."""
        values = set()
        for n in names:
            m = self.among.fullmatch(n)
            if m is not None and m.group(self.group) is not None:
                values.add(m.group(self.group))
        ordered = sorted(values, key=lambda v: (int(v), v) if v.isdigit() else (-1, v))
        return {v: i for i, v in enumerate(ordered)}


@dataclass(frozen=True)
class RuleSet:
    """A parsed rules file. ``params``: the names the source supplies when the rules run (sizes that
    depend on the config: head counts, the vocabulary size). ``unmatched``: ``"refuse"`` (a name no
    rule matches is an error) or ``"keep"`` (written as it is)."""

    source: str
    engine: Optional[str]
    family: Optional[str]
    reference: Optional[str]
    params: Tuple[str, ...]
    unmatched: str
    rules: Tuple[Rule, ...]
    numbers: Tuple[Numbering, ...] = ()

    def find(self, name: str) -> Optional[Tuple[Rule, Dict[str, str]]]:
        """The first rule whose pattern matches ``name`` whole, with its named groups; None when none does."""
        for rule in self.rules:
            m = rule.match.fullmatch(name)
            if m is not None:
                return rule, {k: v for k, v in m.groupdict().items() if v is not None}
        return None


def variables(template: str) -> List[str]:
    """The ``{name}`` variables ``template`` uses, in order."""
    return _VAR.findall(template)


def fill(template: str, values: Mapping[str, Any]) -> str:
    """``template`` with every ``{name}`` replaced by ``values[name]`` (no other format syntax)."""
    return _VAR.sub(lambda m: str(values[m.group(1)]), template)


def _int(value: Any, where: str, what: str) -> int:
    if type(value) is not int:
        raise RuleError(f"{where}: {what} must be an integer, not {value!r}; fix the rules file")
    return value


def _size(value: Any, where: str, what: str, params: Sequence[str]) -> Size:
    if type(value) is int and value > 0:
        return value
    if isinstance(value, str):
        m = _VAR.fullmatch(value)
        if m and m.group(1) in params:
            return value
    raise RuleError(f"{where}: {what} must be a positive integer or '{{param}}' of a declared param "
                    f"({', '.join(params) or 'none declared'}), not {value!r}; fix the rules file")


def _templates(value: Any, where: str) -> Tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(t, str) and t for t in items):
        raise RuleError(f"{where}: 'to' must be an output name or a list of them; fix the rules file")
    for t in items:
        if re.sub(_VAR, "", t).count("{") or re.sub(_VAR, "", t).count("}"):
            raise RuleError(f"{where}: 'to' {t!r} uses braces other than '{{name}}'; fix the rules file")
    return tuple(items)


def _numbers(obj: Any, source: str, params: Sequence[str]) -> Tuple[Numbering, ...]:
    if obj is None:
        return ()
    if not isinstance(obj, dict):
        raise RuleError(f"{source}: 'number' is {{'var': {{'group': G, 'among': REGEX}}}}; fix the rules file")
    out = []
    for var, spec in obj.items():
        where = f"{source}: number[{var!r}]"
        if not re.fullmatch(r"[A-Za-z_]\w*", var) or var in params:
            raise RuleError(f"{where}: a numbered variable is an identifier that is not a param; fix the rules file")
        if not isinstance(spec, dict) or set(spec) != {"group", "among"} or not isinstance(spec["group"], str) or \
                not isinstance(spec["among"], str):
            raise RuleError(f"{where}: is {{'group': G, 'among': REGEX}} (strings); fix the rules file")
        try:
            among = re.compile(spec["among"])
        except re.error as e:
            raise RuleError(f"{where}: 'among' is not a regex ({e}); fix the rules file") from None
        if spec["group"] not in among.groupindex:
            raise RuleError(f"{where}: 'among' {spec['among']!r} has no named group {spec['group']!r}; "
                            "fix the rules file")
        out.append(Numbering(var, spec["group"], among))
    return tuple(out)


def _unstack(value: Any, where: str) -> Optional[Tuple[str, ...]]:
    """``unstack``: the variable the leading index binds (``"layer"``), or a list of them, one per leading
    axis (``["layer", "expert"]``: Megatron's experts stacked ``[layers, experts, ...]``)."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or len(set(map(str, names))) != len(names) or \
            not all(isinstance(n, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names):
        raise RuleError(f"{where}: 'unstack' names the variable the leading index binds (e.g. 'layer'), or a list "
                        "of distinct ones for several leading axes (e.g. ['layer', 'expert']); fix the rules file")
    return tuple(names)


def _rule(i: int, obj: Any, source: str, params: Sequence[str], numbers: Sequence[Numbering] = ()) -> Rule:
    pattern = obj.get("match") if isinstance(obj, dict) else None
    where = f"{source}: rules[{i}]" + (f" (match {pattern!r})" if isinstance(pattern, str) else "")
    if not isinstance(obj, dict):
        raise RuleError(f"{where}: a rule is a JSON object; fix the rules file")
    unknown = sorted(set(obj) - _RULE_KEYS)
    if unknown:
        raise RuleError(f"{where}: unknown keys {unknown} (known: {sorted(_RULE_KEYS)}); fix the rules file")
    if not isinstance(pattern, str) or not pattern:
        raise RuleError(f"{where}: needs a 'match' regex (a string); fix the rules file")
    try:
        match = re.compile(pattern)
    except re.error as e:
        raise RuleError(f"{where}: 'match' is not a regex ({e}); fix the rules file") from None
    drop = obj.get("drop")
    if drop is not None:
        if not isinstance(drop, str) or not drop or set(obj) - {"match", "drop", "comment"}:
            raise RuleError(f"{where}: 'drop' is the reason (a string) the tensor is not written, alone with "
                            "'match'; fix the rules file")
        return Rule(i, where, match, drop=drop)
    if "to" not in obj:
        raise RuleError(f"{where}: needs 'to' (the output name) or 'drop' (why it is not written); fix the rules file")
    to = _templates(obj["to"], where)
    tp = obj.get("tp")
    if tp is not None and tp not in TP_VALUES:
        raise RuleError(f"{where}: 'tp' must be one of {', '.join(TP_VALUES)}, not {tp!r}; fix the rules file")
    if tp == "vocab" and "vocab_size" not in params or tp == "row_bias" and "parallel_residual" not in params:
        need = "vocab_size" if tp == "vocab" else "parallel_residual"
        raise RuleError(f"{where}: 'tp': {tp!r} needs the param {need!r} declared in 'params'; fix the rules file")
    unstack = _unstack(obj.get("unstack"), where)
    split = None
    if "split" in obj:
        s = obj["split"]
        if not isinstance(s, dict) or set(s) - {"dim", "sizes", "groups"} or not isinstance(s.get("sizes"), list):
            raise RuleError(f"{where}: 'split' is {{'dim': D, 'sizes': [...], 'groups': G (optional)}}; "
                            "fix the rules file")
        sizes = tuple(_size(v, where, "a split size", params) for v in s["sizes"])
        groups = _size(s["groups"], where, "'groups'", params) if s.get("groups") is not None else None
        split = Split(_int(s.get("dim", 0), where, "split 'dim'"), sizes, groups)
        if len(sizes) != len(to):
            raise RuleError(f"{where}: a split into {len(sizes)} parts needs {len(sizes)} 'to' names, "
                            f"not {len(to)}; fix the rules file")
    elif len(to) != 1:
        raise RuleError(f"{where}: {len(to)} 'to' names without a 'split'; fix the rules file")
    concat = None
    if "concat" in obj:
        c = obj["concat"]
        if not isinstance(c, dict) or set(c) - {"dim", "with"} or not isinstance(c.get("with"), list) or \
                not c["with"] or not all(isinstance(w, str) and w for w in c["with"]):
            raise RuleError(f"{where}: 'concat' is {{'dim': D, 'with': [source name templates]}}; fix the rules file")
        concat = Concat(_int(c.get("dim", 0), where, "concat 'dim'"), tuple(c["with"]))
    transpose = None
    if "transpose" in obj:
        perm = obj["transpose"]
        if not isinstance(perm, list) or sorted(perm) != list(range(len(perm))) or len(perm) < 2 or \
                not all(type(p) is int for p in perm):
            raise RuleError(f"{where}: 'transpose' is a permutation of the dims, e.g. [1, 0]; fix the rules file")
        transpose = tuple(perm)
    # a numbered variable is known to a rule whose match has the group it numbers
    numbered = {n.var for n in numbers if n.group in match.groupindex}
    known = set(match.groupindex) | set(params) | set(unstack or ()) | numbered
    for t in to + (concat.with_ if concat else ()):
        missing = [v for v in _VAR.findall(t) if v not in known]
        if missing:
            raise RuleError(f"{where}: {t!r} uses {missing}, which neither the match's named groups, "
                            f"'unstack', 'params' nor 'number' (on a group the match has) define; fix the rules file")
    return Rule(i, where, match, to, unstack, split, transpose, concat, tp)


def parse_rules(obj: Any, source: str) -> RuleSet:
    """A rules file's JSON value as a :class:`RuleSet`; :class:`RuleError` naming ``source`` and the rule."""
    if not isinstance(obj, dict) or not isinstance(obj.get("rules"), list):
        raise RuleError(f"{source}: a rules file is a JSON object with a 'rules' list; fix the rules file")
    unknown = sorted(set(obj) - _TOP_KEYS)
    if unknown:
        raise RuleError(f"{source}: unknown keys {unknown} (known: {sorted(_TOP_KEYS)}); fix the rules file")
    if obj.get("format", FORMAT) != FORMAT:
        raise RuleError(f"{source}: rules format {obj.get('format')!r}; this hf-ckpt reads format {FORMAT}")
    params = obj.get("params", [])
    if not isinstance(params, list) or not all(isinstance(p, str) and re.fullmatch(r"[A-Za-z_]\w*", p)
                                               for p in params):
        raise RuleError(f"{source}: 'params' is a list of names (identifiers); fix the rules file")
    unmatched = obj.get("unmatched", "refuse")
    if unmatched not in ("refuse", "keep"):
        raise RuleError(f"{source}: 'unmatched' is 'refuse' or 'keep', not {unmatched!r}; fix the rules file")
    text = {k: obj.get(k) if isinstance(obj.get(k), str) else None for k in ("engine", "family", "reference")}
    numbers = _numbers(obj.get("number"), source, params)
    rules = tuple(_rule(i, r, source, params, numbers) for i, r in enumerate(obj["rules"]))
    return RuleSet(source, text["engine"], text["family"], text["reference"], tuple(params), unmatched, rules,
                   numbers)


def load_rules(path: str) -> RuleSet:
    """The rules file at ``path`` (a regular file of at most 1 MiB), parsed and checked."""
    try:
        with guards.open_regular(path, limit=_MAX_BYTES, what="the rules file") as fh:
            raw = fh.read(_MAX_BYTES + 1)
    except OSError as e:
        raise RuleError(f"{path}: cannot read the rules file ({e.strerror})") from None
    if len(raw) > _MAX_BYTES:
        raise RuleError(f"{path}: a rules file larger than {_MAX_BYTES} bytes")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RuleError(f"{path}: not JSON ({e}); fix the rules file") from None
    return parse_rules(obj, path)


def rule_list(rules: RuleSet) -> List[str]:
    """One line per rule (what ``inspect`` could show)."""
    return [r.where for r in rules.rules]
