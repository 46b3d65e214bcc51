"""Errors raised for checkpoints the package refuses.

Every message names the file (or tensor) and says what to do; the CLI prints it as one
``error:`` line (through :func:`one_line`) and exits with :data:`EXIT_BAD_INPUT`. Anything else
that escapes is a bug: one ``error:`` line and :data:`EXIT_INTERNAL`. A message that names an
option builds it with :func:`option`, so the Python API says ``overwrite=True`` where the CLI
says ``--overwrite``.
"""

import contextlib
import reprlib
from typing import Iterator

__all__ = [
    "EXIT_OK",
    "EXIT_DIFFERENT",
    "EXIT_BAD_INPUT",
    "EXIT_INTERNAL",
    "one_line",
    "short_repr",
    "CheckpointError",
    "UnsafeCheckpointError",
    "LayoutError",
    "DestinationError",
    "OptionError",
    "option",
    "cli_spelling",
]

EXIT_OK = 0
EXIT_DIFFERENT = 1
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


def one_line(text: object) -> str:
    """``text`` with every control character escaped (``\\n``, ``\\x1b``...), so a message that
    quotes a hostile file name or tag stays one line and cannot drive the terminal."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


# How a message names an option: the Python API's keyword (``overwrite=True``) unless the CLI is the
# front door (``--overwrite``). The CLI owns its process, so one flag set for the call is enough
# (worker threads raise with the same spelling).
_CLI = [False]


def option(name: str, value: str = "") -> str:
    """Option ``name`` (the API keyword, ``"weights_only"``) as the caller typed it: ``--weights-only
    VALUE`` on the CLI, ``weights_only=VALUE`` in Python (``value`` defaults to a flag: ``=True``)."""
    if _CLI[0]:
        return f"--{name.replace('_', '-')}" + (f" {value}" if value else "")
    return f"{name}={value or 'True'}"


@contextlib.contextmanager
def cli_spelling() -> Iterator[None]:
    """Within: :func:`option` spells options as CLI flags (``hf-ckpt``'s ``main`` enters it)."""
    before, _CLI[0] = _CLI[0], True
    try:
        yield
    finally:
        _CLI[0] = before


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def short_repr(value: object) -> str:
    """``repr`` for a value read from a file, bounded in depth and length (a DAG's full repr is 2^N)."""
    return _REPR.repr(value)


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


class OptionError(CheckpointError, ValueError):
    """An option of an export call that cannot be honoured (``dtype="fp8"``, ``max_shard_size="banana"``).
    Also a ``ValueError``, which callers of the option parsers caught before."""
