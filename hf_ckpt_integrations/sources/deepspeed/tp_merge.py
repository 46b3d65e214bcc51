"""Several model-parallel ranks' plans merged into one: a replica axis (every rank a full copy,
one used and the others checked) or tensor parallelism (each parameter's slices merged by
:func:`...convert.tp_rules.merge_slices`, by the rule :func:`...convert.tp_rules.resolve_rule` finds)."""

from typing import Optional, Sequence, Tuple

from ...errors import LayoutError
from ...plan import ExportPlan
from ..protocol import SourceOption
from ...convert.tp_rules import Rule, all_identical, concat_shape, hf_plans_for, merge_slices, resolve_rule

__all__ = ["TP_RULES_OPTION", "merge_model_parallel"]

# The --tp-rule option, declared once for the ZeRO and the pipeline readers (both take it).
TP_RULES_OPTION = SourceOption("tp_rules", "PATTERN=0|1|replicated: how to merge model-parallel slices of parameters "
                               "matching PATTERN that neither the checkpoint nor the HF config describes (the CLI's "
                               "--tp-rule)", repeated=True, default=[])


def merge_model_parallel(tag_dir: str, per_mp: Sequence[Tuple[ExportPlan, Optional[dict]]], config_dir: Optional[str],
                         user_rules: Sequence[Tuple[str, Optional[int]]], config: Optional[dict] = None) -> ExportPlan:
    """Merge the plans of several model-parallel ranks: a replica axis (every rank a full
    copy, one used and the others checked) or tensor parallelism (slices merged by rules).
    ``config``: ``config_dir``'s config.json as already read (the export's one read), else read here."""
    plans = [p for p, _ in per_mp]
    info = per_mp[0][1]
    names = [t.name for t in plans[0].tensors]
    for mp, p in enumerate(plans[1:], 1):
        if [t.name for t in p.tensors] != names:
            raise LayoutError(f"{tag_dir}: model-parallel rank {mp} holds other parameters than rank 0 "
                              f"({sorted(set(t.name for t in p.tensors) ^ set(names))[:3]}...); files from "
                              "different saves are mixed: copy one save's tag directory again")
    slices = {n: [p.tensors[i] for p in plans] for i, n in enumerate(names)}
    hf = hf_plans_for(config_dir, config) if config_dir else None
    hf_plans, full, embeddings = hf if hf else ({}, {}, [])
    mp = len(plans)

    if info is None and full and all(s.shape == full.get(n) for n, ss in slices.items() for s in ss):
        axis, reason = "replica", ("every model-parallel rank records every parameter at its full shape "
                                   "(from config.json): the axis holds replicas, e.g. sequence parallelism")
        rules = {n: Rule(None, "replica axis") for n in names}
    elif info is None and not full and all_identical(slices):
        axis, reason = "replica", "every model-parallel rank holds byte-identical tensors: the axis holds replicas"
        rules = {n: Rule(None, "replica axis") for n in names}
    else:
        axis = "tp"
        reason = ("universal_checkpoint_info recorded in the checkpoint" if info is not None else
                  "model-parallel ranks hold slices smaller than the full shapes")
        rules = {n: resolve_rule(n, ss, info, hf_plans, embeddings, user_rules, full) for n, ss in slices.items()}

    merged = []
    padding = {}
    for n in names:
        rule, ss = rules[n], slices[n]
        t = merge_slices(n, ss, rule, f"pass --tp-rule '{n}=0|1|replicated'")
        if t.keep_rows is not None:
            padding[n] = (concat_shape([s.shape for s in ss], 0)[0], t.keep_rows)
        if not rule.replicated and n in full and full[n] != t.shape:
            raise LayoutError(f"{n}: merging {mp} slices {[list(s.shape) for s in ss]} by '{rule.source}' gives "
                              f"{list(t.shape)}, but config.json's model has {list(full[n])}; pass --tp-rule "
                              f"'{n}=0|1|replicated' with the right split")
        merged.append(t)
    plan = plans[0]
    plan.tensors = merged
    plan.detail.update(mp_axis=axis, mp_axis_reason=reason)
    plan.padding_removed = padding
    plan.files = sorted({f for p in plans for f in p.files})
    return plan
