"""How the writer creates a file: never through a path someone else may have planted.

Every file an export or a save creates (shards, the index, config copies, the lock, owner markers,
the journal) is opened here: ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a new file, or nothing; a link or
file already at the name is an error, never followed and never truncated), optionally relative
to a directory file descriptor the caller opened and checked (``dir_fd``), so a path component
swapped for a link after the check does not redirect the write.
"""

import os
import secrets
import shutil
import stat
from typing import IO, Any, BinaryIO, Literal, Optional, TextIO, Union, overload

__all__ = ["create_file", "open_new", "open_dir", "replace_file", "NOFOLLOW"]

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# A path as callers hand it over (as guards.StrPath, which this module does not import).
_Path = Union[str, "os.PathLike[str]"]


def create_file(path: _Path, *, dir_fd: Optional[int] = None, mode: int = 0o644) -> int:
    """A descriptor (write-only) of a new regular file at ``path``; ``FileExistsError`` when anything,
    a symbolic link included, is already there."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | _CLOEXEC, mode, dir_fd=dir_fd)


@overload
def open_new(path: _Path, mode: Literal["wb"] = "wb", *, dir_fd: Optional[int] = None, **kwargs: Any) -> BinaryIO: ...


@overload
def open_new(path: _Path, mode: Literal["w"], *, dir_fd: Optional[int] = None, **kwargs: Any) -> TextIO: ...


def open_new(path: _Path, mode: str = "wb", *, dir_fd: Optional[int] = None, **kwargs: Any) -> IO[Any]:
    """:func:`create_file` as a file object (``mode`` ``"wb"`` or ``"w"``; ``kwargs`` go to ``os.fdopen``)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode={mode!r}: a new file is opened for writing only")
    fd = create_file(path, dir_fd=dir_fd)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def open_dir(path: _Path) -> int:
    """A descriptor of the directory ``path`` itself (the last component is not followed if it is a
    link: ``NotADirectoryError``/``OSError(ELOOP)``)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | NOFOLLOW | _CLOEXEC)
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotADirectoryError(path)
    return fd


def replace_file(path: _Path, data: bytes = b"", *, source: Optional[IO[bytes]] = None) -> None:
    """``path`` holds ``data`` (or the rest of the binary file object ``source``) afterwards: written
    to a new sibling, then renamed over ``path``, so a link or a hard link at ``path`` is replaced
    (the name), never written through."""
    directory, name = os.path.split(os.fspath(path))
    tmp = os.path.join(directory, f".{name}.hfckpt-new-{secrets.token_hex(6)}")
    try:
        with open_new(tmp) as fh:
            if source is not None:
                shutil.copyfileobj(source, fh)
            else:
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
