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

import errno
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from huggingface_hub import split_state_dict_into_shards_factory

from .assemble import iter_bytes, out_dtype_for
from .errors import DestinationError
from .plan import ExportPlan, dtype_from_name
from .safe_load import DTYPE_SIZES, MappedFiles

__all__ = ["OutTensor", "split_shards", "shard_order", "write_shard", "write_index", "copy_config_files", "Staging",
           "write_plan", "MAX_SHARD_SIZE", "SAFETENSORS_FILENAME_PATTERN", "INDEX_NAME", "TMP_MARKER",
           "CONFIG_FILES"]

MAX_SHARD_SIZE = "5GB"
SAFETENSORS_FILENAME_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TMP_MARKER = ".hfckpt-tmp-"
# Copied from the config directory when present: what from_pretrained and AutoTokenizer read.
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
                "preprocessor_config.json")


@dataclass
class OutTensor:
    """One tensor to write: its header facts, and ``chunks()`` yielding its bytes in order."""

    name: str
    dtype: str  # safetensors name: F32, BF16, ...
    shape: Tuple[int, ...]
    chunks: Callable[[], Iterable]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for s in self.shape:
            n *= s
        return n


def split_shards(tensors: Sequence[OutTensor], max_shard_size=MAX_SHARD_SIZE):
    """``huggingface_hub``'s split (in the given order), so names match ``save_pretrained``."""
    return split_state_dict_into_shards_factory(
        {t.name: t for t in tensors}, get_storage_size=lambda t: t.nbytes,
        filename_pattern=SAFETENSORS_FILENAME_PATTERN, max_shard_size=max_shard_size)


def _header(tensors: Sequence[OutTensor]) -> bytes:
    """safetensors header: u64 length, JSON, padded with spaces to 8 bytes."""
    meta = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        meta[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


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
    with open(path, "wb") as fh:
        fh.write(_header(tensors))
        for t in tensors:
            got = 0
            for chunk in t.chunks():
                fh.write(chunk)
                got += len(chunk)
            if got != t.nbytes:
                raise DestinationError(f"{t.name}: produced {got} bytes, expected {t.nbytes}; please report this "
                                       "with the `hf-ckpt inspect --json` output")
            if progress is not None:
                progress.update(got)
            total += got
        fh.flush()
        os.fsync(fh.fileno())
    return total


def write_index(directory, split, tensors: Sequence[OutTensor]) -> None:
    """Write ``model.safetensors.index.json`` (only meaningful when ``split.is_sharded``)."""
    index = {"metadata": {"total_parameters": sum(t.nbytes // DTYPE_SIZES[t.dtype] for t in tensors),
                          "total_size": sum(t.nbytes for t in tensors)},
             "weight_map": dict(sorted(split.tensor_to_filename.items()))}
    with open(os.path.join(directory, INDEX_NAME), "w", encoding="utf-8") as fh:
        json.dump(index, fh, indent=2, sort_keys=True)
        fh.write("\n")


def copy_config_files(config_dir: Optional[str], directory) -> List[str]:
    copied = []
    if config_dir:
        for name in CONFIG_FILES:
            p = os.path.join(config_dir, name)
            if os.path.isfile(p) and os.path.abspath(p) != os.path.abspath(os.path.join(directory, name)):
                shutil.copyfile(p, os.path.join(directory, name))
                copied.append(name)
    return copied


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


class Staging:
    """A temporary sibling of ``dst`` that becomes ``dst`` on :meth:`commit`, or vanishes.

    ``with Staging(dst, overwrite=...) as tmp: ...write into tmp...`` — on a clean exit the
    directory is renamed into place (replacing ``dst`` only with ``overwrite``); on any
    exception it is removed and ``dst`` is untouched.
    """

    def __init__(self, dst, *, overwrite: bool = False):
        self.dst = os.path.abspath(os.fspath(dst))
        self.overwrite = overwrite
        self.path = os.path.join(os.path.dirname(self.dst),
                                 f".{os.path.basename(self.dst)}{TMP_MARKER}{os.getpid()}")

    def __enter__(self) -> str:
        if os.path.lexists(self.dst) and not self.overwrite:
            raise DestinationError(f"{self.dst}: already exists; choose a new directory or pass --overwrite")
        if os.path.lexists(self.dst) and not os.path.isdir(self.dst):
            raise DestinationError(f"{self.dst}: exists and is not a directory; remove it or choose another path")
        try:
            os.makedirs(os.path.dirname(self.dst), exist_ok=True)
            if os.path.lexists(self.path):
                shutil.rmtree(self.path)
            os.mkdir(self.path)
        except OSError as e:
            raise disk_error(self.dst, e) from e
        return self.path

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(exc, OSError):
                raise disk_error(self.dst, exc) from exc
            return False
        try:
            fsync_dir(self.path)
            if not os.path.lexists(self.dst):
                os.rename(self.path, self.dst)
            else:
                old = os.path.join(os.path.dirname(self.dst),
                                   f".{os.path.basename(self.dst)}{TMP_MARKER}old-{os.getpid()}")
                os.rename(self.dst, old)
                os.rename(self.path, self.dst)
                shutil.rmtree(old, ignore_errors=True)
            fsync_dir(os.path.dirname(self.dst))
        except OSError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise disk_error(self.dst, e) from e
        return False


def progress_bar(total, desc, quiet):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=quiet or not sys.stderr.isatty(),
                leave=False)


def plan_tensors(plan: ExportPlan, dtype: Optional[str], files: MappedFiles) -> List[OutTensor]:
    """The plan's tensors as :class:`OutTensor`, reading through ``files``."""
    requested = dtype_from_name(dtype)
    if requested is None and "F32" in plan.dtypes.values():
        requested = "F32"  # default: the fp32 masters, and every other float in the same dtype
    out = []
    for t in plan.tensors:
        d = out_dtype_for(t, requested)
        out.append(OutTensor(t.name, d, tuple(t.shape), lambda t=t, d=d: iter_bytes(t, d, files)))
    return out


def write_plan(plan: ExportPlan, dst, *, dtype: Optional[str] = None, max_shard_size=MAX_SHARD_SIZE,
               overwrite: bool = False, quiet: bool = False) -> dict:
    """Write ``plan`` to ``dst`` in one process; return a report (files, bytes, seconds).

    Raises :class:`DestinationError` when ``dst`` exists (without ``overwrite``) or cannot be
    written; on any failure nothing is left behind but what was at ``dst`` before.
    """
    started = time.perf_counter()
    with MappedFiles() as files:
        tensors = plan_tensors(plan, dtype, files)
        split = split_shards(tensors, max_shard_size)
        by_name = {t.name: t for t in tensors}
        total = sum(t.nbytes for t in tensors)
        with Staging(dst, overwrite=overwrite) as tmp, progress_bar(total, "export", quiet) as bar:
            for filename, names in split.filename_to_tensors.items():
                write_shard(os.path.join(tmp, filename), [by_name[n] for n in names], bar)
            if split.is_sharded:
                write_index(tmp, split, tensors)
            copied = copy_config_files(plan.config_dir, tmp)
    dst = os.path.abspath(os.fspath(dst))
    names = sorted(os.listdir(dst))
    return {"destination": dst, "files": names, "shards": len(split.filename_to_tensors), "tensor_bytes": total,
            "bytes_on_disk": sum(os.path.getsize(os.path.join(dst, f)) for f in names), "config_files": copied,
            "seconds": round(time.perf_counter() - started, 3)}
