"""The restricted unpickler's memo (:mod:`.unpickler`): a list where :class:`pickle._Unpickler` keeps a dict."""

import pickle
from typing import Any

from ..errors import CheckpointError, short_repr

__all__ = ["Memo", "HOLE"]

HOLE = object()  # a memo index no PUT has stored (below one that was)


class Memo(list):
    """The unpickler's memo as a list: picklers number memo entries 0, 1, 2... (MEMOIZE always, PUT
    and BINPUT with the next free index), and a list holds one in 8 bytes where the dict of
    :class:`pickle._Unpickler` took ~80 (an int key and a slot). It matters: torch DCP's ``.metadata``
    memoizes ~20 objects per chunk (1.8M for 90,790 chunks: ~150 MB as a dict, 15 MB as a list).
    A PUT past the next index (no pickler writes one; a hand-made pickle may) leaves holes that a GET
    refuses as the dict memo did; an index over ``limit`` (the objects the unpickler may hold) is
    refused before anything is allocated for it."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __setitem__(self, i: Any, value: Any) -> None:  # type: ignore[override]
        n = len(self)
        if i == n:
            self.append(value)
        elif type(i) is not int or not 0 <= i < self.limit:
            raise CheckpointError(f"its pickle stores memo entry {short_repr(i)}, past the {self.limit} objects "
                                  "hf-ckpt holds for a pickle of its size")
        elif i < n:
            list.__setitem__(self, i, value)
        else:
            self.extend([HOLE] * (i - n))
            self.append(value)

    def get(self, i: int) -> Any:
        """Entry ``i``, refused (as the dict memo's KeyError was) when no PUT stored it."""
        if not 0 <= i < len(self) or list.__getitem__(self, i) is HOLE:
            raise pickle.UnpicklingError(f"Memo value not found at index {i}")
        return list.__getitem__(self, i)
