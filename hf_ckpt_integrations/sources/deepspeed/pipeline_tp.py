"""How the TP slices of one pipeline parameter merge (:mod:`.pipeline`'s rules, the first that speaks):
the checkpoint's ``universal_checkpoint_info``; the name map's ``tp`` (``row_bias``: the sum over TP
ranks under the parallel residual, else one copy; in a universal checkpoint always one copy);
``--tp-rule``; byte-identical slices (one copy). Anything else is refused with the rule to pass."""

from ...errors import CheckpointError, LayoutError
from ...plan import TensorPlan
from ...convert.tp_rules import REPLICATED, Rule, concat_shape, rule_from_universal_info, rule_from_user
from .name_map import ROW_BIAS
from .tp_merge import all_identical

__all__ = ["UNIVERSAL_ROW_BIAS", "ROW_BIAS_NOTE", "parallel_residual", "merge_slices"]

# A name map's row_bias in a universal checkpoint: the parameter each rank holds, one copy (see
# pipeline.universal_plan).
UNIVERSAL_ROW_BIAS = "row_bias:universal"

# A row-parallel bias under the parallel residual is added by every TP rank, so the model's bias is
# tp x the parameter: no single universal value keeps the function at every TP size (the loader copies
# it to each rank). The parameter as trained is written; the user is told what changes.
ROW_BIAS_NOTE = ("{n} row-parallel biases ({first}, ...) are written as each TP rank holds them (one copy, the "
                 "others checked equal); with the parallel residual ({said}; GPT-NeoX's gpt_j_residual) every TP "
                 "rank adds its copy, so the model adds tp x this bias: resumed at TP {tp} the model computes what "
                 "the saved one did; at another TP size those biases count (new tp)/{tp} times as much "
                 "(docs: 'Pipeline parallelism')")


def parallel_residual(ctx) -> bool:
    value = ctx.config.get("use_parallel_residual") if ctx.config_dir else None
    if not isinstance(value, bool):
        where = f"{ctx.config_dir}/config.json" if ctx.config_dir else "the checkpoint"
        raise CheckpointError(f"{where}: records no use_parallel_residual (true/false), which decides how the TP "
                              "ranks' row-parallel biases merge (their sum, or one copy); pass --config DIR with the "
                              "model's config.json")
    return value


def _rule_for(hf, native, slices, tp_value, parallel_residual, info, user_rules, name_map):
    if tp_value == UNIVERSAL_ROW_BIAS:
        return Rule(None, f"{name_map.source}: row_bias, universal checkpoint: one copy (each TP rank's parameter)"), None
    if info is not None:
        rule = rule_from_universal_info(native, info)
        if rule is not None:
            return rule, None
    if tp_value == ROW_BIAS:
        if parallel_residual:
            return None, "sum"
        return Rule(None, f"{name_map.source}: row_bias, use_parallel_residual=false: one copy"), None
    if tp_value is not None:
        dim = None if tp_value == REPLICATED else int(tp_value)
        return Rule(dim, f"{name_map.source}: {tp_value}"), None
    rule = rule_from_user(hf, user_rules) or (rule_from_user(native, user_rules) if native != hf else None)
    if rule is None and all_identical({hf: slices}):
        rule = Rule(None, "slices are byte-identical")
    if rule is None:
        raise LayoutError(f"{native}: its {len(slices)} tensor-parallel slices {[list(s.shape) for s in slices]} "
                          "differ and no rule covers it (no universal_checkpoint_info, no name map entry); pass "
                          f"--tp-rule '{hf}=0' (split rows), '=1' (split columns) or '=replicated'")
    return rule, None


def merge_slices(hf, native, slices, tp_value, parallel_residual, info, user_rules, name_map) -> TensorPlan:
    first = slices[0]
    rule, reduce = _rule_for(hf, native, slices, tp_value, parallel_residual, info, user_rules, name_map)
    shapes = [s.shape for s in slices]
    if reduce == "sum" or (rule is not None and rule.replicated):
        if any(s != first.shape for s in shapes):
            what = "row_bias (every rank holds the whole bias)" if reduce else f"replicated ({rule.source})"
            raise LayoutError(f"{native}: {what}, but the TP ranks hold shapes {[list(s) for s in shapes]}; fix the "
                              "name map or pass --tp-rule")
        if reduce == "sum":
            # Parallel residual: each rank adds its bias before the all-reduce, so the model's bias is the
            # sum over ranks (summed in rank order in fp32, as the all-reduce of the outputs adds them).
            return TensorPlan(hf, first.shape, first.src_dtype, [s.parts[0] for s in slices], kind=first.kind,
                              part_shapes=[tuple(first.shape)] * len(slices), reduce="sum",
                              rule=f"{name_map.source}: row_bias, use_parallel_residual=true: sum over TP ranks")
        return TensorPlan(hf, first.shape, first.src_dtype, first.parts, kind=first.kind, rule=rule.source,
                          replicas=[s.parts[0] for s in slices[1:]], module_check=first.module_check)
    try:
        shape = concat_shape(shapes, rule.dim)
    except ValueError as e:
        raise LayoutError(f"{native}: {e} (rule from {rule.source}); fix the name map or pass --tp-rule") from None
    keep = rule.keep_rows if rule.keep_rows is not None and shape[0] > rule.keep_rows else None
    if keep is not None:
        shape = (keep,) + shape[1:]
    check = None
    if all(s.module_check is not None for s in slices):
        check = ([s.module_check[0][0] for s in slices], [s.module_check[1][0] for s in slices])
    return TensorPlan(hf, shape, first.src_dtype, [s.parts[0] for s in slices], kind=first.kind, cat_dim=rule.dim,
                      part_shapes=shapes, keep_rows=keep, rule=rule.source, module_check=check)
