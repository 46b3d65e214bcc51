"""The ordered source registry: which source reads a checkpoint, and the passes every plan gets.

A **source** is a module of this package (``sources/<name>.py``) exposing:

- ``NAME`` — the engine name plans carry (``"deepspeed"``);
- ``LOOKS_FOR`` — what it recognises, in words (listed when no source matches);
- ``MEMORY_NAMES`` — True when its tensor names are the model's in-memory names (the Hub-layout
  pass and the tied-weight policy then apply), False when they are already what
  ``save_pretrained`` wrote; optionally ``TIED_UNDER_BOTH_NAMES`` (its state dicts hold a tied
  weight under both names: :func:`~.passes.tie_embeddings` runs first);
- ``detect(path, tag) -> bool`` — reads names only (never a pickle): does this source claim
  ``path``? A claim is final: a damaged checkpoint of a source's kind is refused by its
  ``plan`` with the precise reason, rather than offered to the next source;
- ``config_candidates(path, tag) -> [dir, ...]`` — where its users keep ``config.json``;
- ``plan(path, *, tag, dtype, config_dir, tp_rules) -> ExportPlan`` — the plan from metadata only.

:func:`build_plan` asks the sources of :data:`SOURCES` in order and runs the shared passes on
the plan of the first that claims the path: config discovery, the PEFT adapter pass
(:mod:`.peft`: a checkpoint of a ``PeftModel`` becomes its adapter directory), tied aliases, the
Hub-layout conversion, the output dtype decision (:mod:`..dtype_rule`, with the model class's
fp32-kept modules for a 16-bit export) and :func:`~..plan.check_plan`. Adding a source is one
module and one line in :data:`SOURCES` (docs/architecture.md, "Adding a source").
"""

import os
from typing import Optional

from ..errors import CheckpointError
from ..formats.names import CONFIG_NAME
from ..plan import ExportPlan, check_plan, decide_dtypes
from . import dcp, deepspeed, hf_dir, hub_layout, peft, universal
from .fp32_modules import keep_for_plan
from .passes import drop_tied_aliases, find_config_dir, tie_embeddings

__all__ = ["SOURCES", "find_source", "plan_with"]

# In order: the first whose detect() claims the path reads it.
SOURCES = (
    universal,  # ds_to_universal output (the directory itself, or the tag naming one)
    dcp,  # torch DCP (FSDP, Accelerate save_state, Trainer checkpoint-N under FSDP): before HF weights beside it
    hf_dir,  # an HF directory, unless it also holds a DeepSpeed checkpoint (a Trainer checkpoint-N)
    deepspeed,  # a DeepSpeed save dir, tag dir or Trainer checkpoint-N
)


def find_source(path: str, tag: Optional[str] = None):
    """The first source of :data:`SOURCES` that claims ``path``; :class:`~..errors.CheckpointError`
    listing what was looked for when none does."""
    for source in SOURCES:
        if source.detect(path, tag):
            return source
    looked = "; ".join(s.LOOKS_FOR for s in SOURCES)
    raise CheckpointError(f"{path}: no checkpoint found there (looked for {looked}); pass a DeepSpeed save dir, "
                          "a tag dir, a Trainer checkpoint-N dir or an HF directory")


def plan_with(source, path: str, *, tag: Optional[str] = None, dtype: Optional[str] = None,
              config: Optional[str] = None, tp_rules=None, layout_cache: bool = True) -> ExportPlan:
    """``source``'s plan of ``path`` with the shared passes applied (see the module doc);
    ``layout_cache``: whether the Hub-layout pass may answer from its cache."""
    adapter_config = None
    if config is not None and peft.is_adapter_config_dir(config):
        adapter_config, config = config, None  # --config names a PEFT adapter's directory
    if config is not None and not os.path.isfile(os.path.join(config, CONFIG_NAME)):
        raise CheckpointError(f"{config}: no config.json there; pass --config a directory holding the "
                              "model's config.json (e.g. from model.config.save_pretrained(dir))")
    config_dir = config if config is not None else find_config_dir(source.config_candidates(path, tag))
    plan = source.plan(path, tag=tag, dtype=dtype, config_dir=config_dir, tp_rules=tp_rules)
    plan.config_dir = config_dir
    plan = peft.adapter_plan(plan, path, config=adapter_config)  # a PEFT checkpoint: the adapter only
    if plan.adapter is None and config_dir is None:
        plan.notes.append("no config.json found next to the checkpoint: pass --config DIR, or the "
                          "exported directory will not load with from_pretrained")
    elif plan.adapter is None and source.MEMORY_NAMES:
        if getattr(source, "TIED_UNDER_BOTH_NAMES", False):
            tie_embeddings(plan)
        drop_tied_aliases(plan)
        hub_layout.convert_plan(plan, use_cache=layout_cache)
    decide_dtypes(plan, dtype, keep_for_plan(plan, dtype))
    check_plan(plan)
    return plan
