"""Write an :class:`~.plan.ExportPlan` as a HuggingFace directory, one shard at a time.

Layout exactly as ``save_pretrained`` writes it: ``model.safetensors`` or
``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (shard names from
``huggingface_hub``'s sharding helper), safetensors metadata ``{"format": "pt"}``, and the
config/tokenizer files copied over. Everything is written into a temporary sibling directory
and renamed into place last, so ``dst`` is either absent, the previous complete export (with
``overwrite``), or the new complete one.
"""

import errno
import json
import os
import shutil
import sys
import time
from typing import Optional

from huggingface_hub import split_state_dict_into_shards_factory

from .assemble import iter_bytes, out_dtype_for
from .errors import DestinationError
from .plan import ExportPlan, TensorPlan, dtype_from_name
from .safe_load import DTYPE_SIZES, MappedFiles

__all__ = ["write_plan", "MAX_SHARD_SIZE", "SAFETENSORS_FILENAME_PATTERN", "TMP_MARKER"]

MAX_SHARD_SIZE = "5GB"
SAFETENSORS_FILENAME_PATTERN = "model{suffix}.safetensors"
INDEX_NAME = "model.safetensors.index.json"
TMP_MARKER = ".hfckpt-tmp-"
# Copied from the config directory when present: what from_pretrained and AutoTokenizer read.
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
                "preprocessor_config.json")


def _header(entries) -> bytes:
    """safetensors header: u64 length, JSON, padded with spaces to 8 bytes."""
    meta = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _progress(total, desc, quiet):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                disable=quiet or not sys.stderr.isatty(), leave=False)


def write_plan(plan: ExportPlan, dst, *, dtype: Optional[str] = None, max_shard_size=MAX_SHARD_SIZE,
               overwrite: bool = False, quiet: bool = False) -> dict:
    """Write ``plan`` to ``dst``; return a report (files, bytes, seconds).

    Raises :class:`DestinationError` when ``dst`` exists (without ``overwrite``) or cannot be
    written; on any failure nothing is left behind but what was at ``dst`` before.
    """
    started = time.perf_counter()
    dst = os.path.abspath(os.fspath(dst))
    requested = dtype_from_name(dtype)
    if requested is None and "F32" in plan.dtypes.values():
        requested = "F32"  # default: the fp32 masters, and everything else in the same dtype
    if os.path.lexists(dst) and not overwrite:
        raise DestinationError(f"{dst}: already exists; choose a new directory or pass --overwrite")
    if os.path.lexists(dst) and not os.path.isdir(dst):
        raise DestinationError(f"{dst}: exists and is not a directory; remove it or choose another path")
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)

    out = {t.name: (t, out_dtype_for(t, requested)) for t in plan.tensors}
    split = split_state_dict_into_shards_factory(
        out, get_storage_size=lambda v: v[0].numel * DTYPE_SIZES[v[1]],
        filename_pattern=SAFETENSORS_FILENAME_PATTERN, max_shard_size=max_shard_size)
    total = sum(t.numel * DTYPE_SIZES[d] for t, d in out.values())

    tmp = os.path.join(parent, f".{os.path.basename(dst)}{TMP_MARKER}{os.getpid()}")
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    try:
        os.mkdir(tmp)
        written = 0
        with MappedFiles() as files, _progress(total, "export", quiet) as bar:
            for filename, names in split.filename_to_tensors.items():
                # Largest dtype first keeps every tensor aligned (what safetensors itself does).
                names = sorted(names, key=lambda n: (-DTYPE_SIZES[out[n][1]], n))
                entries = [(n, out[n][1], out[n][0].shape, out[n][0].numel * DTYPE_SIZES[out[n][1]]) for n in names]
                with open(os.path.join(tmp, filename), "wb") as fh:
                    fh.write(_header(entries))
                    for n in names:
                        t, d = out[n]
                        expect = t.numel * DTYPE_SIZES[d]
                        got = 0
                        for chunk in iter_bytes(t, d, files):
                            fh.write(chunk)
                            got += len(chunk)
                        if got != expect:
                            raise DestinationError(f"{n}: produced {got} bytes, expected {expect}; "
                                                   "please report this with `hf-ckpt inspect --json` output")
                        bar.update(got)
                        written += got
                    fh.flush()
                    os.fsync(fh.fileno())
        if split.is_sharded:
            index = {"metadata": {"total_parameters": sum(t.numel for t, _ in out.values()), "total_size": total},
                     "weight_map": dict(sorted(split.tensor_to_filename.items()))}
            with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as fh:
                json.dump(index, fh, indent=2, sort_keys=True)
                fh.write("\n")
        copied = []
        if plan.config_dir:
            for name in CONFIG_FILES:
                p = os.path.join(plan.config_dir, name)
                if os.path.isfile(p):
                    shutil.copyfile(p, os.path.join(tmp, name))
                    copied.append(name)
        _fsync_dir(tmp)
        _swap_into_place(tmp, dst)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DestinationError(f"{dst}: no space left while writing ({e.strerror}); free space or "
                                   "choose another directory — nothing was written") from e
        raise DestinationError(f"{dst}: cannot write ({e.strerror or e}); check the path and permissions "
                               "— nothing was written") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files_out = sorted(os.listdir(dst))
    return {"destination": dst, "files": files_out, "shards": len(split.filename_to_tensors),
            "tensor_bytes": total, "bytes_on_disk": sum(os.path.getsize(os.path.join(dst, f)) for f in files_out),
            "config_files": copied, "seconds": round(time.perf_counter() - started, 3)}


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap_into_place(tmp, dst):
    if not os.path.lexists(dst):
        os.rename(tmp, dst)
    else:
        old = f"{os.path.join(os.path.dirname(dst), '.' + os.path.basename(dst))}{TMP_MARKER}old-{os.getpid()}"
        os.rename(dst, old)
        os.rename(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(os.path.dirname(dst))
