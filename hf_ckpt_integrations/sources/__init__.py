"""Sources: one per engine layout. A source reads metadata and returns an :class:`~..plan.ExportPlan`."""

import os

from ..errors import CheckpointError
from ..plan import check_plan
from ..guards import bad_metadata_as_input, check_tag_name, config_problem, refuse_unreadable_layouts

__all__ = ["build_plan"]


def build_plan(src, *, tag=None, dtype=None, config=None, tp_rules=None):
    """Build the export plan for any supported checkpoint directory ``src``, checked with
    :func:`~..plan.check_plan` (the writer never starts on a plan safetensors could not load).

    Raises only :class:`~..errors.CheckpointError` for bad input: metadata of an unexpected type
    or shape (which a source's own checks did not name) is reported as a
    :class:`~..errors.LayoutError` naming ``src`` (:func:`~..guards.bad_metadata_as_input`).
    """
    src = os.fspath(src)
    if not src.strip():
        raise CheckpointError("the source is an empty path (an unset shell variable?); pass the checkpoint "
                              "directory")
    if not os.path.exists(src):
        raise CheckpointError(f"{src}: does not exist; pass a DeepSpeed save dir, a tag dir or a "
                              "Trainer checkpoint-N dir")
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: is a file; pass the directory that holds it (a DeepSpeed save dir, "
                              "tag dir or Trainer checkpoint-N dir)")
    if tag is not None:
        check_tag_name(tag, "--tag")
    with bad_metadata_as_input(src):
        plan = _build_plan(src, tag, dtype, config, tp_rules)
        check_plan(plan)
    if plan.config_dir is None and plan.adapter is None:  # say why a config.json beside the checkpoint was not used
        problem = config_problem(src)
        if problem and os.path.lexists(os.path.join(src, "config.json")):
            plan.notes.append(f"{problem}; pass --config DIR holding the model's config.json")
    return plan


def _build_plan(src, tag, dtype, config, tp_rules):
    from . import peft

    adapter_config = None
    if config is not None and os.path.isfile(os.path.join(config, peft.ADAPTER_CONFIG_NAME)) and \
            not os.path.lexists(os.path.join(config, "config.json")):
        adapter_config, config = config, None  # --config names the adapter's directory
    return peft.adapter_plan(_engine_plan(src, tag, dtype, config, tp_rules), src, config=adapter_config)


def _engine_plan(src, tag, dtype, config, tp_rules):
    from . import dcp, deepspeed, hf_dir, hub_layout, universal

    # A universal checkpoint (ds_to_universal output): the directory itself, or a tag naming one.
    for cand in ([os.path.join(src, tag)] if tag else []) + [src]:
        if universal.is_universal_dir(cand):
            config_dir = config if config is not None else deepspeed.find_config_dir(
                [cand, os.path.dirname(cand), os.path.dirname(os.path.dirname(cand))])
            plan = universal.build_plan(cand, config_dir=config_dir)
            if config_dir is not None:
                deepspeed.drop_tied_aliases(plan)
                hub_layout.convert_plan(plan)
            return plan
    # A torch DCP checkpoint (FSDP, Accelerate save_state, Trainer checkpoint-N under FSDP, torchtitan);
    # it comes before HF weights beside it (a checkpoint-N the save-time callback completed).
    dcp_dir = dcp.find_dcp_dir(src) if tag is None else None
    if dcp_dir is not None:
        config_dir = config if config is not None else deepspeed.find_config_dir(
            [src, dcp_dir, os.path.dirname(os.path.abspath(src))])
        plan = dcp.build_plan(dcp_dir, config_dir=config_dir, source=os.path.abspath(src))
        if config_dir is not None:
            dcp.tie_aliases(plan)
            hub_layout.convert_plan(plan)
        return plan
    # An HF-format directory (ColossalAI's own save, save_pretrained, an earlier export) — unless it
    # also holds a DeepSpeed checkpoint (a Trainer checkpoint-N), whose fp32 masters come first.
    if tag is None and hf_dir.is_hf_dir(src) and not _has_deepspeed(src):
        config_dir = config if config is not None else deepspeed.find_config_dir([src])
        return hf_dir.build_plan(src, config_dir=config_dir)
    tag_dir, _ = deepspeed.resolve_tag_dir(src, tag)
    refuse_unreadable_layouts(tag_dir, os.listdir(tag_dir))
    return deepspeed.build_plan(src, tag=tag, dtype=dtype, config=config, tp_rules=tp_rules)


def _has_deepspeed(src):
    from . import deepspeed

    try:
        deepspeed.resolve_tag_dir(src)
        return True
    except CheckpointError:
        return False
