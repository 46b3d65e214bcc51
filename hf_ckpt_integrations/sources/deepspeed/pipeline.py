"""DeepSpeed pipeline-parallel saves (``PipelineModule``: GPT-NeoX, Megatron-DeepSpeed) -> ExportPlan.

What ``engine.save_checkpoint`` writes for a ``PipelineModule`` (DeepSpeed 0.19.8, read from its
``runtime/pipe/module.py`` and ``runtime/engine.py``):

- ``layer_{LL}-model_{TT}-model_states.pt``: the state dict of pipeline layer ``LL`` (global index)
  on tensor-parallel rank ``TT`` (``layer_{LL}-model_states.pt`` without a model axis); layers
  without parameters (plain functions) get none. Written by data-parallel rank 0 only.
- ``mp_rank_{MM}_model_states.pt``: ``module`` is None; ``MM`` is the rank inside one data-parallel
  replica, ``stage * tp + tp_rank``; it records ``mp_world_size``, ``checkpoint_parallel_dimensions``
  (``pp_degree``, ``tp_degree``; older releases: none) and, under ZeRO-1, ``param_shapes`` named
  ``"{layer index}.{name inside the layer}"``.
- ``[bf16_]zero_pp_rank_{D}_mp_rank_{MM}_optim_states.pt``: the fp32 masters of that stage and TP
  rank, cut in ``D`` data-parallel partitions (ZeRO-1, or ``BF16_Optimizer`` whose files carry no
  ``zero_stage``). Without them (fp32, no ZeRO) the layer files are the weights.

The masters are placed by :mod:`.zero12` (every partition proven against the layer files'
weights). Names and TP merges are conversion rules (``rules/<model_type>.json``, chosen by the HF
config's ``model_type``, or ``--source-option name_map=FILE``; docs/conversions.md) run by
:func:`...convert.apply_rules`; a TP merge the checkpoint's ``universal_checkpoint_info`` records
overrides the rules' ``tp``, and a parameter whose rule gives none merges by ``--tp-rule`` or as
byte-identical slices (one copy) — never concatenating a replica.
"""

import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from ...errors import CheckpointError, LayoutError, short_repr
from ...formats.torch_files import TensorRef
from ...plan import ExportPlan, TensorPlan
from ..protocol import PlanContext, SourceOption
from .tp_merge import TP_RULES_OPTION
from ...convert import apply_rules, load_rules, merge_tp, target_names
from ...convert.tp_rules import Rule, all_identical, merge_slices, parse_user_rule, rule_from_universal_info, \
    rule_from_user
from .allowlist import ALLOWED, load
from .pipeline_rules import ROW_BIAS_NOTE, builtin_types, choose_rules, parallel_residual, universal_tp_rules
from .fields import check_model_types, check_optim_types, meta_int, require, tensor_pieces
from .rank_files import MODEL_RE, OPTIM_RE, claim, model_name, optim_name, resolve_tag_dir
from .zero12 import plan_zero12

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "OPTIONS", "ALLOWED", "LAYER_RE", "detect", "needs_config", "config_candidates",
           "plan", "universal_plan", "universal_files", "rank_files", "is_pipeline_tag", "UNIVERSAL", "split_native"]

NAME = "deepspeed-pipeline"
LOOKS_FOR = "a DeepSpeed PipelineModule save (layer_XX[-model_YY]-model_states.pt beside mp_rank_XX files)"
# Name maps give the names save_pretrained writes (a Hub checkpoint's: GPT-NeoX's ``embed_out.weight``,
# which transformers 5 renames to ``lm_head.weight`` in memory on load), not in-memory names: the
# tied-weight and Hub-layout passes do not apply (tied modules are refused).
MEMORY_NAMES = False
OPTIONS = (
    SourceOption("name_map", "FILE: a conversion rules file (docs: conversions) from pipeline parameter names "
                 "to HF names and TP merges (docs: 'Pipeline parallelism'); default: the built-in rules of "
                 "config.json's model_type", parse=load_rules),
    TP_RULES_OPTION,
)
UNIVERSAL = True  # hf-ckpt universal writes a universal checkpoint of a pipeline save (SourceBase)

LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_ANY_LAYER_RE = re.compile(r"^layer_\d+(?:-[a-z]+_\d+)*-model_states\.pt$")


def is_pipeline_tag(tag_dir: str) -> bool:
    try:
        return any(_ANY_LAYER_RE.match(n) for n in os.listdir(tag_dir))
    except OSError:
        return False


def detect(path: str, tag: Optional[str] = None) -> bool:
    """Claims a DeepSpeed save whose tag dir holds pipeline layer files (names only)."""
    try:
        tag_dir, _ = resolve_tag_dir(path, tag)
    except CheckpointError:
        return False
    return is_pipeline_tag(tag_dir)


def needs_config(path: str, tag: Optional[str] = None) -> bool:
    """Always: the HF names come from a config (the name map is its model_type's), and a pipeline
    save keeps none beside it (GPT-NeoX keeps its YAML)."""
    return True


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    path = os.path.abspath(path)
    return [resolve_tag_dir(path, tag)[0], path, os.path.dirname(path)]


class _OptimFile:
    """One data-parallel partition of one stage x TP rank (ZeRO-1 or BF16_Optimizer), read lazily;
    what :func:`.zero12.plan_zero12` reads (``path``, ``osd``)."""

    def __init__(self, path, dp_rank, prefix):
        self.path, self.dp_rank, self.prefix = path, dp_rank, prefix
        self._osd = None

    @property
    def osd(self):
        if self._osd is None:
            osd = require(load(self.path), "optimizer_state_dict", self.path, "DeepSpeed optimizer")
            if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
                raise CheckpointError(f"{self.path}: holds no fp32 partitions (single_partition_of_fp32_groups); "
                                      "not a ZeRO-1 or BF16_Optimizer file of a pipeline save")
            check_optim_types(osd, self.path)
            self._osd = osd
        return self._osd


def rank_files(tag_dir: str):
    """``(optim, models)`` of a pipeline tag dir: ``optim[mp][dp]`` its optimizer files (``path``,
    ``osd``; empty without ZeRO), ``models[mp]`` the path of ``mp_rank_{mp}_model_states.pt``."""
    _, models, optim = _list_files(tag_dir)
    return optim, models


def universal_files(tag_dir: str):
    """``(optim, first model-states path)`` of a pipeline tag dir (:func:`rank_files`), for the universal writer."""
    optim, models = rank_files(tag_dir)
    return optim, models[0]


def _list_files(tag_dir):
    names = sorted(os.listdir(tag_dir))
    layers: Dict[int, Dict[int, str]] = {}  # layer -> tp rank -> path
    models: Dict[int, str] = {}
    optim: Dict[int, Dict[int, _OptimFile]] = {}
    prefixes = set()
    odd = [n for n in names if _ANY_LAYER_RE.match(n) and not LAYER_RE.match(n)]
    if odd:
        raise LayoutError(f"{tag_dir}: layer file {odd[0]} names a parallel axis other than 'model' (tensor "
                          "parallelism); such topologies are not read: please report it with the file list")
    for n in names:
        path = os.path.join(tag_dir, n)
        if m := LAYER_RE.match(n):
            tp = int(m.group(2)) if m.group(2) is not None else 0
            layer = int(m.group(1))
            claim(layers.setdefault(layer, {}), tp, path, tag_dir, n, what=f"layer {layer}'s tensor-parallel rank",
                  canonical=f"layer_{layer:02d}" + (f"-model_{tp:02d}" if m.group(2) is not None else "")
                  + "-model_states.pt")
        elif m := MODEL_RE.match(n):
            if m.group(1) is not None:
                raise LayoutError(f"{tag_dir}: {n} is a ZeRO-3 model-states file; DeepSpeed pipelines run ZeRO "
                                  "0 or 1 only: files from another save were copied in")
            claim(models, int(m.group(2)), path, tag_dir, n, what="model-parallel rank",
                  canonical=model_name(None, int(m.group(2))))
        elif m := OPTIM_RE.match(n):
            prefixes.add(m.group(1) or "")
            claim(optim.setdefault(int(m.group(3)), {}), int(m.group(2)), _OptimFile(path, int(m.group(2)),
                  m.group(1) or ""), tag_dir, n, what=f"model-parallel rank {int(m.group(3))}'s data-parallel rank",
                  canonical=optim_name(m.group(1) or "", int(m.group(2)), int(m.group(3))))
    if len(prefixes) > 1:
        raise LayoutError(f"{tag_dir}: optimizer files of different precisions mixed "
                          f"({sorted(p or 'fp32' for p in prefixes)}); keep only one save's files")
    if not models or sorted(models) != list(range(len(models))):
        raise LayoutError(f"{tag_dir}: model-states files mp_rank_XX_model_states.pt for ranks "
                          f"{sorted(models)[:8]}, not 0..N-1; a rank file is missing: copy the whole tag directory again")
    return layers, models, optim


def _degrees(tag_dir, model_objs, layers):
    """(pp, tp) from what the model-states files record, checked against the files present."""
    n = len(model_objs)
    tps = sorted({t for by_tp in layers.values() for t in by_tp})
    found_tp = len(tps)
    if tps != list(range(found_tp)):
        raise LayoutError(f"{tag_dir}: layer files of tensor-parallel ranks {tps[:8]}, not 0..N-1; a layer file "
                          "is missing: copy the whole tag directory again")
    recorded = set()
    for mp, (path, obj) in model_objs.items():
        world = obj.get("mp_world_size")
        dims = obj.get("checkpoint_parallel_dimensions")
        pp = tp = None
        if isinstance(dims, dict):
            pp = meta_int(dims.get("pp_degree"), path, "pp_degree")
            tp = meta_int(dims.get("tp_degree"), path, "tp_degree")
        if world is not None:
            world = meta_int(world, path, "mp_world_size")
        recorded.add((world, pp, tp))
    if len(recorded) != 1:
        raise LayoutError(f"{tag_dir}: the model-states files record different layouts ({sorted(map(str, recorded))}); "
                          "files from different saves are mixed: copy one save's tag directory again")
    world, pp, tp = recorded.pop()
    if tp is None:
        tp = found_tp
        pp = n // tp if tp and n % tp == 0 else None
    if world is not None and world != n:
        raise LayoutError(f"{tag_dir}: the model-states files record mp_world_size={world}, but {n} "
                          "mp_rank_XX_model_states.pt files are present; copy the whole tag directory again")
    if pp is None or pp * tp != n or tp != found_tp:
        raise LayoutError(f"{tag_dir}: {n} model-states files and layer files of {found_tp} tensor-parallel ranks do "
                          f"not fit pp={pp} x tp={tp}; files from different saves are mixed")
    return pp, tp


def _layer_state(path):
    sd = load(path)
    if not isinstance(sd, dict) or not all(type(k) is str for k in sd):
        raise LayoutError(f"{path}: not a layer state dict (a dict of names to tensors); the file is corrupt")
    out = OrderedDict()
    for k, v in sd.items():
        if not isinstance(v, TensorRef):
            raise LayoutError(f"{path}: {short_repr(k)} is a {type(v).__name__}, not a tensor; the file is corrupt")
        out[k] = v
    return out


def _whole(ref: TensorRef, path: str, name: str):
    if not ref.is_contiguous():
        raise LayoutError(f"{path}: {name} is saved as a strided view; re-save it (the layer file is not read)")
    return [tensor_pieces(ref, 0, ref.numel)]


def plan(ctx: PlanContext) -> ExportPlan:
    """Plan the export of a pipeline-parallel DeepSpeed save (see the module docstring).

    Options: ``name_map`` (a :class:`~...convert.RuleSet` from ``--source-option name_map=FILE``),
    ``tp_rules`` (``--tp-rule``). Raises :class:`CheckpointError` for what it cannot prove."""
    return _plan(ctx, universal=False)


def universal_plan(ctx: PlanContext) -> ExportPlan:
    """The plan of a universal checkpoint of the save (:mod:`...universal_writer`), read as
    :func:`plan` reads it, except: the parameters keep the ``PipelineModule``'s own names
    (``"{layer}.{name}"``: what DeepSpeed's ``load_universal`` looks up, ``engine.param_names``, at
    any stage count since layer indices are global); the name map, when one is chosen, gives only
    the TP rules; a row-parallel bias is what every TP rank's module holds (one copy, the others
    checked equal: the loader copies it to every rank), never the sum; no config is required."""
    return _plan(ctx, universal=True)


def _plan(ctx: PlanContext, *, universal: bool) -> ExportPlan:
    src = os.path.abspath(ctx.path)
    try:
        user_rules = [parse_user_rule(r) for r in (ctx.option("tp_rules") or [])]
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    tag_dir, tag = resolve_tag_dir(src, ctx.tag)
    layers, models, optim = _list_files(tag_dir)
    model_objs = {}
    for mp, path in models.items():
        obj = load(path)
        if not isinstance(obj, dict):
            raise CheckpointError(f"{path}: not a DeepSpeed model-states file; pass the directory of an "
                                  "engine.save_checkpoint() call")
        check_model_types({**obj, "param_shapes": obj.get("param_shapes") or []}, path)  # None without ZeRO
        model_objs[mp] = (path, obj)
    pp, tp = _degrees(tag_dir, model_objs, layers)
    states = {(layer, t): _layer_state(path) for layer, by_tp in layers.items() for t, path in by_tp.items()}
    for layer, by_tp in layers.items():
        if sorted(by_tp) != list(range(tp)):
            raise LayoutError(f"{tag_dir}: layer {layer} has files for TP ranks {sorted(by_tp)}, not 0..{tp - 1}; "
                              "a layer file is missing: copy the whole tag directory again")

    stage_of: Dict[int, int] = {}
    per_tp: List["OrderedDict[str, TensorPlan]"] = [OrderedDict() for _ in range(tp)]
    dp_sizes, zero = set(), set()
    info = None
    for mp in range(pp * tp):
        stage, t = divmod(mp, tp)
        path, obj = model_objs[mp]
        info = info or obj.get("universal_checkpoint_info")
        groups = obj.get("param_shapes")
        module = {}  # the stage's weights from its layer files: what each master is proven against
        ranks = optim.get(mp, {})
        if groups:
            for g in groups:
                for name in g:
                    try:
                        layer, inner = split_native(name)
                    except ValueError as e:
                        raise LayoutError(f"{path}: {e}; a tied module (TiedLayerSpec) or another layout is not "
                                          "read by this source: please report it") from None
                    if stage_of.setdefault(layer, stage) != stage:
                        raise LayoutError(f"{path}: layer {layer} is recorded on stages {stage_of[layer]} and {stage}; "
                                          "files from different saves are mixed")
                    ref = states.get((layer, t), {}).get(inner)
                    if ref is None:
                        raise LayoutError(f"{path}: parameter {name} has no weight in "
                                          f"layer_{layer:02d}-model_{t:02d}-model_states.pt; a layer file is missing "
                                          "or comes from another save")
                    module[name] = ref
        if not ranks:
            if groups:
                raise LayoutError(f"{path}: records ZeRO parameter groups, but no *_mp_rank_{mp:02d}_optim_states.pt "
                                  "file holds their masters; copy the whole tag directory again")
            continue  # no ZeRO and no BF16_Optimizer: the layer files are the weights (below)
        if not groups:
            raise LayoutError(f"{path}: records no param_shapes, so the optimizer files' fp32 masters cannot be "
                              "named (a BF16_Optimizer without ZeRO); re-save with zero_optimization.stage 1")
        dp = len(ranks)
        if sorted(ranks) != list(range(dp)):
            raise LayoutError(f"{tag_dir}: data-parallel ranks {sorted(ranks)[:8]} of mp_rank {mp:02d}, not 0..N-1; "
                              "copy the whole tag directory again")
        for r in ranks.values():
            pc = r.osd.get("partition_count")
            counts = pc if isinstance(pc, list) else [pc]
            if not counts or any(meta_int(c, r.path, "partition_count") != dp for c in counts):
                raise LayoutError(f"{r.path}: records partition_count={short_repr(pc)}, but {dp} data-parallel "
                                  "files are present; files from different saves are mixed")
            stage_rec = r.osd.get("zero_stage")  # BF16_Optimizer records none: ZeRO-1 (param_shapes are recorded)
            zero.add(meta_int(stage_rec, r.path, "zero_stage") if stage_rec is not None else 1)
        dp_sizes.add(dp)
        tensors: "OrderedDict[str, TensorPlan]" = OrderedDict()
        plan_zero12(ranks, groups, path, tensors, module)
        for name, tplan in tensors.items():
            if tplan.module_check is None:
                raise LayoutError(f"{path}: the fp32 master of {name} cannot be proven against its layer file "
                                  "(shape or dtype differ); files from different saves are mixed")
            per_tp[t][name] = tplan
    if len(dp_sizes) > 1:
        raise LayoutError(f"{tag_dir}: stages hold different data-parallel sizes {sorted(dp_sizes)}")

    # Layer-file tensors no master covers: frozen parameters and buffers (fp32 without ZeRO: all).
    for (layer, t), sd in sorted(states.items()):
        for inner, ref in sd.items():
            name = f"{layer}.{inner}"
            if name not in per_tp[t]:
                kind = "master" if not optim and ref.dtype == "F32" else "frozen"
                per_tp[t][name] = TensorPlan(name, ref.shape, ref.dtype,
                                             [_whole(ref, layers[layer][t], inner)], kind=kind)

    names = list(per_tp[0])
    for t in range(1, tp):
        if set(per_tp[t]) != set(names):
            diff = sorted(set(per_tp[t]) ^ set(names))
            raise LayoutError(f"{tag_dir}: tensor-parallel rank {t} holds other parameters than rank 0 ({diff[:3]}); "
                              "files from different saves are mixed")
    names.sort(key=lambda n: split_native(n)[0])  # layer order, then each layer's own order

    rules, map_note = choose_rules(ctx)
    if universal and rules is None:
        map_note = ("no config.json and no name map: TP slices merge by the recorded universal_checkpoint_info, "
                    "--tp-rule or byte-identical slices only, and no row-parallel bias is recognised as one; pass "
                    f"--config DIR (a config of a model type with built-in rules: {', '.join(builtin_types())}) for "
                    "the rules' TP merges")
    slices = OrderedDict((n, [per_tp[t][n] for t in range(tp)]) for n in names)
    found = {n: rules.find(n) if rules is not None else None for n in names}
    for n, f in found.items():
        if rules is not None and f is None:
            raise LayoutError(f"{tag_dir}: parameter {n} matches no rule in {rules.source}; pass "
                              "--source-option name_map=FILE with a rule for it (docs: 'Pipeline parallelism')")
    has_row_bias = any(f is not None and f[0].tp == "row_bias" for f in found.values())
    # the config's use_parallel_residual, read when a row-parallel bias of several TP slices needs it
    params = {"parallel_residual": parallel_residual(ctx) if has_row_bias and tp > 1 and not universal else None}
    targets = target_names(rules, names, params) if rules is not None and not universal else {}
    overrides: Dict[str, Rule] = {}
    row_biases = []
    one_copy = universal_tp_rules(rules, names) if rules is not None and universal else {}
    for n in names if tp > 1 else ():
        hit = found[n]
        rule = hit[0] if hit is not None else None
        if rule is not None and rule.drop is not None:
            continue
        if n in one_copy:
            row_biases.append(n)
            overrides[n] = one_copy[n]
        elif info is not None and (recorded := rule_from_universal_info(n, info)) is not None:
            overrides[n] = recorded
        elif rule is None or rule.tp is None:
            hf = targets.get(n, n)
            user = rule_from_user(hf, user_rules) or (rule_from_user(n, user_rules) if n != hf else None)
            if user is None and all_identical({hf: slices[n]}):
                user = Rule(None, "slices are byte-identical")
            if user is None:
                raise LayoutError(f"{n}: its {tp} tensor-parallel slices {[list(s.shape) for s in slices[n]]} "
                                  "differ and no rule covers it (no universal_checkpoint_info, no name map entry); "
                                  f"pass --tp-rule '{hf}=0' (split rows), '=1' (split columns) or '=replicated'")
            overrides[n] = user
    fix = "fix the name map or pass --tp-rule"
    if rules is not None and not universal:
        converted = apply_rules(rules, slices, params, overrides)
        out = converted.tensors
        dropped = [f"{n} ({why})" for n, why in converted.dropped.items()]
    else:  # native names: the rules (when chosen) give the TP merges and the drops only
        out, dropped = [], []
        for n, ss in slices.items():
            hit = found[n]
            rule = hit[0] if hit is not None else None
            if rule is not None and rule.drop is not None:
                dropped.append(f"{n} ({rule.drop})")
                continue
            if n in overrides or rule is None:
                out.append(merge_slices(n, ss, overrides.get(n), fix))
            else:
                out.append(merge_tp(n, ss, rule.tp, params, rule.where))

    if rules is not None and ctx.config_dir is not None and not universal:
        _check_against_config(out, ctx.config_dir)

    files = sorted({p.path for t in out for part in t.parts + t.replicas for p in part} | set(models.values()) |
                   {p for by_tp in layers.values() for p in by_tp.values()})
    dtypes = {"master": "F32"} if optim or all(t.src_dtype == "F32" for t in out) else {}
    layer_dtypes = {ref.dtype for sd in states.values() for ref in sd.values()}
    if len(layer_dtypes) == 1:
        dtypes["module"] = layer_dtypes.pop()
    stages = sorted(set(stage_of.values()))
    detail = {"zero_stage": max(zero) if zero else 0, "pp_size": pp, "tp_size": tp,
              "dp_size": dp_sizes.pop() if dp_sizes else None, "mp_size": pp * tp,
              "mp_axis": f"pipeline {pp} stages x tp {tp}",
              "mp_axis_reason": "mp_rank = stage x tp + tp rank (DeepSpeed PipelineModule); " + _stage_map_text(stage_of),
              "layer_stage": {str(k): v for k, v in sorted(stage_of.items())} if stage_of else None,
              "layers_with_files": sorted(layers),
              "name_map": rules.source if rules else None}
    if not stages and pp > 1:
        detail["layer_stage"] = None
    plan_ = ExportPlan(engine="deepspeed", source=src, tag=tag, tensors=out, dtypes=dtypes, files=files,
                       detail=detail)
    version = model_objs[0][1].get("ds_version")
    plan_.engine_version = version if isinstance(version, str) else None
    plan_.notes.append(f"DeepSpeed pipeline: {pp} stages x TP {tp} x DP {detail['dp_size'] or 1}")
    if map_note:
        plan_.notes.append(map_note)
    if dropped:
        plan_.notes.append(f"not written (name map): {', '.join(dropped[:4])}{' ...' if len(dropped) > 4 else ''}")
    if not optim:
        plan_.notes.append("no optimizer partitions (no ZeRO): the layer files' weights are exported")
    residual = ctx.config.get("use_parallel_residual")
    if row_biases and tp > 1 and residual is not False:
        said = "the config's use_parallel_residual" if residual is True else "if the model uses it: the config does not say"
        plan_.notes.append(ROW_BIAS_NOTE.format(n=len(row_biases), tp=tp, first=row_biases[0], said=said))
    return plan_


def _check_against_config(tensors, config_dir) -> None:
    """The mapped names and shapes are exactly what ``save_pretrained`` of the config's model writes
    (its meta model's state dict, renamed by transformers' own save-time conversion): a map or a
    config that does not fit the checkpoint is refused, never written as a directory that loads
    with missing weights. Nothing is checked when transformers cannot build the model (a note-free
    skip: ``from_pretrained`` would fail the same way)."""
    from ...convert.hub_layout import hub_layout, meta_model

    model = meta_model(config_dir)
    if model is None:
        return
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    layout = hub_layout(shapes, model)
    want = {h.name: tuple(h.shape) for h in layout} if layout else shapes
    got = {t.name: tuple(t.shape) for t in tensors}
    bad = [f"{n} missing" for n in want if n not in got] + [f"{n} not in the model" for n in got if n not in want]
    bad += [f"{n} {list(got[n])} vs the model's {list(want[n])}" for n in got if n in want and got[n] != want[n]]
    if bad:
        raise LayoutError(f"{config_dir}/config.json: its {type(model).__name__} does not fit the mapped checkpoint "
                          f"({len(bad)} differences: {'; '.join(bad[:3])}); pass --config the trained model's "
                          "config, or fix the name map")


def _stage_map_text(stage_of: Dict[int, int]) -> str:
    """``"layers 0, 2 on stage 0; 3, 5, 6 on stage 1"`` (what ``inspect`` prints)."""
    if not stage_of:
        return "layer -> stage map not recorded (no ZeRO param_shapes)"
    by_stage: Dict[int, List[int]] = {}
    for layer, stage in sorted(stage_of.items()):
        by_stage.setdefault(stage, []).append(layer)
    return "layers " + "; ".join(f"{', '.join(map(str, ls))} on stage {s}" for s, ls in sorted(by_stage.items()))


def split_native(name: str) -> Tuple[int, str]:
    """``"3.attention.dense.weight"`` -> ``(3, "attention.dense.weight")``; ValueError otherwise."""
    head, sep, inner = name.partition(".")
    if not sep or not head.isdigit() or not inner:
        raise ValueError(f"{name!r} is not a pipeline parameter name ('<layer index>.<name inside the layer>')")
    return int(head), inner
