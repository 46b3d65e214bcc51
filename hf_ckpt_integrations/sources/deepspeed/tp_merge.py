"""Several model-parallel ranks' plans merged into one: a replica axis (every rank a full copy,
one used and the others checked) or tensor parallelism (slices concatenated by the rules of
:mod:`..tp_rules`)."""

from typing import Optional

from ...errors import LayoutError
from ...plan import ExportPlan, TensorPlan
from ..protocol import SourceOption
from ...convert.tp_rules import Rule, concat_shape, hf_plans_for, rule_from_hf_plan, rule_from_universal_info, rule_from_user

__all__ = ["TP_RULES_OPTION", "merge_model_parallel", "all_identical", "resolve_rule"]

# The --tp-rule option, declared once for the ZeRO and the pipeline readers (both take it).
TP_RULES_OPTION = SourceOption("tp_rules", "PATTERN=0|1|replicated: how to merge model-parallel slices of parameters "
                               "matching PATTERN that neither the checkpoint nor the HF config describes (the CLI's "
                               "--tp-rule)", repeated=True, default=[])


def merge_model_parallel(tag_dir, per_mp, config_dir, user_rules, config: Optional[dict] = None) -> ExportPlan:
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

    def replicated(t_slices, rule):
        first = t_slices[0]
        if any(s.shape != first.shape for s in t_slices):
            raise LayoutError(f"{first.name}: rule '{rule.source}' says replicated but the {mp} model-parallel "
                              f"ranks hold shapes {[list(s.shape) for s in t_slices]}; pass --tp-rule to fix")
        return TensorPlan(first.name, first.shape, first.src_dtype, first.parts, kind=first.kind, rule=rule.source,
                          replicas=[s.parts[0] for s in t_slices[1:]], module_check=first.module_check)

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
        if rule.replicated:
            merged.append(replicated(ss, rule))
            continue
        shapes = [s.shape for s in ss]
        try:
            shape = concat_shape(shapes, rule.dim)
        except ValueError as e:
            raise LayoutError(f"{n}: {e} (rule from {rule.source}); pass --tp-rule '{n}=0|1|replicated'") from None
        keep = None
        if rule.keep_rows is not None and shape[0] > rule.keep_rows:
            keep = rule.keep_rows
            padding[n] = (shape[0], keep)
            shape = (keep,) + shape[1:]
        if n in full and full[n] != shape:
            raise LayoutError(f"{n}: merging {mp} slices {[list(s) for s in shapes]} by '{rule.source}' gives "
                              f"{list(shape)}, but config.json's model has {list(full[n])}; pass --tp-rule "
                              f"'{n}=0|1|replicated' with the right split")
        check = None
        if all(s.module_check is not None for s in ss):  # part by part, as the slices were saved
            check = ([s.module_check[0][0] for s in ss], [s.module_check[1][0] for s in ss])
        merged.append(TensorPlan(n, shape, ss[0].src_dtype, [s.parts[0] for s in ss], kind=ss[0].kind,
                                 cat_dim=rule.dim, part_shapes=shapes, keep_rows=keep, rule=rule.source,
                                 module_check=check))
    plan = plans[0]
    plan.tensors = merged
    plan.detail.update(mp_axis=axis, mp_axis_reason=reason)
    plan.padding_removed = padding
    plan.files = sorted({f for p in plans for f in p.files})
    return plan


def all_identical(slices) -> bool:
    from ...assemble import check_replicas
    from ...mapped_files import MappedFiles

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


def resolve_rule(name, ss, info, hf_plans, embeddings, user_rules, full) -> Rule:
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
