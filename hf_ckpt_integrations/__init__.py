"""Make distributed HuggingFace training checkpoints correct, lean and loadable.

Importing the package is cheap: the engine integrations (which import transformers,
accelerate, ColossalAI) load on first use.
"""

from typing import Any

from .api import export_checkpoint, inspect_checkpoint, verify_checkpoint
from ._version import __version__
from .errors import CheckpointError, DestinationError, LayoutError, UnsafeCheckpointError

__all__ = [
    "export_checkpoint",
    "inspect_checkpoint",
    "verify_checkpoint",
    "CheckpointError",
    "UnsafeCheckpointError",
    "LayoutError",
    "DestinationError",
    "ConsolidatedCheckpointCallback",
    "install_accelerate_hooks",
    "install_colossalai_hooks",
    "lean_state_dict",
    "write_universal_checkpoint",
    "__version__",
]

# Save-time integrations load on first use (they import transformers / accelerate / torch).
_LAZY = {
    "ConsolidatedCheckpointCallback": ".integrations.trainer",
    "install_accelerate_hooks": ".integrations.accelerate",
    "install_colossalai_hooks": ".integrations.colossalai",
    "lean_state_dict": ".lean",
    "write_universal_checkpoint": ".universal_writer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
