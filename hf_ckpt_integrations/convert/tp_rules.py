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
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["REPLICATED", "Rule", "parse_user_rule", "rule_from_universal_info", "rule_from_hf_plan",
           "rule_from_user"]

REPLICATED = "replicated"


@dataclass(frozen=True)
class Rule:
    dim: Optional[int]  # None = replicated
    source: str
    keep_rows: Optional[int] = None  # vocabulary padding to drop after merging

    @property
    def replicated(self) -> bool:
        return self.dim is None


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


def concat_shape(shapes: List[Tuple[int, ...]], dim: int) -> Tuple[int, ...]:
    first = list(shapes[0])
    if any(len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != dim)
           for s in shapes):
        raise ValueError(f"slices {shapes} do not concatenate along dim {dim}")
    first[dim] = sum(s[dim] for s in shapes)
    return tuple(first)
