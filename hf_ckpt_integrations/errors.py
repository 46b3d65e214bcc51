"""Errors raised for checkpoints the package refuses.

Every message names the file (or tensor) and says what to do; the CLI prints it as one
``error:`` line and exits with :data:`EXIT_BAD_INPUT`.
"""

__all__ = [
    "EXIT_OK",
    "EXIT_DIFFERENT",
    "EXIT_BAD_INPUT",
    "CheckpointError",
    "UnsafeCheckpointError",
    "LayoutError",
    "DestinationError",
]

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2


class CheckpointError(Exception):
    """A checkpoint (or destination) that cannot be exported as asked.

    ``str(err)`` is a complete sentence: what is wrong, where, and the fix.
    """


class UnsafeCheckpointError(CheckpointError):
    """A pickle that would import or call something outside the allowlist: refused unread."""


class LayoutError(CheckpointError):
    """Files that are readable but do not assemble into a consistent model."""


class DestinationError(CheckpointError):
    """The output directory cannot be written as asked (exists, not writable, disk full)."""
