"""Sources: one per engine layout. A source reads metadata and returns an :class:`~..plan.ExportPlan`.

Which source reads a checkpoint is decided by the ordered registry (:mod:`.registry`), which also
runs the passes every plan gets; :func:`build_plan` is the one entry point.
"""

import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

from ..errors import CheckpointError
from ..supported_inputs import SRC_HINT
from ..guards import bad_metadata_as_input, check_tag_name, config_problem

if TYPE_CHECKING:
    from ..plan import ExportPlan
    from .protocol import Source

__all__ = ["build_plan"]


def build_plan(src: Union[str, "os.PathLike[str]"], *, tag: Optional[str] = None, dtype: Optional[str] = None,
               config: Optional[str] = None, tp_rules: Optional[Sequence[str]] = None,
               source_options: Optional[Mapping[str, Any]] = None, layout_cache: bool = True,
               keep_fp32_lists: bool = False, peft_base: bool = False,
               source: Optional["Source"] = None) -> "ExportPlan":
    """Build the export plan for any supported checkpoint directory ``src``: the first source of the
    registry that claims it plans it, then the shared passes run, ending with
    :func:`~..plan.check_plan` (the writer never starts on a plan safetensors could not load).

    ``source_options``: ``{name: value}`` for options the sources declare (``OPTIONS`` in their
    modules, :class:`~.protocol.SourceOption`), checked before anything is read; ``tp_rules`` is
    DeepSpeed's ``tp_rules`` option under its own name.

    Raises only :class:`~..errors.CheckpointError` for bad input: metadata of an unexpected type
    or shape (which a source's own checks did not name) is reported as a
    :class:`~..errors.LayoutError` naming ``src`` (:func:`~..guards.bad_metadata_as_input`).
    ``layout_cache=False``: the Hub layout is derived from transformers, never read from its cache.
    ``keep_fp32_lists``: the plan records the model class's fp32-kept modules whatever the dtype
    (what ``inspect`` shows), from the export's one config read. ``peft_base``: plan the base model a
    PEFT checkpoint holds beside its adapter (``--merge-adapters`` without ``--base``). ``source``: the
    source :func:`~.registry.find_source` already found for ``src`` and ``tag`` (not looked up again).
    """
    src = os.fspath(src)
    if not src.strip():
        raise CheckpointError("the source is an empty path (an unset shell variable?); pass the checkpoint "
                              "directory")
    if not os.path.exists(src):
        raise CheckpointError(f"{src}: does not exist; {SRC_HINT}")
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: is a file; pass the directory that holds it ({SRC_HINT.removeprefix('pass ')})")
    if tag is not None:
        check_tag_name(tag, "--tag")
    from .registry import check_options, find_source, plan_with

    given = dict(source_options or {})
    if tp_rules:  # --tp-rule is the tp_rules option's own spelling; both together add up
        extra = given.get("tp_rules") or []
        given["tp_rules"] = (list(extra) if isinstance(extra, (list, tuple)) else [extra]) + list(tp_rules)
    options = check_options(given)
    with bad_metadata_as_input(src):
        source = source if source is not None else find_source(src, tag)
        plan = plan_with(source, src, tag=tag, dtype=dtype, config=config, options=options,
                         layout_cache=layout_cache, keep_fp32_lists=keep_fp32_lists, peft_base=peft_base)
    if plan.config_dir is None and plan.adapter is None:  # say why a config.json beside the checkpoint was not used
        problem = config_problem(src)
        if problem and os.path.lexists(os.path.join(src, "config.json")):
            plan.notes.append(f"{problem}; pass --config DIR holding the model's config.json")
    return plan
