"""Make distributed HuggingFace training checkpoints correct, lean and loadable.

Importing the package is cheap: the engine integrations (which import transformers,
accelerate, ColossalAI) load on first use.
"""

from .api import export_checkpoint, inspect_checkpoint, verify_checkpoint
from .errors import CheckpointError, DestinationError, LayoutError, UnsafeCheckpointError

__version__ = "0.1.0"

__all__ = [
    "export_checkpoint",
    "inspect_checkpoint",
    "verify_checkpoint",
    "CheckpointError",
    "UnsafeCheckpointError",
    "LayoutError",
    "DestinationError",
    "__version__",
]
