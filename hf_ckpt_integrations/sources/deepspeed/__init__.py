"""DeepSpeed ZeRO-1/2/3 checkpoints on disk -> :class:`~...plan.ExportPlan`.

Reads only pickled metadata (through :mod:`...formats.torch_files` with the allowlist of
:mod:`.allowlist`, never DeepSpeed or torch); tensors stay
:class:`~...formats.torch_files.TensorRef` byte ranges until the writer copies them. Files are
placed by the data-parallel rank in their name read as a number (never by sort order), and
ZeRO-1/2 placements are then proven against the offsets each file records
(``param_slice_mappings``).

The pieces, each public so that another source of per-rank files (pipeline stages, a new
engine) can call them: :mod:`.rank_files` (which file holds which rank), :mod:`.fields` (the
recorded fields, type-checked), :mod:`.partitions` (the ZeRO arithmetic on plain numbers),
:mod:`.zero12` and :mod:`.zero3` (one model-parallel rank's tensors), :mod:`.tp_merge` (several
model-parallel ranks merged). This module is the source the registry calls.
"""

import os
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

from ...errors import CheckpointError, LayoutError, short_repr
from ...formats.torch_files import TensorRef
from ...formats.dtypes import from_user as dtype_from_name
from ...plan import ExportPlan, TensorPlan
from ...boxes import pieces_paths
from ..protocol import PlanContext
from .tp_merge import TP_RULES_OPTION
from ...convert.tp_rules import parse_user_rule
from .allowlist import ALLOWED, load
from .fields import check_model_types, meta_int, require, tensor_pieces
from .moe import find_expert_files
from .rank_files import RankFile, find_rank_files, holds_checkpoint, is_tag_dir, list_tags, resolve_tag_dir
from .tp_merge import merge_model_parallel
from . import zero12
from .fields import recorded_shape
from .zero12 import plan_zero12, plan_zero12_frozen
from .zero3 import plan_zero3, plan_zero3_frozen
from . import autoep, stage0
from .bf16_optimizer import plan_bf16_optimizer
from .recorded import describe, recorded_dp, recorded_stage, write_aliases

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "OPTIONS", "ALLOWED", "detect", "config_candidates", "plan", "plan_mp_rank",
           "resolve_tag_dir", "holds_checkpoint", "UNIVERSAL", "universal_plan", "universal_files"]

NAME = "deepspeed"
LOOKS_FOR = "a DeepSpeed save (a 'latest' file, global_step* tag dirs, *_model_states.pt / *_optim_states.pt)"
MEMORY_NAMES = True  # the model's own parameter names: the Hub-layout pass applies
OPTIONS = (TP_RULES_OPTION,)
UNIVERSAL = True  # hf-ckpt universal writes a universal checkpoint of a ZeRO save (SourceBase)


def detect(path: str, tag: Optional[str] = None) -> bool:
    """A DeepSpeed save claims ``path`` when a tag is asked for, or it holds ``latest``, DeepSpeed
    rank files or tag dirs of them: :func:`plan` then says precisely what is wrong with it."""
    return (tag is not None or os.path.lexists(os.path.join(path, "latest")) or is_tag_dir(path)
            or bool(list_tags(path)))


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    """The tag dir, the save dir, its parent: where a user keeps config.json beside a DeepSpeed save."""
    path = os.path.abspath(path)
    return [resolve_tag_dir(path, tag)[0], path, os.path.dirname(path)]


def plan(ctx: PlanContext) -> ExportPlan:
    """Plan the export of a DeepSpeed ZeRO checkpoint (see the module docstring).

    ``ctx.config_dir``: the config the registry found (its TP merge rules are read from it).
    ``ctx.options["tp_rules"]``: ``["PATTERN=0|1|replicated", ...]`` for model-parallel parameters
    that neither the checkpoint nor the HF config describes (see :mod:`..tp_rules`).
    """
    src, tag, dtype, config_dir, tp_rules = ctx.path, ctx.tag, ctx.dtype, ctx.config_dir, ctx.option("tp_rules")
    out_dtype = dtype_from_name(dtype)
    try:
        user_rules = [parse_user_rule(r) for r in (tp_rules or [])]
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    src = os.path.abspath(src)
    tag_dir, tag = resolve_tag_dir(src, tag)
    from . import pipeline  # PipelineModule saves (layer_XX files) have their own reader

    if pipeline.is_pipeline_tag(tag_dir):
        return pipeline.plan(ctx)
    optim, models = find_rank_files(tag_dir)
    loaded: Optional[Dict[str, Any]] = None
    if ctx.reads is not None:  # the universal writer reads them next: keep what was read
        ctx.reads["rank_files"] = (tag_dir, optim, models)
        loaded = ctx.reads.setdefault("model_states", {})
    mp_ranks = sorted(optim)
    per_mp = [plan_mp_rank(tag_dir, mp, optim[mp], models[mp], out_dtype, loaded=loaded) for mp in mp_ranks]
    if len(per_mp) == 1:
        out = per_mp[0][0]
    else:
        out = merge_model_parallel(tag_dir, per_mp, config_dir, user_rules, ctx.config if config_dir else None)
    out.source = src
    out.tag = tag
    out.detail["mp_size"] = len(mp_ranks)
    if config_dir is None and out.aliases:
        write_aliases(out)
    return out


def universal_plan(ctx: PlanContext) -> ExportPlan:
    """The plan a universal checkpoint is written from: :func:`plan` (the names are the module's).
    The rank files it read (their optimizer pickles already unpickled) and the model-states files
    stay in ``ctx.reads`` for :func:`universal_files` and the writer: each file is read once."""
    if ctx.reads is None:
        ctx.reads = {}
    return plan(ctx)


def universal_files(tag_dir: str, reads: Optional[Dict[str, Any]] = None
                    ) -> Tuple[Dict[int, Dict[int, RankFile]], Optional[str]]:
    """``(optim, first model-states path)`` of ``tag_dir`` (:func:`find_rank_files`), for the universal
    writer; the ones :func:`universal_plan` found when ``reads`` (its ``ctx.reads``) holds them."""
    found = (reads or {}).get("rank_files")
    optim, models = found[1:] if found is not None and found[0] == tag_dir else find_rank_files(tag_dir)
    return optim, models[0].get(None) or models[0].get(0)


def plan_mp_rank(tag_dir: str, mp_rank: int, ranks: Dict[int, RankFile], model_files: Dict[Optional[int], str],
                 out_dtype: Optional[str], *, loaded: Optional[Dict[str, Any]] = None
                 ) -> Tuple[ExportPlan, Optional[Dict[str, Any]]]:
    """The plan of one model-parallel rank ``mp_rank``, from its data-parallel ``ranks`` and its
    model-states files (:func:`.rank_files.find_rank_files`), and its ``universal_checkpoint_info``
    (None when not recorded): ``(ExportPlan, info)``. ``loaded``: where to keep the model-states
    file read (path -> its unpickled object), for a caller that reads it next."""
    dp = len(ranks)
    if sorted(ranks) != list(range(dp)):
        # (bounded by the files present: a file named rank 10**12 must not build a range to it)
        missing = sorted(set(range(dp)) - set(ranks))
        raise LayoutError(f"{tag_dir}: data-parallel rank file(s) {missing[:8]} missing (found ranks "
                          f"{sorted(ranks)[:8]}{'...' if dp > 8 else ''}); copy the whole tag directory again")
    # Which optimizer wrote the rank files decides the layout: ZeRO's records its stage; DeepSpeed's
    # BF16_Optimizer (.bf16_optimizer) and no ZeRO at all (.stage0, no optimizer files) do not.
    optimizer = "ZeRO" if ranks and "zero_stage" in ranks[0].osd else "BF16_Optimizer" if ranks else None
    stage = meta_int(ranks[0].osd["zero_stage"], ranks[0].path, "zero_stage") if optimizer == "ZeRO" else 0
    listing = os.listdir(tag_dir)
    # MoE (deepspeed.moe or AutoEP): expert groups count fewer ranks
    experts = autoep.find_autoep_files(tag_dir, listing, mp_rank) or find_expert_files(tag_dir, listing, mp_rank)
    if experts and (stage == 3 or optimizer != "ZeRO"):
        raise LayoutError(f"{experts.files[0]}: a DeepSpeed MoE save under "
                          f"{'ZeRO-3' if stage == 3 else optimizer or 'no ZeRO'}; hf-ckpt reads MoE expert "
                          "files under ZeRO-1/2 only")
    for r in ranks.values() if optimizer == "ZeRO" else ():
        pc = r.osd.get("partition_count")
        counts = pc if isinstance(pc, list) else [pc]
        r_stage = meta_int(r.osd["zero_stage"], r.path, "zero_stage")
        if r_stage != stage or not counts or any(meta_int(c, r.path, "partition_count") != dp and not experts
                                                 for c in counts):
            raise LayoutError(f"{r.path}: records zero_stage={r_stage} partition_count={short_repr(pc)}, "
                              f"but the tag holds {dp} rank files of stage {stage}; files from different "
                              "saves are mixed: copy one save's tag directory again")
    if stage == 3:
        model_path = model_files.get(0)
        if model_path is None or sorted(-1 if k is None else k for k in model_files) != list(range(dp)):
            raise LayoutError(f"{tag_dir}: ZeRO-3 needs one zero_pp_rank_R_mp_rank_{mp_rank:02d}_model_states.pt "
                              f"per rank 0..{dp - 1}; found {sorted(str(k) for k in model_files)}")
    else:
        model_path = model_files.get(None)
        if model_path is None and not ranks and model_files:
            raise LayoutError(f"{tag_dir}: holds ZeRO-3 model-states files (zero_pp_rank_*_mp_rank_{mp_rank:02d}_"
                              "model_states.pt) but no *_optim_states.pt, which hold the weights; the copy is "
                              "incomplete: copy the whole tag directory again")
        if model_path is None:
            raise LayoutError(f"{tag_dir}: mp_rank_{mp_rank:02d}_model_states.pt is missing; copy the whole "
                              "tag directory again")
    model = load(model_path)
    if loaded is not None:
        loaded[model_path] = model
    param_groups = require(model, "param_shapes", model_path, "model-states")
    check_model_types(model, model_path)
    if optimizer != "ZeRO":
        stage = recorded_stage(model)
        optimizer = optimizer or stage0.optimizer_kind(model)
    what = describe(stage, optimizer, dp if ranks else None)
    if not ranks and (stage != 0 or param_groups is not None):
        raise LayoutError(f"{model_path}: records ZeRO stage {stage} (its ds_config and param_shapes), but the tag "
                          "holds no *_optim_states.pt, which hold its weights; the copy is incomplete: copy the "
                          "whole tag directory again")
    if optimizer == "ZeRO" and param_groups is None:
        raise LayoutError(f"{model_path}: records no param_shapes, but the optimizer files are ZeRO stage {stage}'s; "
                          "files from different saves are mixed: copy one save's tag directory again")
    module = model.get("module") or {}
    shared = model.get("shared_params") or {}
    buffer_names = list(model.get("buffer_names") or [])

    tensors: "OrderedDict[str, TensorPlan]" = OrderedDict()
    notes: List[str] = []
    if not ranks:
        shared = stage0.plan_stage0(model, model_path, module, set(buffer_names), tensors, what)
    elif optimizer == "BF16_Optimizer":
        plan_bf16_optimizer(ranks, param_groups, model_path, tensors, module, what)
        plan_zero12_frozen(model, model_path, tensors)
    elif stage == 3:
        plan_zero3(ranks, param_groups, model_path, tensors)
        plan_zero3_frozen(model_files, dp, tensors, model)
    elif isinstance(experts, autoep.AutoEPExperts):
        autoep_router = autoep.plan_autoep(ranks, param_groups, model_path, tensors, module, model, experts, notes,
                                           plan_group=zero12.plan_group, partition_count=zero12._partition_count,
                                           module_copy=zero12.module_copy, shape_of=recorded_shape)
        plan_zero12_frozen(model, model_path, tensors)
    else:
        plan_zero12(ranks, param_groups, model_path, tensors, module, notes=notes, experts=experts)
        plan_zero12_frozen(model, model_path, tensors)
    for name in buffer_names:
        ref = module.get(name)
        if isinstance(ref, TensorRef):
            tensors[name] = TensorPlan(name, ref.shape, ref.dtype, [[tensor_pieces(ref, 0, ref.numel)]],
                                       kind="buffer")
    if stage != 3:
        # ZeRO-1 keeps frozen parameters only in the module state dict.
        for name, ref in module.items():
            if name in tensors or name in shared or not isinstance(ref, TensorRef):
                continue
            tensors[name] = TensorPlan(name, ref.shape, ref.dtype, [[tensor_pieces(ref, 0, ref.numel)]],
                                       kind="frozen")
    module_dtypes = {ref.dtype for ref in module.values() if isinstance(ref, TensorRef)}
    module_dtype = module_dtypes.pop() if len(module_dtypes) == 1 else None
    if out_dtype is not None and stage != 3 and out_dtype == module_dtype:
        # The 16-bit (or fp32) module weights are saved whole: copy them instead of casting masters.
        for name, t in tensors.items():
            ref = module.get(name)
            if t.kind == "master" and isinstance(ref, TensorRef) and ref.shape == t.shape:
                tensors[name] = TensorPlan(name, t.shape, ref.dtype, [[tensor_pieces(ref, 0, ref.numel)]],
                                           kind="module", module_check=t.module_check)

    # Parameters the module records (ZeRO-3: empty placeholders) with no weights anywhere in the save.
    params = [n for n, r in module.items() if isinstance(r, TensorRef) and n not in buffer_names]
    missing = [n for n in params if n not in tensors and n not in shared]
    if isinstance(experts, autoep.AutoEPExperts) and ranks and stage in (1, 2):
        autoep.finish_autoep(tensors, module, experts, autoep_router, model_path)  # the model's router names

    # Output order = the model's state_dict order (as save_pretrained writes it), then the rest.
    ordered = [tensors.pop(n) for n in list(module) if n in tensors]
    ordered += list(tensors.values())
    read = {model_path}
    for t in ordered:
        for part in t.parts:
            read.update(pieces_paths(part))  # (a ZeRO-3 StridedPieces part: its rank files, no piece made)
    files = sorted(read)
    dtypes = {"master": "F32"} if any(t.kind == "master" for t in ordered) or ranks else {}
    if module_dtype is not None:
        dtypes["module"] = module_dtype
    plan = ExportPlan(engine="deepspeed", source=tag_dir, tag=None, tensors=ordered,
                      aliases={str(k): str(v) for k, v in shared.items()}, dtypes=dtypes, files=files,
                      detail={"zero_stage": stage, "optimizer": optimizer, "dp_size": dp or recorded_dp(model),
                              "mp_size": 1, "mp_axis": "none", "mp_axis_reason": None})
    if missing:
        plan.detail["missing_tensors"] = missing
    unread = stage0.masters_unread(model, model_path, {t.name: t for t in ordered}, what) if not ranks else None
    if unread:
        plan.detail["dtype_required"] = {"dtype": unread[0], "reason": unread[1]}
        plan.notes.append(f"16-bit module weights, fp32 masters not read ({plan.detail['optimizer']}): "
                          + (f"export with --dtype {unread[0]}" if unread[0] else "not exportable yet"))
    if stage >= 2 and model.get("frozen_param_shapes") is None:
        # ZeRO-2/3 record frozen parameters ({} when there are none) unless saved without them.
        plan.detail["exclude_frozen_parameters"] = True
        plan.notes.append("saved with exclude_frozen_parameters=True: frozen parameters are not in this checkpoint "
                          "(the model's config names them; without one nothing records them)")
    version = model.get("ds_version")  # every release records it; the layout never depends on it
    plan.engine_version = version if isinstance(version, str) else None
    plan.notes.extend(notes)
    if ranks and ranks[0].prefix:
        plan.notes.append(f"optimizer files carry the {ranks[0].prefix}_ prefix (mixed-precision training)")
    return plan, model.get("universal_checkpoint_info")
