"""The ordered source registry: which source reads a checkpoint, and the passes every plan gets.

A **source** is a module of this package (``sources/<name>.py``) that follows
:class:`~.protocol.Source`: ``NAME``, ``LOOKS_FOR``, ``MEMORY_NAMES``, ``OPTIONS`` (the
:class:`~.protocol.SourceOption` s it takes), ``detect(path, tag)``, ``config_candidates(path, tag)``
and ``plan(ctx)`` (``ctx``: a :class:`~.protocol.PlanContext`). :func:`register` checks each
module when :data:`SOURCES` is built, so a module that breaks the protocol fails at import with
what is wrong, never halfway through an export.

Every "which engine wrote this directory?" question is answered here (:func:`find_source`,
:func:`engine_checkpoint`); no other module sniffs for another source's files.

:func:`plan_with` builds the :class:`~.protocol.PlanContext` (the config ``config.json`` read once
for every pass) and runs the shared passes on the plan of the source that claims the path: config
discovery, the PEFT adapter pass (:mod:`.peft`: a checkpoint of a ``PeftModel`` becomes its adapter
directory), tied aliases, the Hub-layout conversion, the output dtype decision (:mod:`..dtype_rule`,
with the model class's fp32-kept modules for a 16-bit export) and :func:`~..plan.check_plan`.
Adding a source is one module and one line in :data:`SOURCES` (docs/architecture.md, "Adding a
source").
"""

import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..errors import CheckpointError, option
from ..guards import check_inside, plan_paths, source_root
from ..supported_inputs import SRC_HINT
from ..formats.names import CONFIG_NAME
from ..plan import ExportPlan
from ..convert import hub_layout
from ..convert.passes import drop_tied_aliases, find_config_dir, finish_plan, tie_embeddings
from . import dcp, deepspeed, fsdp_rank_files, hf_dir, megatron, peft, universal
from .deepspeed import pipeline as deepspeed_pipeline
from .fp32_modules import keep_for_plan
from .protocol import PlanContext, Source, SourceOption, check_source, hook, parse_options

__all__ = ["SOURCES", "register", "find_source", "engine_checkpoint", "declared_options", "check_options",
           "plan_with", "integrity_problems", "is_universal_dir"]


def register(*sources: Source) -> Tuple[Source, ...]:
    """``sources``, in order, each checked against the protocol
    (:class:`~.protocol.SourceProtocolError` naming the module and what it lacks)."""
    accepted: List[Source] = []
    for source in sources:
        check_source(source, accepted, everyone=sources)
        accepted.append(source)
    return tuple(accepted)


# In order: the first whose detect() claims the path reads it.
SOURCES = register(
    universal,  # ds_to_universal output (the directory itself, or the tag naming one)
    megatron,  # Megatron-Core (torch_dist is a DCP directory; verl's rank files share latest_checkpointed_iteration.txt)
    dcp,  # torch DCP (FSDP, Accelerate save_state, Trainer checkpoint-N under FSDP): before HF weights beside it
    fsdp_rank_files,  # per-rank torch.save FSDP state dicts (verl, SkyRL, Accelerate use_dcp=False)
    hf_dir,  # an HF directory, unless a DeepSpeed checkpoint also resolves there (its YIELDS_TO)
    deepspeed_pipeline,  # a DeepSpeed PipelineModule save (layer_XX files in the tag): before the ZeRO reader
    deepspeed,  # a DeepSpeed save dir, tag dir or Trainer checkpoint-N
)


def _claims(source: Source, path: str, tag: Optional[str]) -> bool:
    """``source`` detects ``path`` and no source it yields to holds a complete checkpoint there."""
    if not source.detect(path, tag):
        return False
    yields = hook(source, "YIELDS_TO")
    return not any(s.NAME in yields and hook(s, "holds_checkpoint")(path) for s in SOURCES)


def find_source(path: str, tag: Optional[str] = None) -> Source:
    """The first source of :data:`SOURCES` that claims ``path``; :class:`~..errors.CheckpointError`
    listing what was looked for when none does."""
    for source in SOURCES:
        if _claims(source, path, tag):
            return source
    newest = newest_trainer_checkpoint(path)
    if newest is not None:  # a Trainer output_dir: it records no "latest", so the user picks one
        raise CheckpointError(f"{path}: a Trainer output_dir, not a checkpoint; pass one of its checkpoint-N "
                              f"directories, the newest is {newest}")
    looked = "; ".join(s.LOOKS_FOR for s in SOURCES)
    raise CheckpointError(f"{path}: no checkpoint found there (looked for {looked}); {SRC_HINT}")


def newest_trainer_checkpoint(path: str) -> Optional[str]:
    """``path/checkpoint-N`` with the largest N when ``path`` holds such directories (a Trainer
    ``output_dir``, as transformers' ``get_last_checkpoint`` picks it), else None."""
    try:
        steps = [(int(n.split("-", 1)[1]), n) for n in os.listdir(path)
                 if re.fullmatch(r"checkpoint-\d+", n) and os.path.isdir(os.path.join(path, n))]
    except OSError:
        return None
    return os.path.join(path, max(steps)[1]) if steps else None


def engine_checkpoint(path: str) -> Optional[str]:
    """The ``NAME`` of the source that reads ``path`` when it holds a training engine's checkpoint
    (DeepSpeed, torch DCP...), None when it holds none (or only HF weights: ``hf_dir``)."""
    for source in SOURCES:
        if _claims(source, path, None):
            return None if source is hf_dir else source.NAME
    return None


def integrity_problems(ranges: Mapping[str, Sequence[Tuple[int, int]]]) -> Dict[str, List[str]]:
    """The damage found in the files a plan reads (``ranges``: path -> its ``(offset, nbytes)`` ranges),
    by path (``[]``: sound): each registered source's ``check_integrity`` hook first (a torch DCP
    archive per chunk), then the CRC-32 torch's zip records for every byte range of every other zip
    file. Verify reports each problem as a difference."""
    import zipfile

    from ..formats.torch_files import check_crc

    out: Dict[str, List[str]] = {}
    for source in SOURCES:
        out.update(hook(source, "check_integrity")({p: r for p, r in ranges.items() if p not in out}))
    for path in sorted(set(ranges) - set(out)):
        if zipfile.is_zipfile(path):
            out[path] = [f"{path}: entry {entry} fails its CRC-32 check (the checksum torch wrote with it): the "
                         "source file is damaged, copy it again" for entry in check_crc(path, ranges[path])]
    return out


def is_universal_dir(path: str) -> bool:
    """``path`` is a DeepSpeed universal checkpoint (what ``hf-ckpt universal`` writes)."""
    return universal.is_universal_dir(path)


def declared_options() -> Dict[str, SourceOption]:
    """Every option a registered source declares, by name (one declaration per name)."""
    out: Dict[str, SourceOption] = {}
    for source in SOURCES:
        for opt in source.OPTIONS:
            out.setdefault(opt.name, opt)
    return out


def check_options(options: Optional[Mapping[str, Any]]) -> Dict[str, Any]:
    """``options`` parsed against what the registered sources declare, before anything is read;
    :class:`~..errors.OptionError` for an option no source takes or a value its parser refuses."""
    return parse_options({k: v for k, v in (options or {}).items() if v is not None and v != []},
                         declared_options())


def plan_with(source: Source, path: str, *, tag: Optional[str] = None, dtype: Optional[str] = None,
              config: Optional[str] = None, options: Optional[Mapping[str, Any]] = None,
              layout_cache: bool = True, keep_fp32_lists: bool = False, peft_base: bool = False) -> ExportPlan:
    """``source``'s plan of ``path`` with the shared passes applied (see the module doc).
    ``options``: parsed source options (:func:`check_options`); those ``source`` does not declare
    are left out, with a note. ``layout_cache``: whether the Hub-layout pass may answer from its
    cache. ``keep_fp32_lists``: record the model class's fp32-kept modules whatever the dtype
    (``inspect`` shows them), from the same config read. ``peft_base``: the plan of the base model a
    PeftModel's state dict holds (:func:`.peft.base_plan`), not of its adapter."""
    options = dict(options or {})
    mine = {o.name: o for o in source.OPTIONS}
    ignored = sorted(set(options) - set(mine))
    ctx_options = {name: (list(o.default) if isinstance(o.default, list) else o.default) for name, o in mine.items()}
    ctx_options.update({k: v for k, v in options.items() if k in mine})
    adapter_config = None
    if config is not None and peft.is_adapter_config_dir(config):
        adapter_config, config = config, None  # --config names a PEFT adapter's directory
    if config is not None and not os.path.isfile(os.path.join(config, CONFIG_NAME)):
        raise CheckpointError(f"{config}: no config.json there; pass {option('config', 'PATH')} the model's "
                              "config.json or the directory holding it (e.g. from model.config.save_pretrained(dir))")
    config_dir = config if config is not None else find_config_dir(source.config_candidates(path, tag))
    ctx = PlanContext(path, tag=tag, dtype=dtype, options=ctx_options, config_dir=config_dir)
    plan = source.plan(ctx)
    # Every file the plan reads lies in the checkpoint's tree: a link leading out of it would mix
    # another file's bytes into the export silently.
    check_inside(plan_paths(plan), source_root(path), what="a file of the checkpoint")
    plan.config_dir = config_dir
    if ignored:
        plan.notes.append(f"option(s) {', '.join(ignored)} do not apply to a {source.NAME} checkpoint: ignored")
    if peft_base:
        plan = peft.base_plan(plan, path)
    else:
        plan = peft.adapter_plan(plan, path, config=adapter_config)  # a PEFT checkpoint: the adapter only
    if plan.adapter is None and config_dir is None:
        plan.notes.append("no config.json found next to the checkpoint: pass --config DIR, or the "
                          "exported directory will not load with from_pretrained")
    elif plan.adapter is None and source.MEMORY_NAMES:
        if hook(source, "TIED_UNDER_BOTH_NAMES"):
            tie_embeddings(plan, ctx)
        drop_tied_aliases(plan, ctx)
        hub_layout.convert_plan(plan, ctx.config, use_cache=layout_cache)
    # The fp32-kept lists come from the same config read (the plan's config directory is the context's).
    keep = keep_for_plan(plan, dtype, (lambda: ctx.config) if plan.config_dir == config_dir else None,
                         always=keep_fp32_lists)
    return finish_plan(plan, dtype, keep)
