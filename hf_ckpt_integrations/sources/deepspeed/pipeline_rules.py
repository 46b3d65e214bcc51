"""The rules a DeepSpeed pipeline save's names and TP merges follow (:mod:`.pipeline`): the built-in
conversion rules files (``rules/<model_type>.json``, docs/conversions.md) or the user's, and what the
source supplies to them (the config's ``use_parallel_residual``; a universal checkpoint's one-copy
row-parallel bias, a TP override)."""

import os
from typing import Any, Dict, List, Optional, Tuple

from ...convert import RuleSet, load_rules
from ...convert.tp_rules import Rule
from ...errors import CheckpointError, short_repr
from ..protocol import PlanContext

__all__ = ["ROW_BIAS_NOTE", "builtin_types", "builtin_rules", "choose_rules", "universal_tp_rules",
           "parallel_residual"]

_RULES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rules")
# A row-parallel bias under the parallel residual is added by every TP rank, so the model's bias is
# tp x the parameter: no single universal value keeps the function at every TP size (the loader copies
# it to each rank). The parameter as trained is written; the user is told what changes.
ROW_BIAS_NOTE = ("{n} row-parallel biases ({first}, ...) are written as each TP rank holds them (one copy, the "
                 "others checked equal); with the parallel residual ({said}; GPT-NeoX's gpt_j_residual) every TP "
                 "rank adds its copy, so the model adds tp x this bias: resumed at TP {tp} the model computes what "
                 "the saved one did; at another TP size those biases count (new tp)/{tp} times as much "
                 "(docs: 'Pipeline parallelism')")


def builtin_types() -> List[str]:
    """The HF ``model_type`` values with a built-in rules file (``rules/<model_type>.json``)."""
    return sorted(n[:-5] for n in os.listdir(_RULES_DIR) if n.endswith(".json"))


def builtin_rules(model_type: Any) -> Optional[RuleSet]:
    """The rules shipped for an HF ``model_type``; None when there are none."""
    if not isinstance(model_type, str) or model_type not in builtin_types():
        return None
    return load_rules(os.path.join(_RULES_DIR, f"{model_type}.json"))


def universal_tp_rules(rules: RuleSet, names: List[str]) -> Dict[str, Rule]:
    """The TP rule, overriding the rules file's, of each of ``names`` whose rule says ``row_bias``, in a
    universal checkpoint: the parameter every TP rank's module holds (one copy, the others checked
    equal; the loader copies it to every rank), never the HF export's sum."""
    out = {}
    for n in names:
        found = rules.find(n)
        if found is not None and found[0].tp == "row_bias":
            out[n] = Rule(None, f"{found[0].where}: row_bias, universal checkpoint: one copy (each TP rank's parameter)")
    return out


def parallel_residual(ctx: PlanContext) -> bool:
    """The config's ``use_parallel_residual``: whether the TP ranks' row-parallel biases sum (the rules'
    ``row_bias``); refused when the config does not say."""
    value = ctx.config.get("use_parallel_residual") if ctx.config_dir else None
    if not isinstance(value, bool):
        where = f"{ctx.config_dir}/config.json" if ctx.config_dir else "the checkpoint"
        raise CheckpointError(f"{where}: records no use_parallel_residual (true/false), which decides how the TP "
                              "ranks' row-parallel biases merge (their sum, or one copy); pass --config DIR with the "
                              "model's config.json")
    return value


def choose_rules(ctx: PlanContext) -> Tuple[Optional[RuleSet], Optional[str]]:
    user = ctx.option("name_map")
    if user is not None:
        return user, f"names from {user.source}"
    if ctx.config_dir is None:
        return None, ("no config.json: the native pipeline names ('<layer>.<name>') are exported, merged over TP; "
                      "pass --config DIR (an HF config of a model type with built-in rules: "
                      f"{', '.join(builtin_types())}) or --source-option name_map=FILE for HF names")
    model_type = ctx.config.get("model_type")
    m = builtin_rules(model_type)
    if m is None:
        raise CheckpointError(f"{ctx.config_dir}/config.json: model_type {short_repr(model_type)} has no built-in "
                              f"pipeline rules (rules: {', '.join(builtin_types())}); pass --source-option "
                              "name_map=FILE, a rules file mapping the pipeline's names to this model's (docs: "
                              "'Pipeline parallelism')")
    return m, f"names from {m.source}"
