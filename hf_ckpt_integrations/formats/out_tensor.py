"""The one descriptor of a tensor to write, shared by every writer (safetensors shards, ``.bin``
shards, the ``torch.save`` files of a universal checkpoint)."""

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Tuple

from .dtypes import SIZES

__all__ = ["OutTensor"]


@dataclass
class OutTensor:
    """One tensor to write: its header facts, and ``chunks()`` yielding its row-major bytes in order,
    as bytes-like objects and/or :class:`~.file_ranges.FileRange` s (copied from the file, bounded).
    ``chunks`` is called once, while the file is written (``None``: sizes only, never written); the
    bytes must add up to :attr:`nbytes` (every writer checks). ``drain``, for a tensor produced by a
    collective (a live ZeRO-3 gather): the same read with its bytes dropped, on the ranks that do
    not write it."""

    name: str
    dtype: str  # safetensors name: F32, BF16, ...
    shape: Tuple[int, ...]
    chunks: Optional[Callable[[], Iterable]]
    drain: Optional[Callable[[], None]] = None

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return SIZES[self.dtype] * self.numel

    def stride(self) -> Tuple[int, ...]:
        """torch's contiguous strides (a dimension of size 0 counts as 1)."""
        out, step = [], 1
        for s in reversed(self.shape):
            out.append(step)
            step *= max(s, 1)
        return tuple(reversed(out))

