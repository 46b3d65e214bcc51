"""A cache of answers transformers gave (the Hub layout of a model, its fp32-kept modules): a
speed-up, never an authority.

Deriving an answer imports torch and transformers and builds a meta model (seconds, hundreds of
MB); every ``checkpoint-N`` of a run asks the same question. Entries live under
``$HF_CKPT_CACHE``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, ``/hf_ckpt_integrations/<kind>``, are
read only from a directory that is this user's and writable by no one else (anyone who can write an
entry could choose the names an export writes), as regular owner-only files opened
``O_NOFOLLOW | O_NONBLOCK`` (a FIFO is a miss, never a wait). Each entry carries its key and a digest
of key and answer; any bad entry (malformed, deep JSON, another key) is a miss, never an error.
Callers still validate what an answer says before using it.
"""

import hashlib
import json
import os
import secrets
import stat
from typing import Any, Optional

__all__ = ["cache_key", "read_answer", "write_answer"]

ENTRY_LIMIT = 64 * 2**20
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def cache_key(kind: str, inputs: Any) -> str:
    """SHA-256 of everything an answer of ``kind`` depends on: this package's and transformers'
    releases and the JSON-able ``inputs``."""
    import importlib.metadata as md

    from .._version import __version__

    text = json.dumps([kind, __version__, md.version("transformers"), inputs], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _digest(key: str, answer: Any) -> str:
    return hashlib.sha256((key + json.dumps(answer, sort_keys=True)).encode()).hexdigest()


def _cache_dir(kind: str, create: bool) -> Optional[int]:
    """An open descriptor of ``<root>/<kind>``, or None (derive, do not cache) unless it and the root
    are real directories (not symlinks) owned by this user and writable by no one else."""
    root = os.environ.get("HF_CKPT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_ckpt_integrations")
    if not os.path.isabs(root):
        return None
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _O_CLOEXEC
    fd = None
    try:
        if create:
            os.makedirs(os.path.join(root, kind), mode=0o700, exist_ok=True)
        for i, part in enumerate((root, kind)):
            new = os.open(part, flags) if i == 0 else os.open(part, flags, dir_fd=fd)
            if fd is not None:
                os.close(fd)
            fd = new
            st = os.fstat(fd)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                os.close(fd)
                return None
        return fd
    except OSError:
        if fd is not None:
            os.close(fd)
        return None


def read_answer(kind: str, key: str) -> Optional[Any]:
    """The answer stored under ``key``, or None (a miss) for anything but an intact entry of ours."""
    dfd = _cache_dir(kind, create=False)
    if dfd is None:
        return None
    try:
        fd = os.open(key + ".json", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | _O_CLOEXEC, dir_fd=dfd)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 \
                    or st.st_size > ENTRY_LIMIT:
                return None
            entry = json.loads(fh.read(ENTRY_LIMIT + 1))
        answer = entry["answer"]
        if entry["key"] != key or entry["digest"] != _digest(key, answer):
            return None
        return answer
    except Exception:  # OSError, bad JSON, RecursionError, a wrong type anywhere: a miss
        return None
    finally:
        os.close(dfd)


def write_answer(kind: str, key: str, answer: Any) -> None:
    """Store ``answer`` under ``key``: a new owner-only file (``O_EXCL``, never through a link), renamed
    into place. Best effort: a read-only home, a directory not ours or a full disk only cost the next
    export the derivation."""
    dfd = _cache_dir(kind, create=True)
    if dfd is None:
        return
    tmp = f".{key}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    try:
        data = json.dumps({"key": key, "answer": answer, "digest": _digest(key, answer)}).encode()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=dfd)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, key + ".json", src_dir_fd=dfd, dst_dir_fd=dfd)
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
    finally:
        os.close(dfd)
