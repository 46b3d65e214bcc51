"""Reading byte ranges of source files: the one reader every writer path goes through.

A :class:`FileRange` is ``nbytes`` bytes at ``offset`` of ``path``. :func:`read_into` fills a
buffer from one, :func:`iter_range` yields one a bounded buffer at a time, :func:`copy_range`
copies one file to file (in the kernel where it can). They fail one way: a file that ends before
the range does (truncated, or cut while the export reads it) is a
:class:`~..errors.LayoutError` naming the file, its size and the byte the range needed
(:func:`short_read`), never a short result or zeros. :class:`SourceFiles` keeps the source
descriptors open across the tensors and files of one writer.
"""

import errno
import os
from collections import OrderedDict
from typing import Iterator, NamedTuple, Union

from ..errors import LayoutError

__all__ = ["FileRange", "SourceFiles", "read_into", "iter_range", "copy_range", "short_read", "BLOCK"]

BLOCK = 16 * 2**20  # the bounded buffer of a user-space copy


class FileRange(NamedTuple):
    """``nbytes`` bytes at ``offset`` of ``path``, to be copied by the kernel (``os.copy_file_range``)
    rather than read: the pages never enter this process, so memory stays flat whatever the model size."""

    path: str
    offset: int
    nbytes: int

    def __len__(self) -> int:
        return self.nbytes


def short_read(path: str, end: int, fd: Union[int, None] = None) -> LayoutError:
    """The error for a file that ends before byte ``end`` a read needed (``fd``: to state its size)."""
    try:
        size = f"{os.fstat(fd).st_size if fd is not None else os.stat(path).st_size} bytes long: "
    except OSError:
        size = ""
    return LayoutError(f"{path}: ends before byte {end}, which the checkpoint's metadata reads ({size}truncated, "
                       "or changed during the export?); export from a complete checkpoint nobody is writing")


def read_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    """Fill ``buf`` with the bytes at ``offset`` of the open file ``fd`` (``path``, for the error);
    :func:`short_read` when the file ends first."""
    end = offset + len(buf)
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise short_read(path, end, fd)
        buf, offset = buf[n:], offset + n


def iter_range(fd: int, r: FileRange, buf: Union[bytearray, memoryview]) -> Iterator[memoryview]:
    """``r``'s bytes (``fd`` open on ``r.path``) as views of ``buf``, each valid until the next is
    requested; :func:`short_read` when the file ends first."""
    view = memoryview(buf)
    offset, left = r.offset, r.nbytes
    while left:
        n = min(left, len(view))
        read_into(fd, view[:n], offset, r.path)
        yield view[:n]
        offset += n
        left -= n


def copy_range(src: int, dst: int, r: FileRange) -> None:
    """Append ``r``'s bytes (``src`` open on ``r.path``) to ``dst`` at its current offset: in the
    kernel where it can (``copy_file_range``), else through a :data:`BLOCK` buffer."""
    offset, left = r.offset, r.nbytes
    if hasattr(os, "copy_file_range"):
        while left:
            try:
                n = os.copy_file_range(src, dst, min(left, 1 << 30), offset)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                break  # not between these files: the rest through user space
            if n == 0:
                raise short_read(r.path, r.offset + r.nbytes, src)
            offset += n
            left -= n
    if left:
        for chunk in iter_range(src, FileRange(r.path, offset, left), bytearray(min(left, BLOCK))):
            while chunk:
                chunk = chunk[os.write(dst, chunk):]


class SourceFiles:
    """Read-only descriptors of the source files ranges are read from, kept open across the records
    and files of one writer (a ZeRO tensor is a range of every rank's file, and a universal
    checkpoint writes three files per parameter: reopening them cost ~7,000 ``open`` calls for a 1 GB
    8-rank save). At most ``limit`` stay open, the least recently used closed first. A context
    manager; :meth:`close` closes them all."""

    def __init__(self, limit: int = 64):
        self.limit: int = limit
        self.fds: "OrderedDict[str, int]" = OrderedDict()

    def fd(self, path: str) -> int:
        fd = self.fds.pop(path, None)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            if len(self.fds) >= self.limit:
                os.close(self.fds.popitem(last=False)[1])
        self.fds[path] = fd
        return fd

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popitem()[1])

    def __enter__(self) -> "SourceFiles":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
