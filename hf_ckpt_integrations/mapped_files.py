"""Read-only memory maps of source files, shared by every read of a run (planning checks,
the writer's byte copies, verify)."""

import mmap
import threading
from typing import Dict

from .formats.file_ranges import short_read

__all__ = ["MappedFiles"]


class MappedFiles:
    """Read-only mmaps of source files, opened once and shared by all reads of a run."""

    def __init__(self) -> None:
        self._maps: Dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()  # the writer's worker threads share one instance

    def get(self, path: str) -> mmap.mmap:
        with self._lock:
            m = self._maps.get(path)
            if m is None:
                with open(path, "rb") as fh:
                    m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                self._maps[path] = m
            return m

    def read(self, path: str, offset: int, nbytes: int) -> memoryview:
        """``nbytes`` bytes at ``offset`` of ``path``; :func:`~.formats.file_ranges.short_read` when
        the file ends first (a slice of a map never reads past its end: it comes back short)."""
        view = memoryview(self.get(path))[offset:offset + nbytes]
        if len(view) != nbytes:
            raise short_read(path, offset + nbytes)
        return view

    def close(self) -> None:
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a view is still alive; the GC closes it
                pass
        self._maps.clear()

    def __enter__(self) -> "MappedFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
