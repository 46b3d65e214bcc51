"""Write tensors as a HuggingFace directory, one shard at a time.

Layout exactly as ``save_pretrained`` writes it: ``model.safetensors`` or
``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (shard names from
``huggingface_hub``'s sharding helper), safetensors metadata ``{"format": "pt"}``, and the
config/tokenizer files copied over.

Building blocks, used by :func:`write_plan` (offline export) and by the save-time hooks:

1. :func:`split_shards` decides which tensor goes in which file (sizes only, no data);
2. :func:`write_shard` streams one file (header, then each tensor's bytes from its ``chunks``);
3. :func:`write_index` and :func:`copy_config_files` finish the directory;
4. :class:`Staging` holds all of it in a temporary sibling directory and renames it into place
   last, so the destination is absent, the previous complete export, or the new complete one.
"""

import contextlib
import errno
import math
import os
import shutil
import signal
import stat
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from .assemble import FileRange, iter_bytes
from .errors import DestinationError, OptionError
from .formats import names
from .formats.config import record_dtype, write_config
from .formats.dtypes import SIZES as DTYPE_SIZES, from_user as dtype_from_name
from .formats.names import ADAPTER_SAFETENSORS_NAME, CONFIG_FILES, MAX_SHARD_SIZE, SAFETENSORS_INDEX as INDEX_NAME
from .formats.names import SAFETENSORS_PATTERN as SAFETENSORS_FILENAME_PATTERN
from .formats.safetensors import encode_header
from .guards import check_destination, copyable_problem
from .plan import ExportPlan, decide_dtypes
from .safe_load import MappedFiles

__all__ = ["OutTensor", "split_shards", "shard_order", "write_shard", "write_index", "copy_config_files", "Staging",
           "set_config_dtype", "write_plan", "MAX_SHARD_SIZE", "SAFETENSORS_FILENAME_PATTERN", "INDEX_NAME",
           "TMP_MARKER", "CONFIG_FILES", "check_max_shard_size", "check_workers", "plan_inputs"]

TMP_MARKER = ".hfckpt-tmp-"


@dataclass
class OutTensor:
    """One tensor to write: its header facts, and ``chunks()`` yielding its bytes in order."""

    name: str
    dtype: str  # safetensors name: F32, BF16, ...
    shape: Tuple[int, ...]
    chunks: Callable[[], Iterable]

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)


def check_max_shard_size(max_shard_size) -> int:
    """``max_shard_size`` ("5GB", "500MB" or a byte count) in bytes; :class:`~.errors.OptionError` otherwise."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        size = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else max_shard_size
    except ValueError:
        size = None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise OptionError(f"max shard size {str(max_shard_size)[:40]!r}: not a size; pass e.g. 5GB, 500MB or a "
                          "number of bytes")
    return size


def check_workers(workers) -> int:
    """``workers`` if it is a whole number of at least 1; :class:`~.errors.OptionError` otherwise."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise OptionError(f"--workers {workers!r}: pass 1 or more")
    return workers


def plan_inputs(plan: ExportPlan) -> List[str]:
    """The directories an export of ``plan`` reads: what its destination must stay clear of."""
    return sorted({plan.source, *(os.path.dirname(f) for f in plan.files)} - {None, ""})


def split_shards(tensors: Sequence[OutTensor], max_shard_size=MAX_SHARD_SIZE):
    """``huggingface_hub``'s split (in the given order), so names match ``save_pretrained``."""
    return names.split_shards({t.name: t for t in tensors}, lambda t: t.nbytes, max_shard_size=max_shard_size)


def shard_order(tensors: Sequence[OutTensor]) -> List[OutTensor]:
    """The order :func:`write_shard` writes (and so calls ``chunks()`` of) ``tensors`` in.

    Collective sources (a live ZeRO-3 gather) need every rank to walk the same tensors in the same
    order, including the ranks that do not write: they iterate this list and drop the bytes.
    """
    return sorted(tensors, key=lambda t: (-DTYPE_SIZES[t.dtype], t.name))


def write_shard(path, tensors: Sequence[OutTensor], progress=None) -> int:
    """Write one safetensors file, streaming each tensor's chunks; return the tensor bytes written.

    Tensors are ordered largest dtype first, then by name (what safetensors itself does, keeping
    every tensor aligned). The file is fsynced before returning.
    """
    tensors = shard_order(tensors)
    total = 0
    sources = {}
    with open(path, "wb") as fh:
        fh.write(encode_header((t.name, t.dtype, t.shape) for t in tensors))
        for t in tensors:
            got = 0
            for chunk in t.chunks():
                if isinstance(chunk, FileRange):
                    fh.flush()
                    src = sources.get(chunk.path)
                    if src is None:
                        src = sources[chunk.path] = os.open(chunk.path, os.O_RDONLY)
                    _copy_range(src, fh.fileno(), chunk)
                else:
                    fh.write(chunk)
                got += len(chunk)
            # Drop the last chunk now: it may be a gathered parameter (live ZeRO-3 source), which
            # would otherwise stay alive while the next tensor is gathered.
            chunk = None
            if got != t.nbytes:
                raise DestinationError(f"{t.name}: produced {got} bytes, expected {t.nbytes}; please report this "
                                       "with the `hf-ckpt inspect --json` output")
            if progress is not None:
                progress.update(got)
            total += got
        fh.flush()
        os.fsync(fh.fileno())
    for fd in sources.values():
        os.close(fd)
    return total


_BLOCK = 16 * 2**20


def _copy_range(src: int, dst: int, r: FileRange) -> None:
    """Append ``r``'s bytes to ``dst`` (at its current offset): in the kernel where it can
    (``copy_file_range``), else through a bounded buffer."""
    offset, left = r.offset, r.nbytes
    use_kernel = hasattr(os, "copy_file_range")
    while left:
        if use_kernel:
            try:
                n = os.copy_file_range(src, dst, min(left, 1 << 30), offset)
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                use_kernel = False
                continue
        else:
            data = os.pread(src, min(left, _BLOCK), offset)
            n = len(data)
            view = memoryview(data)
            while view:
                view = view[os.write(dst, view):]
        if n == 0:
            raise DestinationError(f"{r.path}: ended {left} bytes early while copying (changed during the export?); "
                                   "export again from a checkpoint nobody is writing")
        offset += n
        left -= n


def write_index(directory, split, tensors: Sequence[OutTensor]) -> None:
    """Write ``model.safetensors.index.json`` (only meaningful when ``split.is_sharded``)."""
    names.write_index(directory, split.tensor_to_filename, total_size=sum(t.nbytes for t in tensors),
                      total_parameters=sum(t.nbytes // DTYPE_SIZES[t.dtype] for t in tensors))


def copy_config_files(config_dir: Optional[str], directory, skipped: Optional[List[str]] = None, *,
                      tensors: Optional[Sequence[OutTensor]] = None) -> List[str]:
    """The config files of ``config_dir`` copied into ``directory``, ``config.json`` recording the
    dtype of ``tensors`` (:func:`~.formats.config.write_config`, the one config writer)."""
    return write_config(directory, config_dir=config_dir, skipped=skipped,
                        tensor_dtypes=[t.dtype for t in tensors or ()])


@dataclass
class _OneFile:
    """A split into exactly the files named (the shape of ``huggingface_hub``'s split result)."""

    filename_to_tensors: dict
    is_sharded: bool = False


def copy_adapter_config(path: str, directory, skipped: List[str]) -> List[str]:
    """Copy the ``adapter_config.json`` at ``path`` into ``directory`` (a regular file only, as
    :func:`copy_config_files`); return the names copied."""
    problem = copyable_problem(path, os.path.dirname(path))
    if problem is not None:
        skipped.append(problem)
        return []
    name = os.path.basename(path)
    shutil.copyfile(os.path.realpath(path), os.path.join(directory, name))
    return [name]


def set_config_dtype(directory, tensors: Sequence[OutTensor]) -> None:
    """``directory/config.json`` records the dtype of ``tensors`` (:func:`~.formats.config.record_dtype`)."""
    record_dtype(directory, [t.dtype for t in tensors])


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_error(dst, e: OSError) -> DestinationError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DestinationError(f"{dst}: no space left while writing ({e.strerror}); free space or choose "
                                "another directory — nothing was written")
    return DestinationError(f"{dst}: cannot write ({e.strerror or e}); check the path and permissions — "
                            "nothing was written")


# renameat2(2) flags (Linux >= 3.15, glibc >= 2.28).
_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100


def _renameat2(src: str, dst: str, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the call or the flag is not available (the
    caller falls back to plain renames), OSError for a real failure (EEXIST, ENOSPC...)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # old kernel, or a file system without the flag (some FUSE/NFS)
    raise OSError(err, os.strerror(err), dst)


class Staging:
    """A temporary sibling of ``dst`` that becomes ``dst`` on a clean exit, or vanishes.

    ``with Staging(dst, overwrite=...) as tmp: ...write into tmp...`` — on a clean exit the
    directory is renamed into place (replacing ``dst`` only with ``overwrite``); on any
    exception it is removed and ``dst`` is untouched.

    Crash and concurrency safety (docs/reliability.md):

    - an exclusive ``flock`` on ``.<dst>.hfckpt-lock`` is held from ``__enter__`` to the end of
      ``__exit__``: a second writer into the same ``dst`` fails at once with a clear error;
    - holding the lock proves every ``.<dst>.hfckpt-tmp-*`` sibling belongs to a dead writer
      (killed, power loss): they are removed on entry, and a previous export parked as
      ``...-old-PID`` by an interrupted fallback replace is moved back first;
    - ``--overwrite`` swaps the directories in one ``renameat2(RENAME_EXCHANGE)`` on Linux, so
      ``dst`` is always the old complete export or the new one; elsewhere two renames (a crash
      between them is repaired by the next run, as above).

    What it removes, and nothing else: its own staging directory; with ``overwrite`` the previous
    ``dst``, which must be a flat directory of files (what an export is — never a directory
    holding subdirectories, such as a save dir, a home or the working directory); and temp
    siblings named ``.<dst>.hfckpt-tmp-*`` that are files, links (the link itself) or flat
    directories. ``dst`` is resolved through symbolic links first and must stay clear of
    ``inputs`` and ``configs`` (:func:`~.guards.check_destination`).
    """

    LOCK_SUFFIX = ".hfckpt-lock"

    def __init__(self, dst, *, overwrite: bool = False, inputs=(), configs=()):
        self.dst = check_destination(dst, inputs=inputs, configs=configs)
        self.overwrite = overwrite
        self._parent, base = os.path.dirname(self.dst), os.path.basename(self.dst)
        self._prefix = f".{base}{TMP_MARKER}"
        self.path = os.path.join(self._parent, f"{self._prefix}{os.getpid()}")
        self.lock_path = os.path.join(self._parent, f".{base}{self.LOCK_SUFFIX}")
        self._lock_fd = None
        self._done = False

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no lock, the rest still holds
            return
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise DestinationError(f"{self.dst}: another export into it is running (pid {holder} holds "
                                       f"{self.lock_path}); wait for it to finish or choose another directory")
            try:  # the previous holder unlinks the file before unlocking: retry on a fresh one
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                self._lock_fd = fd
                return
            os.close(fd)

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.unlink(self.lock_path)  # while still holding it (see _lock)
            except OSError:
                pass
            os.close(self._lock_fd)
            self._lock_fd = None

    def _remove_stale(self) -> None:
        """Under the lock: every temp sibling of ``dst`` is left over from a dead writer. Only
        what a writer makes is removed: a file, a link, or a flat directory of files."""
        stale = sorted(n for n in os.listdir(self._parent) if n.startswith(self._prefix))
        for n in stale:
            p = os.path.join(self._parent, n)
            if n.startswith(f"{self._prefix}old-") and not os.path.lexists(self.dst):
                os.rename(p, self.dst)  # the previous complete export, parked by a fallback replace
            elif not stat.S_ISDIR(os.lstat(p).st_mode):
                os.unlink(p)  # a file, or a link (never what it points at)
            elif _subdirectory(p) is None:
                shutil.rmtree(p)

    def _check_replaceable(self) -> None:
        """``dst`` exists: refuse unless ``overwrite`` and it is a flat directory (an export)."""
        if not self.overwrite:
            raise DestinationError(f"{self.dst}: already exists; choose a new directory or pass --overwrite")
        if not stat.S_ISDIR(os.lstat(self.dst).st_mode):
            raise DestinationError(f"{self.dst}: exists and is not a directory; remove it or choose another path")
        sub = _subdirectory(self.dst)
        if sub is not None:
            raise DestinationError(f"{self.dst}: holds a subdirectory ({sub}), so it is not an earlier export; "
                                   "--overwrite replaces only an export (a directory of files): remove it yourself "
                                   "or choose another directory")

    def __enter__(self) -> str:
        made = False
        try:
            try:
                os.makedirs(self._parent, exist_ok=True)
                self._lock()
                self._remove_stale()
                if os.path.lexists(self.dst):
                    self._check_replaceable()
                made = not os.path.lexists(self.path)
                os.mkdir(self.path)
            except OSError as e:
                raise disk_error(self.dst, e) from e
        except BaseException:
            # Also an interrupt (SIGINT/SIGTERM) that lands right after the mkdir, before the
            # `with` block owns the directory: remove it here, since __exit__ will not run.
            if made and os.path.isdir(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
            self._unlock()
            raise
        return self.path

    def __exit__(self, exc_type, exc, tb):
        if self._done:  # idempotent: the parallel writer may call it again on an interrupt
            return False
        self._done = True
        try:
            if exc_type is not None:
                shutil.rmtree(self.path, ignore_errors=True)
                if isinstance(exc, OSError):
                    raise disk_error(self.dst, exc) from exc
                return False
            try:
                fsync_dir(self.path)
                with _signals_held():  # an interrupt lands before the swap or after its cleanup
                    self._commit()
                fsync_dir(self._parent)
            except OSError as e:
                shutil.rmtree(self.path, ignore_errors=True)
                raise disk_error(self.dst, e) from e
            return False
        finally:
            self._unlock()

    def _commit(self) -> None:
        if not os.path.lexists(self.dst):
            if not _renameat2(self.path, self.dst, _RENAME_NOREPLACE):
                os.rename(self.path, self.dst)
        elif _renameat2(self.path, self.dst, _RENAME_EXCHANGE):
            shutil.rmtree(self.path, ignore_errors=True)  # now holds the previous export
        else:
            old = f"{self._prefix}old-{os.getpid()}"
            old = os.path.join(self._parent, old)
            os.rename(self.dst, old)
            os.rename(self.path, self.dst)
            shutil.rmtree(old, ignore_errors=True)


_HELD = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@contextlib.contextmanager
def _signals_held():
    """Delay SIGINT/SIGTERM/SIGHUP (POSIX) until the block is done: the swap and the removal of the
    previous export run to the end, and the interrupt is raised after them."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _subdirectory(path) -> Optional[str]:
    """The name of one subdirectory of ``path`` (not following links), or None for a flat directory."""
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
    return None


def progress_bar(total, desc, quiet):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=quiet or not sys.stderr.isatty(),
                leave=False)


def plan_tensors(plan: ExportPlan, dtype: Optional[str], files: MappedFiles, *, ranges: bool = False
                 ) -> List[OutTensor]:
    """The plan's tensors as :class:`OutTensor`, reading through ``files``; with ``ranges``, stored
    bytes come as :class:`~.assemble.FileRange` (only :func:`write_shard` consumes those)."""
    if (dtype is not None and dtype_from_name(dtype) != plan.out_dtype) or any(t.out_dtype is None
                                                                              for t in plan.tensors):
        decide_dtypes(plan, dtype)  # a plan built for another dtype (or by hand): decided here, once
    out = []
    for t in plan.tensors:
        d = t.out_dtype
        out.append(OutTensor(t.name, d, tuple(t.shape), lambda t=t, d=d: iter_bytes(t, d, files, ranges=ranges)))
    return out


def write_plan(plan: ExportPlan, dst, *, dtype: Optional[str] = None, max_shard_size=MAX_SHARD_SIZE,
               overwrite: bool = False, quiet: bool = False, workers: int = 1) -> dict:
    """Write ``plan`` to ``dst`` in one process; return a report (files, bytes, seconds).

    ``workers`` > 1 writes that many shards at once from a thread pool (file copies and fsyncs
    release the GIL; the bytes are identical to one worker's).

    Raises :class:`DestinationError` when ``dst`` exists (without ``overwrite``), is or holds or lies
    inside the source, or cannot be written; :class:`~.errors.OptionError` for a bad option; on any
    failure nothing is left behind but what was at ``dst`` before. Config files that are not copied
    (:func:`copy_config_files`) are listed in the report's ``warnings``.
    """
    started = time.perf_counter()
    max_shard_size = check_max_shard_size(max_shard_size)
    check_workers(workers)
    staging = Staging(dst, overwrite=overwrite, inputs=plan_inputs(plan), configs=[plan.config_dir])
    skipped: List[str] = []
    with MappedFiles() as files:
        tensors = plan_tensors(plan, dtype, files, ranges=True)
        if plan.adapter is not None:  # PeftModel.save_pretrained's one unsharded adapter file
            split = _OneFile({ADAPTER_SAFETENSORS_NAME: [t.name for t in tensors]})
        else:
            split = split_shards(tensors, max_shard_size)
        by_name = {t.name: t for t in tensors}
        total = sum(t.nbytes for t in tensors)
        with staging as tmp, progress_bar(total, "export", quiet) as bar:
            jobs = [(os.path.join(tmp, f), [by_name[n] for n in names])
                    for f, names in split.filename_to_tensors.items()]
            if workers > 1 and len(jobs) > 1:
                from concurrent.futures import ThreadPoolExecutor

                pool = ThreadPoolExecutor(min(workers, len(jobs)))
                try:
                    for future in [pool.submit(write_shard, path, ts, bar) for path, ts in jobs]:
                        future.result()  # the first failure propagates; Staging removes everything
                finally:  # on a failure or an interrupt, shards not yet started are not written
                    pool.shutdown(wait=True, cancel_futures=True)
            else:
                for path, ts in jobs:
                    write_shard(path, ts, bar)
            if split.is_sharded:
                write_index(tmp, split, tensors)
            if plan.adapter is not None:
                copied = copy_adapter_config(plan.adapter["config"], tmp, skipped)
            else:
                copied = copy_config_files(plan.config_dir, tmp, skipped, tensors=tensors)
    dst = staging.dst
    names = sorted(os.listdir(dst))
    return {"destination": dst, "files": names, "shards": len(split.filename_to_tensors), "tensor_bytes": total,
            "bytes_on_disk": sum(os.path.getsize(os.path.join(dst, f)) for f in names), "config_files": copied,
            "warnings": skipped, "seconds": round(time.perf_counter() - started, 3)}
