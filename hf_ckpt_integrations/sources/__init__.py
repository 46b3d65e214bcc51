"""Sources: one per engine layout. A source reads metadata and returns an :class:`~..plan.ExportPlan`."""

import os

from ..errors import CheckpointError

__all__ = ["build_plan"]


def build_plan(src, *, tag=None, dtype=None, config=None, tp_rules=None):
    """Build the export plan for any supported checkpoint directory ``src``."""
    src = os.fspath(src)
    if not os.path.exists(src):
        raise CheckpointError(f"{src}: does not exist; pass a DeepSpeed save dir, a tag dir or a "
                              "Trainer checkpoint-N dir")
    if not os.path.isdir(src):
        raise CheckpointError(f"{src}: is a file; pass the directory that holds it (a DeepSpeed save dir, "
                              "tag dir or Trainer checkpoint-N dir)")
    from . import deepspeed

    return deepspeed.build_plan(src, tag=tag, dtype=dtype, config=config, tp_rules=tp_rules)
