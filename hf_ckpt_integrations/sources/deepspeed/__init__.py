"""DeepSpeed ZeRO-1/2/3 checkpoints on disk -> :class:`~..plan.ExportPlan`.

Reads only pickled metadata (through :mod:`..safe_load`, never DeepSpeed or torch); tensors
stay :class:`~..safe_load.TensorRef` byte ranges until the writer copies them. Files are
placed by the data-parallel rank in their name read as a number (never by sort order), and
ZeRO-1/2 placements are then proven against the offsets each file records
(``param_slice_mappings``).
"""

import math
import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional

from ... import guards, safe_load
from ...errors import CheckpointError, LayoutError
from ...plan import ExportPlan, Piece, TensorPlan, dtype_from_name
from . import partitions as layout
from ..tp_rules import Rule, concat_shape, hf_plans_for, parse_user_rule, rule_from_hf_plan, rule_from_universal_info, rule_from_user

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "detect", "config_candidates", "plan", "resolve_tag_dir",
           "holds_checkpoint"]

NAME = "deepspeed"
LOOKS_FOR = "a DeepSpeed save (a 'latest' file, global_step* tag dirs, *_model_states.pt / *_optim_states.pt)"
MEMORY_NAMES = True  # the model's own parameter names: the Hub-layout pass applies

_OPTIM_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def _is_tag_dir(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(_OPTIM_RE.match(n) or _MODEL_RE.match(n) for n in names)


def resolve_tag_dir(src: str, tag: Optional[str] = None):
    """Return ``(tag_dir, tag)`` for a save dir (``latest`` + tag dirs), a tag dir, or a Trainer
    ``checkpoint-N`` dir. Raises :class:`CheckpointError` naming what to pass instead."""
    src = os.path.abspath(src)
    if tag is not None:
        cand = os.path.join(src, guards.check_tag_name(tag, "--tag"))
        if _is_tag_dir(cand):
            return cand, tag
        if os.path.basename(src) == tag and _is_tag_dir(src):
            return src, tag
        raise CheckpointError(f"{cand}: tag {tag!r} does not exist or holds no DeepSpeed files; "
                              f"tags found: {_list_tags(src) or 'none'}")
    latest = os.path.join(src, "latest")
    if os.path.lexists(latest):
        named = guards.read_latest(latest)  # a regular small file; never echoed beyond a short tag name
        cand = os.path.join(src, named)
        if not _is_tag_dir(cand):
            raise CheckpointError(f"{latest}: names tag {named!r}, but {cand} does not exist or holds no "
                                  f"DeepSpeed files; pass --tag with one of: {_list_tags(src) or 'none'}")
        return cand, named
    if _is_tag_dir(src):
        return src, os.path.basename(src)
    tags = _list_tags(src)
    if len(tags) == 1:
        return os.path.join(src, tags[0]), tags[0]
    if tags:
        raise CheckpointError(f"{src}: holds several tags ({', '.join(tags)}) and no 'latest' file; "
                              "pass --tag to choose one")
    raise CheckpointError(f"{src}: no DeepSpeed checkpoint found (no 'latest' file, no *_model_states.pt "
                          "or *_optim_states.pt); pass a DeepSpeed save dir, a tag dir or a Trainer "
                          "checkpoint-N dir")


def detect(path: str, tag: Optional[str] = None) -> bool:
    """A DeepSpeed save claims ``path`` when a tag is asked for, or it holds ``latest``, DeepSpeed
    rank files or tag dirs of them: :func:`plan` then says precisely what is wrong with it."""
    return (tag is not None or os.path.lexists(os.path.join(path, "latest")) or _is_tag_dir(path)
            or bool(_list_tags(path)))


def holds_checkpoint(path: str) -> bool:
    """True when a DeepSpeed checkpoint resolves in ``path`` without a tag (a Trainer checkpoint-N)."""
    try:
        resolve_tag_dir(path)
        return True
    except CheckpointError:
        return False


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    """The tag dir, the save dir, its parent: where a user keeps config.json beside a DeepSpeed save."""
    path = os.path.abspath(path)
    return [resolve_tag_dir(path, tag)[0], path, os.path.dirname(path)]


def _list_tags(src: str) -> List[str]:
    try:
        return sorted(n for n in os.listdir(src) if _is_tag_dir(os.path.join(src, n)))
    except OSError:
        return []


def _claim(ranks: dict, rank, value, tag_dir, name, name_of):
    """Place a rank file; two names for one rank (``mp_rank_0`` and ``mp_rank_00``) are refused."""
    if rank in ranks:
        raise LayoutError(f"{tag_dir}: {name_of(ranks[rank])} and {name} claim the same rank; one was copied "
                          "in from elsewhere or renamed: keep the one this save wrote")
    ranks[rank] = value


def _require(obj, key, path, what):
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointError(f"{path}: not a DeepSpeed {what} file (no {key!r}); "
                              "pass the directory of an engine.save_checkpoint() call")
    return obj[key]


class _Rank:
    """One data-parallel rank of one model-parallel rank: its optimizer file, read lazily."""

    def __init__(self, path, dp_rank, prefix):
        self.path = path
        self.dp_rank = dp_rank
        self.prefix = prefix
        self._osd = None

    @property
    def osd(self):
        if self._osd is None:
            obj = safe_load.load(self.path)
            self._osd = _require(obj, "optimizer_state_dict", self.path, "ZeRO optimizer")
            if not isinstance(self._osd, dict) or "zero_stage" not in self._osd:
                raise CheckpointError(f"{self.path}: optimizer state has no 'zero_stage'; not a ZeRO "
                                      "checkpoint (ZeRO stage 0 / plain optimizers are not supported)")
            _check_optim_types(self._osd, self.path)
        return self._osd


def plan(src: str, *, tag: Optional[str] = None, dtype: Optional[str] = None, config_dir: Optional[str] = None,
         tp_rules=None) -> ExportPlan:
    """Plan the export of a DeepSpeed ZeRO checkpoint (see the module docstring).

    ``config_dir``: the config the registry found (its TP merge rules are read from it).
    ``tp_rules``: ``["PATTERN=0|1|replicated", ...]`` for model-parallel parameters that neither
    the checkpoint nor the HF config describes (see :mod:`.tp_rules`).
    """
    out_dtype = dtype_from_name(dtype)
    try:
        user_rules = [parse_user_rule(r) for r in (tp_rules or [])]
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    src = os.path.abspath(src)
    tag_dir, tag = resolve_tag_dir(src, tag)
    names = sorted(os.listdir(tag_dir))
    guards.refuse_unreadable_layouts(tag_dir, names)
    optim: Dict[int, Dict[int, _Rank]] = {}
    prefixes = set()
    models: Dict[int, Dict[Optional[int], str]] = {}
    for n in names:
        m = _OPTIM_RE.match(n)
        if m:
            prefix, dp_rank, mp_rank = m.group(1) or "", int(m.group(2)), int(m.group(3))
            prefixes.add(prefix)
            _claim(optim.setdefault(mp_rank, {}), dp_rank, _Rank(os.path.join(tag_dir, n), dp_rank, prefix),
                   tag_dir, n, lambda r: os.path.basename(r.path))
        m = _MODEL_RE.match(n)
        if m:
            dp_rank = int(m.group(1)) if m.group(1) is not None else None
            _claim(models.setdefault(int(m.group(2)), {}), dp_rank, os.path.join(tag_dir, n), tag_dir, n,
                   os.path.basename)
    if not optim:
        raise CheckpointError(f"{tag_dir}: no *_optim_states.pt files; the save is incomplete or was made "
                              "with exclude_frozen_parameters/without a ZeRO optimizer: re-save it with "
                              "engine.save_checkpoint()")
    if len(prefixes) > 1:
        raise LayoutError(f"{tag_dir}: optimizer files of different precisions mixed "
                          f"({sorted(p or 'fp32' for p in prefixes)}); files from two saves were copied "
                          "together: keep only one save's files")
    mp_ranks = sorted(optim)
    if mp_ranks != list(range(len(mp_ranks))) or sorted(models) != mp_ranks:
        raise LayoutError(f"{tag_dir}: model-parallel ranks {mp_ranks} of optimizer files and "
                          f"{sorted(models)} of model files do not match 0..N-1; a rank file is missing: "
                          "copy the whole tag directory again")
    per_mp = [_plan_mp_rank(tag_dir, mp, optim[mp], models[mp], out_dtype) for mp in mp_ranks]
    if len(per_mp) == 1:
        out = per_mp[0][0]
    else:
        out = _merge_model_parallel(tag_dir, per_mp, config_dir, user_rules)
    out.source = src
    out.tag = tag
    out.mp_size = len(mp_ranks)
    return out


def _merge_model_parallel(tag_dir, per_mp, config_dir, user_rules) -> ExportPlan:
    """Merge the plans of several model-parallel ranks: a replica axis (seed 000: every rank a full
    copy, one used and the others checked) or tensor parallelism (slices merged by rules)."""
    plans = [p for p, _ in per_mp]
    info = per_mp[0][1]
    names = [t.name for t in plans[0].tensors]
    for mp, p in enumerate(plans[1:], 1):
        if [t.name for t in p.tensors] != names:
            raise LayoutError(f"{tag_dir}: model-parallel rank {mp} holds other parameters than rank 0 "
                              f"({sorted(set(t.name for t in p.tensors) ^ set(names))[:3]}...); files from "
                              "different saves are mixed: copy one save's tag directory again")
    slices = {n: [p.tensors[i] for p in plans] for i, n in enumerate(names)}
    hf = hf_plans_for(config_dir) if config_dir else None
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
    elif info is None and not full and _all_identical(slices):
        axis, reason = "replica", "every model-parallel rank holds byte-identical tensors: the axis holds replicas"
        rules = {n: Rule(None, "replica axis") for n in names}
    else:
        axis = "tp"
        reason = ("universal_checkpoint_info recorded in the checkpoint" if info is not None else
                  "model-parallel ranks hold slices smaller than the full shapes")
        rules = {n: _resolve_rule(n, ss, info, hf_plans, embeddings, user_rules, full) for n, ss in slices.items()}

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
    plan.mp_axis, plan.mp_axis_reason = axis, reason
    plan.padding_removed = padding
    plan.files = sorted({f for p in plans for f in p.files})
    return plan


def _all_identical(slices) -> bool:
    from ...assemble import check_replicas
    from ...safe_load import MappedFiles

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


def _resolve_rule(name, ss, info, hf_plans, embeddings, user_rules, full) -> Rule:
    rule = rule_from_universal_info(name, info) if info is not None else None
    rule = rule or (rule_from_hf_plan(name, hf_plans, embeddings) if hf_plans else None)
    rule = rule or rule_from_user(name, user_rules)
    if rule is None and name in full and all(s.shape == full[name] for s in ss):
        rule = Rule(None, "each slice has the full shape from config.json")
    if rule is None and _all_identical({name: ss}):
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


def _typed(value, ok, path, key):
    if not ok(value):
        raise LayoutError(f"{path}: recorded {key} has an unexpected type ({type(value).__name__}: "
                          f"{safe_load.short_repr(value)}); the file is corrupt or not written by DeepSpeed: "
                          "copy it again from the training run")


def _str_dict(v):
    return isinstance(v, dict) and all(type(k) is str for k in v)


def _check_model_types(model, path):
    """The model-states fields this source reads have the types DeepSpeed writes (a file from
    elsewhere, or a corrupt one, is refused by name rather than failing deep inside)."""
    _typed(model.get("param_shapes"), lambda v: isinstance(v, list) and all(_str_dict(g) for g in v), path,
           "param_shapes")
    for key in ("module", "frozen_param_shapes", "frozen_param_fragments"):
        _typed(model.get(key) or {}, _str_dict, path, key)
    _typed(model.get("shared_params") or {}, lambda v: _str_dict(v) and all(type(x) is str for x in v.values()),
           path, "shared_params")
    _typed(model.get("buffer_names") or [], lambda v: isinstance(v, (list, tuple)) and
           all(type(x) is str for x in v), path, "buffer_names")


def _check_optim_types(osd, path):
    """The same for the optimizer-state fields this source reads."""
    for key in ("single_partition_of_fp32_groups", "fp32_flat_groups", "group_paddings", "param_slice_mappings"):
        if key in osd:
            _typed(osd[key], lambda v: isinstance(v, list), path, key)
    if "group_paddings" in osd:
        _typed(osd["group_paddings"], lambda v: all(type(x) is int for x in v), path, "group_paddings")
    if isinstance(osd.get("param_slice_mappings"), list):
        _typed(osd["param_slice_mappings"], lambda v: all(_str_dict(m) for m in v), path, "param_slice_mappings")


def _meta_int(value, path, key):
    """A recorded integer (``zero_stage``, ``partition_count``...), or LayoutError naming the file."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise LayoutError(f"{path}: recorded {key} is {safe_load.short_repr(value)}, not an integer; the file is "
                      "corrupt or not written by DeepSpeed: copy it again from the training run")


def _shape(value, path, name):
    if not isinstance(value, (tuple, list)) or len(value) > safe_load.MAX_NDIM or \
            not all(type(s) is int for s in value):
        raise LayoutError(f"{path}: recorded shape of {safe_load.short_repr(name)} is not a shape "
                          f"({safe_load.short_repr(value)}); the file is corrupt")
    shape = tuple(value)
    if any(s < 0 for s in shape):
        raise LayoutError(f"{path}: recorded shape of {name} is negative ({shape}); the file is corrupt")
    return shape


def _numel(shape):
    return math.prod(shape)


def _tensor_pieces(ref: safe_load.TensorRef, start: int, count: int) -> Piece:
    if not isinstance(ref, safe_load.TensorRef):
        raise LayoutError(f"expected a tensor, found {type(ref).__name__}; the file is corrupt")
    if start < 0 or count < 0 or start + count > ref.numel:
        raise LayoutError(f"{ref.path}: a recorded offset points past the end of a partition "
                          f"({start}+{count} > {ref.numel}); the file does not match the recorded shapes")
    offset, _ = ref.byte_range(start, count)
    return Piece(ref.path, offset, count, ref.dtype)


def _plan_mp_rank(tag_dir, mp_rank, ranks: Dict[int, _Rank], model_files, out_dtype) -> ExportPlan:
    dp = len(ranks)
    if sorted(ranks) != list(range(dp)):
        # (bounded by the files present: a file named rank 10**12 must not build a range to it)
        missing = sorted(set(range(dp)) - set(ranks))
        raise LayoutError(f"{tag_dir}: data-parallel rank file(s) {missing[:8]} missing (found ranks "
                          f"{sorted(ranks)[:8]}{'...' if dp > 8 else ''}); copy the whole tag directory again")
    stage = _meta_int(ranks[0].osd["zero_stage"], ranks[0].path, "zero_stage")
    for r in ranks.values():
        pc = r.osd.get("partition_count")
        counts = pc if isinstance(pc, list) else [pc]
        r_stage = _meta_int(r.osd["zero_stage"], r.path, "zero_stage")
        if r_stage != stage or not counts or any(_meta_int(c, r.path, "partition_count") != dp for c in counts):
            raise LayoutError(f"{r.path}: records zero_stage={r_stage} partition_count={safe_load.short_repr(pc)}, "
                              f"but the tag holds {dp} rank files of stage {stage}; files from different "
                              "saves are mixed: copy one save's tag directory again")
    if stage == 3:
        model_path = model_files.get(0)
        if model_path is None or sorted(k for k in model_files) != list(range(dp)):
            raise LayoutError(f"{tag_dir}: ZeRO-3 needs one zero_pp_rank_R_mp_rank_{mp_rank:02d}_model_states.pt "
                              f"per rank 0..{dp - 1}; found {sorted(str(k) for k in model_files)}")
    else:
        model_path = model_files.get(None)
        if model_path is None:
            raise LayoutError(f"{tag_dir}: mp_rank_{mp_rank:02d}_model_states.pt is missing; copy the whole "
                              "tag directory again")
    model = safe_load.load(model_path)
    param_groups = _require(model, "param_shapes", model_path, "model-states")
    _check_model_types(model, model_path)
    module = model.get("module") or {}
    shared = model.get("shared_params") or {}
    buffer_names = list(model.get("buffer_names") or [])

    tensors: "OrderedDict[str, TensorPlan]" = OrderedDict()
    if stage == 3:
        _plan_zero3(ranks, param_groups, model_path, tensors)
        _plan_zero3_frozen(model_files, dp, tensors)
    else:
        _plan_zero12(ranks, param_groups, model_path, tensors, module)
        _plan_zero12_frozen(model, model_path, tensors)
    for name in buffer_names:
        ref = module.get(name)
        if isinstance(ref, safe_load.TensorRef):
            tensors[name] = TensorPlan(name, ref.shape, ref.dtype, [[_tensor_pieces(ref, 0, ref.numel)]],
                                       kind="buffer")
    if stage != 3:
        # ZeRO-1 keeps frozen parameters only in the module state dict.
        for name, ref in module.items():
            if name in tensors or name in shared or not isinstance(ref, safe_load.TensorRef):
                continue
            tensors[name] = TensorPlan(name, ref.shape, ref.dtype, [[_tensor_pieces(ref, 0, ref.numel)]],
                                       kind="frozen")
    module_dtypes = {ref.dtype for ref in module.values() if isinstance(ref, safe_load.TensorRef)}
    module_dtype = module_dtypes.pop() if len(module_dtypes) == 1 else None
    if out_dtype is not None and stage != 3 and out_dtype == module_dtype:
        # The 16-bit (or fp32) module weights are saved whole: copy them instead of casting masters.
        for name, t in tensors.items():
            ref = module.get(name)
            if t.kind == "master" and isinstance(ref, safe_load.TensorRef) and ref.shape == t.shape:
                tensors[name] = TensorPlan(name, t.shape, ref.dtype, [[_tensor_pieces(ref, 0, ref.numel)]],
                                           kind="module", module_check=t.module_check)

    # Output order = the model's state_dict order (as save_pretrained writes it), then the rest.
    ordered = [tensors.pop(n) for n in list(module) if n in tensors]
    ordered += list(tensors.values())
    files = sorted({p.path for t in ordered for part in t.parts for p in part} | {model_path})
    dtypes = {"master": "F32"}
    if module_dtype is not None:
        dtypes["module"] = module_dtype
    plan = ExportPlan(engine="deepspeed", source=tag_dir, tag=None, stage=stage, dp_size=dp, mp_size=1,
                      mp_axis="none", tensors=ordered, aliases={str(k): str(v) for k, v in shared.items()},
                      dtypes=dtypes, files=files)
    version = model.get("ds_version")  # every release records it; the layout never depends on it
    plan.engine_version = version if isinstance(version, str) else None
    if ranks[0].prefix:
        plan.notes.append(f"optimizer files carry the {ranks[0].prefix}_ prefix (mixed-precision training)")
    return plan, model.get("universal_checkpoint_info")


def _plan_zero12(ranks, param_groups, model_path, tensors, module):
    dp = len(ranks)
    for i, group in enumerate(param_groups):
        names = list(group)
        shapes = [_shape(group[n], model_path, n) for n in names]
        parts, pads = [], []
        for r in range(dp):
            osd = ranks[r].osd
            try:
                parts.append(osd["single_partition_of_fp32_groups"][i])
                pads.append(int(osd.get("group_paddings", [0] * len(param_groups))[i]))
            except (KeyError, IndexError, TypeError):
                raise LayoutError(f"{ranks[r].path}: has no fp32 partition for parameter group {i} "
                                  f"({len(param_groups)} groups recorded); files from different saves are mixed")
            if not isinstance(parts[-1], safe_load.TensorRef) or parts[-1].dtype != "F32":
                raise LayoutError(f"{ranks[r].path}: fp32 partition of group {i} is not an fp32 tensor; "
                                  "the file is corrupt")
        gaps = _param_alignment_paddings(ranks, i)
        try:
            frags = layout.zero12_fragments([_numel(s) for s in shapes], [p.numel for p in parts], pads, gaps)
        except ValueError as e:
            raise LayoutError(f"{ranks[0].path}: parameter group {i}: {e}; the model-states file "
                              f"{os.path.basename(model_path)} and the optimizer files come from different "
                              "saves or are corrupt") from None
        for r in range(dp):
            recorded = ranks[r].osd.get("param_slice_mappings")
            if isinstance(recorded, list) and i < len(recorded) and isinstance(recorded[i], dict):
                rec = {str(k): _address(v, ranks[r].path) for k, v in recorded[i].items()}
                bad = layout.check_slice_mappings(names, frags, r, rec)
                if bad:
                    raise LayoutError(f"{ranks[r].path}: the offsets this file records (param_slice_mappings) "
                                      f"disagree with its place as data-parallel rank {r} for {bad[:3]}; the "
                                      "file was renamed or comes from another save: restore the original names")
        copies = {n: _module_copy(module.get(n), shape) for n, shape in zip(names, shapes)}
        _prove_places(ranks, i, names, frags, parts, copies, model_path)
        for name, shape, fr in zip(names, shapes, frags):
            pieces = [_tensor_pieces(parts[r], local, count) for r, local, count in fr]
            copy = copies[name]
            check = ([pieces], [[_tensor_pieces(copy, 0, copy.numel)]]) if copy is not None else None
            tensors[name] = TensorPlan(name, shape, "F32", [pieces], kind="master", module_check=check)


# Elements per rank and parameter group compared with the module weights while planning: both
# ends of the partition and evenly spaced ones between (``verify`` compares every element).
PLACE_SAMPLES = 8


def _module_copy(ref, shape):
    """The module weight matching a master of ``shape``, if the model-states file holds one."""
    if isinstance(ref, safe_load.TensorRef) and ref.shape == tuple(shape) and ref.is_contiguous() and \
            ref.dtype in ("F32", "BF16", "F16"):
        return ref
    return None


def _prove_places(ranks, group, names, frags, parts, copies, model_path):
    """Prove each rank file sits at its place: a few of its fp32 masters, cast to the module weights'
    dtype, must equal the module weights (saved whole in the model-states file) at the positions
    the place implies. ``param_slice_mappings`` cannot do this when several ranks hold slices of
    one parameter: their records are identical, so swapped files look right.

    Raises :class:`LayoutError` naming the file and the element that disagrees.
    """
    from ...casts import cast_bytes  # numpy: the one rounding implementation (bitwise torch's)

    by_rank = {r: [] for r in range(len(parts))}  # rank -> [(local start, count, name, offset in param)]
    for name, fr in zip(names, frags):
        done = 0
        for r, local, count in fr:
            by_rank[r].append((local, count, name, done))
            done += count
    with safe_load.MappedFiles() as files:
        for r, spans in by_rank.items():
            n = parts[r].numel
            for pos in sorted({(n - 1) * k // (PLACE_SAMPLES - 1) for k in range(PLACE_SAMPLES)} if n else ()):
                hit = next(((name, off + pos - local) for local, count, name, off in spans
                            if local <= pos < local + count), None)
                copy = copies.get(hit[0]) if hit else None
                if copy is None:
                    continue
                master = bytes(files.read(*_one(parts[r], pos)))
                want = bytes(files.read(*_one(copy, hit[1])))
                got = cast_bytes(master, "F32", copy.dtype)
                if got != want and not (_is_nan(got, copy.dtype) and _is_nan(want, copy.dtype)):
                    raise LayoutError(
                        f"{ranks[r].path}: its fp32 partition of parameter group {group} does not match the "
                        f"model's own weights ({os.path.basename(model_path)}) at its place as data-parallel "
                        f"rank {r} ({hit[0]}[{hit[1]}]); rank files were swapped, renamed or copied from another "
                        "save: restore the original file names, or copy the tag directory again")


def _one(ref, index):
    offset, nbytes = ref.byte_range(index, 1)
    return ref.path, offset, nbytes


def _is_nan(raw, dtype):
    bits = int.from_bytes(raw, "little")
    if dtype == "F32":
        return (bits & 0x7FFFFFFF) > 0x7F800000
    if dtype == "BF16":
        return (bits & 0x7FFF) > 0x7F80
    return (bits & 0x7FFF) > 0x7C00


def _param_alignment_paddings(ranks, group):
    """Zeros DeepSpeed put after each parameter of ``group`` (``param_alignment_paddings``, 0.19+
    with ``parameter_alignment``); ``None`` when the files record none (all releases before 0.19)."""
    recorded = [r.osd.get("param_alignment_paddings") for r in ranks.values()]
    if any(rec != recorded[0] for rec in recorded):
        raise LayoutError(f"{ranks[0].path}: data-parallel ranks record different param_alignment_paddings; "
                          "files from different saves are mixed: copy one save's tag directory again")
    if recorded[0] is None:
        return None
    try:
        return list(recorded[0][group])  # zero12_fragments checks they are non-negative integers
    except (IndexError, KeyError, TypeError):
        raise LayoutError(f"{ranks[0].path}: param_alignment_paddings has no list for parameter group "
                          f"{group}; the file is corrupt") from None


def _address(value, path):
    try:
        return int(value.numel), int(value.start)
    except (AttributeError, TypeError, ValueError):
        raise LayoutError(f"{path}: a param_slice_mappings entry is not a fragment address; the file is corrupt")


def _plan_zero3(ranks, param_groups, model_path, tensors):
    dp = len(ranks)
    merged = OrderedDict()
    for group in param_groups:
        for n, s in group.items():
            merged[n] = _shape(s, model_path, n)
    flats = []
    for r in range(dp):
        groups = ranks[r].osd.get("fp32_flat_groups")
        if not isinstance(groups, list) or not all(isinstance(g, safe_load.TensorRef) and g.dtype == "F32"
                                                   for g in groups):
            raise LayoutError(f"{ranks[r].path}: no fp32_flat_groups tensors; not a ZeRO-3 optimizer file "
                              "or corrupt")
        flats.append(groups)
    lengths = {sum(g.numel for g in f) for f in flats}
    if len(lengths) != 1:
        raise LayoutError(f"{ranks[0].path}: ranks hold flat buffers of different lengths {sorted(lengths)}; "
                          "files from different saves are mixed")
    names = list(merged)
    try:
        frags = layout.zero3_fragments([_numel(merged[n]) for n in names], dp, lengths.pop())
    except ValueError as e:
        raise LayoutError(f"{ranks[0].path}: {e}; the model-states and optimizer files come from different "
                          "saves or are corrupt") from None
    # One contiguous flat buffer per rank (what DeepSpeed writes): a piece is plain arithmetic, and
    # zero3_fragments has proven every fragment lies inside the buffer (O(1) per piece at 1,024 ranks).
    single = all(len(f) == 1 and f[0].is_contiguous() for f in flats)
    bases = [(f[0].path, f[0].byte_range(0, 0)[0]) for f in flats] if single else None
    for name, fr in zip(names, frags):
        if single:
            pieces = [Piece(bases[r][0], bases[r][1] + 4 * local, count, "F32") for r, local, count in fr]
        else:
            pieces = []
            for r, local, count in fr:
                pieces.extend(_segmented_pieces(flats[r], local, count))
        tensors[name] = TensorPlan(name, merged[name], "F32", [pieces], kind="master")


def _segmented_pieces(segments, start, count):
    """Pieces for ``count`` elements from ``start`` of the concatenation of ``segments``."""
    out = []
    for seg in segments:
        if count <= 0:
            break
        if start >= seg.numel:
            start -= seg.numel
            continue
        take = min(count, seg.numel - start)
        out.append(_tensor_pieces(seg, start, take))
        count -= take
        start = 0
    if count > 0:
        raise LayoutError(f"{segments[0].path}: flat buffer shorter than the recorded shapes need")
    return out


def _plan_zero12_frozen(model, model_path, tensors):
    shapes = model.get("frozen_param_shapes") or {}
    frags = model.get("frozen_param_fragments") or {}
    for name, shape in shapes.items():
        ref = frags.get(name)
        shape = _shape(shape, model_path, name)
        if not isinstance(ref, safe_load.TensorRef) or ref.numel != _numel(shape):
            raise LayoutError(f"{model_path}: frozen parameter {name} has no fragment of {_numel(shape)} elements")
        tensors[name] = TensorPlan(name, shape, ref.dtype, [[_tensor_pieces(ref, 0, ref.numel)]], kind="frozen")


def _plan_zero3_frozen(model_files, dp, tensors):
    first = safe_load.load(model_files[0])
    shapes = first.get("frozen_param_shapes") or {}
    # The other ranks' model files only matter for their frozen fragments: reading all of them
    # (each pickles every parameter's shape) was most of the plan time at 64+ ranks.
    per_rank = [first] + [safe_load.load(model_files[r]) for r in range(1, dp)] if dp > 1 and shapes else None
    for name, shape in shapes.items():
        shape = _shape(shape, model_files[0], name)
        n = _numel(shape)
        chunk = layout.ceil_div(n, dp)
        pieces = []
        for r in range(dp):
            count = min(chunk, n - r * chunk)
            if count <= 0:
                break
            ref = ((per_rank[r] if per_rank else first).get("frozen_param_fragments") or {}).get(name)
            if not isinstance(ref, safe_load.TensorRef) or ref.numel < count:
                raise LayoutError(f"{model_files[r]}: frozen parameter {name} has no fragment of {count} "
                                  "elements; files from different saves are mixed")
            pieces.append(_tensor_pieces(ref, 0, count))
        tensors[name] = TensorPlan(name, shape, pieces[0].dtype, [pieces], kind="frozen")
