"""How model-parallel slices of one parameter merge back into the full tensor.

A rule is a concatenation dim (0 or 1) or ``REPLICATED`` (every rank holds the whole tensor:
take one copy, check the others agree, never concatenate). For each parameter the first of
these that speaks decides (the ``source`` is reported by ``inspect``):

1. ``universal_checkpoint_info`` recorded in the checkpoint (DeepSpeed AutoTP writes it);
2. the HF config's tensor-parallel plan (``base_model_tp_plan`` and the model's ``_tp_plan``:
   colwise -> dim 0, rowwise -> dim 1 for weights, bias replicated; rowwise on an embedding
   shards the vocabulary, dim 0);
3. user rules, ``PATTERN=0|1|replicated`` (``fnmatch`` on the full parameter name);
4. the shapes: a slice already as large as the full tensor (from the config) is replicated;
5. the bytes: slices all equal -> replicated. Anything else is refused with the ``--tp-rule``
   to pass — a dimension is never guessed.
"""

import fnmatch
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import LayoutError
from ..plan import TensorPlan, select_box

__all__ = ["REPLICATED", "Rule", "parse_user_rule", "rule_from_universal_info", "rule_from_hf_plan",
           "rule_from_user", "rule_from_tp", "merge_slices", "resolve_rule", "all_identical", "concat_shape"]

REPLICATED = "replicated"


@dataclass(frozen=True)
class Rule:
    """How the TP slices of one tensor merge: concatenated along ``dim``, one copy (``dim`` None: the
    others checked equal) or, with ``reduce="sum"``, added element-wise in rank order. ``source``:
    where the rule came from (``inspect`` shows it); ``keep_rows``: vocabulary padding to drop."""

    dim: Optional[int]  # None = replicated (or summed, with reduce)
    source: str
    keep_rows: Optional[int] = None  # vocabulary padding to drop after merging
    reduce: Optional[str] = None  # "sum": every slice is the whole tensor and the output is their sum

    @property
    def replicated(self) -> bool:
        return self.dim is None and self.reduce is None


def rule_from_tp(tp: Optional[str], source: str, params: Mapping[str, Any]) -> Optional[Rule]:
    """A rules file's ``tp`` value (:data:`.rules.TP_VALUES`) as a :class:`Rule`; None for no ``tp``.
    ``vocab`` keeps the ``vocab_size`` param's rows; ``row_bias`` sums when the ``parallel_residual``
    param is true, else keeps one copy."""
    if tp is None:
        return None
    mode = tp
    if tp == "row_bias":
        mode = "sum" if params.get("parallel_residual") else REPLICATED
    text = f"{source}: tp {mode}"
    if mode == "sum":
        return Rule(None, text, reduce="sum")
    if mode == REPLICATED:
        return Rule(None, text)
    if mode == "vocab":
        vocab = params.get("vocab_size")
        if type(vocab) is not int or vocab <= 0:
            raise LayoutError(f"{source}: needs the param 'vocab_size' as a positive integer, the source gave "
                              f"{vocab!r}; please report this with `hf-ckpt inspect --json`")
        return Rule(0, text, vocab)
    return Rule(int(mode), text)


def merge_slices(name: str, slices: Sequence[TensorPlan], rule: Optional[Rule], fix: str) -> TensorPlan:
    """The TP slices of one tensor (rank order) merged by ``rule`` into one plan named ``name``: the one
    merge every source's TP slices go through. One slice: itself, renamed. A concatenation keeps each
    slice's module-copy check part by part, and drops vocabulary padding (``keep_rows``). ``fix``: what
    the user does when the slices do not fit the rule (ends every refusal)."""
    first = slices[0]
    if len(slices) == 1:
        if rule is None or rule.keep_rows is None or not first.shape or first.shape[0] <= rule.keep_rows:
            return replace(first, name=name)
        return _keep_rows(name, first, rule, fix)
    if rule is None:
        raise LayoutError(f"{name}: {len(slices)} TP slices and no rule says how they merge; {fix}")
    shapes = [tuple(s.shape) for s in slices]
    if rule.dim is None:
        what = "a sum of the slices" if rule.reduce == "sum" else "replicated"
        if any(s != shapes[0] for s in shapes):
            raise LayoutError(f"{name}: merged as {what} ({rule.source}), but its {len(slices)} TP slices hold "
                              f"shapes {[list(s) for s in shapes]}; {fix}")
        if rule.reduce == "sum":
            # e.g. a row-parallel bias under the parallel residual: each rank adds its bias before the
            # all-reduce, so the model's bias is the sum over ranks (added in rank order by the writer).
            return TensorPlan(name, first.shape, first.src_dtype, [s.parts[0] for s in slices], kind=first.kind,
                              part_shapes=[shapes[0]] * len(slices), reduce="sum", rule=rule.source)
        return TensorPlan(name, first.shape, first.src_dtype, first.parts, kind=first.kind, rule=rule.source,
                          replicas=[s.parts[0] for s in slices[1:]], module_check=first.module_check)
    try:
        shape = concat_shape(shapes, rule.dim)
    except ValueError as e:
        raise LayoutError(f"{name}: {e} (rule from {rule.source}); {fix}") from None
    keep = rule.keep_rows if rule.keep_rows is not None and shape[0] > rule.keep_rows else None
    if keep is not None:
        shape = (keep,) + shape[1:]
    check = None
    if all(s.module_check is not None for s in slices):  # part by part, as the slices were saved
        check = ([s.module_check[0][0] for s in slices], [s.module_check[1][0] for s in slices])
    return TensorPlan(name, shape, first.src_dtype, [s.parts[0] for s in slices], kind=first.kind, cat_dim=rule.dim,
                      part_shapes=shapes, keep_rows=keep, rule=rule.source, module_check=check)


def _keep_rows(name: str, t: TensorPlan, rule: Rule, fix: str) -> TensorPlan:
    """One tensor given whole (a source that placed its TP slices itself: Megatron's global tensors) cut
    to its first ``rule.keep_rows`` rows: a box of its chunks (a dim-0 byte copy, nothing assembled). A
    plan that already merges, sums or checks copies is refused rather than written with its padding."""
    assert rule.keep_rows is not None
    if t.keep_rows is not None or t.elem_range is not None or t.reduce is not None or t.replicas or t.tied_copies:
        raise LayoutError(f"{name}: {rule.source} drops vocabulary padding to {rule.keep_rows} rows, but the "
                          f"tensor is already a merge of several pieces; {fix}")
    shape = (rule.keep_rows,) + tuple(t.shape[1:])
    chunks = select_box(t.assembled_shape(), t.placement(), (0,) * len(shape), shape)
    return TensorPlan.from_chunks(name, shape, t.src_dtype, chunks, kind=t.kind, rule=rule.source)


def parse_user_rule(text: str) -> Tuple[str, Optional[int]]:
    """``'model.embed_tokens.weight=0'`` -> ``('model.embed_tokens.weight', 0)``; ``=replicated`` -> None."""
    pattern, sep, value = text.rpartition("=")
    if not sep or not pattern or value not in ("0", "1", REPLICATED):
        raise ValueError(f"bad --tp-rule {text!r}; write PATTERN=0, PATTERN=1 or PATTERN=replicated")
    return pattern, None if value == REPLICATED else int(value)


def rule_from_user(name: str, rules: Sequence[Tuple[str, Optional[int]]]) -> Optional[Rule]:
    for pattern, dim in rules:
        if fnmatch.fnmatchcase(name, pattern):
            return Rule(dim, f"user rule {pattern}={REPLICATED if dim is None else dim}")
    return None


def _matches(patterns, name) -> bool:
    return any(re.search(p, name) for p in patterns or ())


def rule_from_universal_info(name: str, info: dict) -> Optional[Rule]:
    """DeepSpeed's own record (``deepspeed/checkpoint/constants.py`` keys); cat dim 0 by default."""
    if not isinstance(info, dict):
        return None
    src = "universal_checkpoint_info"
    if _matches(info.get("tp_replicated_parameter_patterns"), name):
        return Rule(None, src)
    if _matches(info.get("parameter_with_row_parallelism_patterns"), name):
        return Rule(1, src)
    if _matches(info.get("vocabulary_parameter_patterns"), name):
        vocab = info.get("original_vocab_size")
        return Rule(0, src, int(vocab) if isinstance(vocab, int) else None)
    return Rule(0, src)


def _plan_pattern_matches(pattern: str, module_path: str) -> bool:
    # HF plan keys are module paths where '*' stands for one path component (a layer index).
    regex = "^" + re.escape(pattern).replace(r"\*", r"[^.]+") + "$"
    return re.match(regex, module_path) is not None


def rule_from_hf_plan(name: str, plans: Dict[str, str], embeddings: Sequence[str] = ()) -> Optional[Rule]:
    """``plans``: module-path pattern -> style, with the base-model prefix already applied."""
    module_path, _, leaf = name.rpartition(".")
    for pattern, style in plans.items():
        if not _plan_pattern_matches(pattern, module_path):
            continue
        src = f"HF tp plan {pattern}: {style}"
        if style.startswith("colwise") or style in ("packed_colwise", "local_colwise"):
            return Rule(0, src)
        if style.startswith("rowwise") or style in ("packed_rowwise", "local_rowwise"):
            if module_path in embeddings:
                return Rule(0, src)  # an embedding sharded "rowwise" splits the vocabulary
            return Rule(1, src) if leaf == "weight" else Rule(None, src)
        if style.startswith("replicate") or style in ("sequence_parallel", "gather"):
            return Rule(None, src)
        return None  # a style we do not know: let later sources decide
    return None


def hf_plans_for(config_dir: str, cfg: Optional[dict] = None):
    """The HF tp plans (prefixed to full module paths), full parameter shapes and embedding module
    paths of the model ``config_dir`` describes, built on the meta device. None without transformers,
    or for a ``model_type`` transformers does not know: code named by ``auto_map`` is never imported
    (the other rules, or ``--tp-rule``, decide then). CheckpointError for a config.json that is not
    a JSON object or that transformers cannot build a model from. ``cfg``: that config.json, already
    read (an export's :class:`~.protocol.PlanContext` reads it once)."""
    from .hub_layout import meta_model

    model = meta_model(config_dir, cfg=cfg)
    if model is None:
        return None
    import torch

    cfg = model.config
    plans: Dict[str, str] = {}
    base = getattr(model, "base_model_prefix", "")
    for key, style in (getattr(cfg, "base_model_tp_plan", None) or {}).items():
        plans[f"{base}.{key}" if base and hasattr(model, base) else key] = style
    for key, style in (getattr(type(model), "_tp_plan", None) or {}).items():
        plans[key] = style
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    embeddings = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding)]
    return plans, shapes, embeddings


def all_identical(slices: Mapping[str, Sequence[TensorPlan]]) -> bool:
    """Every tensor's slices (name -> slices) of one shape and byte-identical (read from their files)."""
    from ..assemble import check_replicas
    from ..mapped_files import MappedFiles

    with MappedFiles() as files:
        for n, ss in slices.items():
            if any(s.shape != ss[0].shape for s in ss):
                return False
            try:
                check_replicas(TensorPlan(n, ss[0].shape, ss[0].src_dtype, ss[0].parts,
                                          replicas=[s.parts[0] for s in ss[1:]]), files)
            except LayoutError:
                return False
    return True


def resolve_rule(name: str, ss: Sequence[TensorPlan], info: Optional[dict], hf_plans: Dict[str, str],
                 embeddings: Sequence[str], user_rules: Sequence[Tuple[str, Optional[int]]],
                 full: Mapping[str, Tuple[int, ...]]) -> Rule:
    """The rule for ``name``'s model-parallel slices ``ss``: the first of the module docstring's list that
    speaks; :class:`LayoutError` naming the ``--tp-rule`` to pass when none does."""
    rule = rule_from_universal_info(name, info) if info is not None else None
    rule = rule or (rule_from_hf_plan(name, hf_plans, embeddings) if hf_plans else None)
    rule = rule or rule_from_user(name, user_rules)
    if rule is None and name in full and all(s.shape == full[name] for s in ss):
        rule = Rule(None, "each slice has the full shape from config.json")
    if rule is None and all_identical({name: ss}):
        rule = Rule(None, "slices are byte-identical")
    if rule is None:
        hint = ""
        if name in full:
            dims = [d for d in range(len(full[name])) if len(ss[0].shape) == len(full[name]) and
                    sum(s.shape[d] for s in ss) == full[name][d]]
            if len(dims) == 1:
                hint = f" (config.json's full shape {list(full[name])} suggests dim {dims[0]})"
        raise LayoutError(f"{name}: its {len(ss)} model-parallel slices {[list(s.shape) for s in ss]} differ and no "
                          "rule covers it (no universal_checkpoint_info, not in the HF tp plan); pass "
                          f"--tp-rule '{name}=0' (split rows), '=1' (split columns) or '=replicated'{hint}")
    return rule


def concat_shape(shapes: Sequence[Tuple[int, ...]], dim: int) -> Tuple[int, ...]:
    first = list(shapes[0])
    if any(len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != dim)
           for s in shapes):
        raise ValueError(f"slices {shapes} do not concatenate along dim {dim}")
    first[dim] = sum(s[dim] for s in shapes)
    return tuple(first)
