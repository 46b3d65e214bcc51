"""The conversion layer: name and transform rules as data (:mod:`.rules`, JSON files beside their
sources) run as plan data (:mod:`.execute`) by the plan's one box-selection helper
(:func:`~..plan.select_box`). See ``docs/conversions.md``."""

from .execute import TRANSPOSE_LIMIT, Converted, apply_rules, merge_tp, target_names
from .rules import FORMAT, TP_VALUES, Concat, Numbering, Rule, RuleError, RuleSet, Split, fill, load_rules, parse_rules

__all__ = ["FORMAT", "TP_VALUES", "TRANSPOSE_LIMIT", "Concat", "Converted", "Numbering", "Rule", "RuleError", "RuleSet",
           "Split", "apply_rules", "fill", "load_rules", "merge_tp", "parse_rules", "target_names"]
