"""Write tensors as a HuggingFace directory, one shard at a time.

Layout exactly as ``save_pretrained`` writes it: ``model.safetensors`` or
``model-0000K-of-0000N.safetensors`` plus ``model.safetensors.index.json`` (shard names from
``huggingface_hub``'s sharding helper), safetensors metadata ``{"format": "pt"}``, and the
config/tokenizer files copied over.

Building blocks of the one writer (:mod:`.orchestrator`, which every path runs — its module doc
gives the call order; commit strategies are in :mod:`.commit`):

1. :func:`split_shards` decides which tensor goes in which file (sizes only, no data);
2. :func:`write_shard` streams one file (header, then each tensor's bytes from its ``chunks``);
3. :func:`write_index` and :func:`~.formats.config.write_config` (the config and tokenizer files)
   finish the directory.

The front ends that run it: :func:`~.export.write_plan` (offline, one process),
:func:`~.parallel.write_plan_parallel` (under ``torchrun``), the save-time hooks
(:mod:`.integrations`).
"""

import os
import shutil
import sys
from typing import List, Optional, Sequence

from .assemble import iter_bytes
from .commit import TMP_MARKER, SiblingSwap, disk_error
from .errors import DestinationError, OptionError, option
from .formats import names
from .formats.dtypes import SIZES as DTYPE_SIZES, from_user as dtype_from_name
from .formats.file_ranges import FileRange, SourceFiles, copy_range
from .formats.names import CONFIG_FILES, MAX_SHARD_SIZE, SAFETENSORS_INDEX as INDEX_NAME
from .formats.names import SAFETENSORS_PATTERN as SAFETENSORS_FILENAME_PATTERN
from .formats.out_tensor import OutTensor
from .formats.safetensors import encode_header
from .guards import copyable_problem
from .mapped_files import MappedFiles
from .outfiles import open_new
from .plan import ExportPlan, LivePiece, StridedPieces, TensorPlan, decide_dtypes

__all__ = ["OutTensor", "split_shards", "shard_order", "write_shard", "write_index", "MAX_SHARD_SIZE",
           "SAFETENSORS_FILENAME_PATTERN", "INDEX_NAME", "TMP_MARKER", "CONFIG_FILES", "check_max_shard_size",
           "check_workers", "plan_inputs", "export_strategy", "disk_error", "plan_tensors", "out_tensor", "decided"]

def check_max_shard_size(max_shard_size) -> int:
    """``max_shard_size`` in bytes: what ``save_pretrained`` takes ("5GB", "500MB"; "5GiB", "500MiB" as
    transformers' ``convert_file_size_to_int`` reads them), a byte count (``5000000`` or
    ``"5000000"``), or None: the installed transformers' ``save_pretrained`` default
    (:func:`~.formats.names.default_max_shard_size`). :class:`~.errors.OptionError` otherwise."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if max_shard_size is None:
        max_shard_size = names.default_max_shard_size()
    size = max_shard_size
    if isinstance(size, str):
        text = size.strip()
        binary = {"KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}.get(text[-3:].upper())
        try:
            size = (int(text) if text.isdigit() else int(text[:-3]) * binary if binary
                    else parse_size_to_int(text))
        except ValueError:
            size = None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise OptionError(f"{option('max_shard_size', str(max_shard_size)[:40])}: not a size; pass e.g. 5GB, "
                          "500MB, 5GiB or a number of bytes (5000000)")
    return size


def check_workers(workers) -> int:
    """``workers`` if it is a whole number of at least 1; :class:`~.errors.OptionError` otherwise."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise OptionError(f"{option('workers', repr(workers))}: pass 1 or more")
    return workers


def plan_inputs(plan: ExportPlan) -> List[str]:
    """The directories an export of ``plan`` reads: what its destination must stay clear of (the
    source, the directories of its files, a PEFT adapter's config directory)."""
    adapter_config = (plan.adapter or {}).get("config")
    return sorted({plan.source, *(os.path.dirname(f) for f in plan.files),
                   os.path.dirname(adapter_config) if adapter_config else None} - {None, ""})


def export_strategy(dst, *plans: ExportPlan, overwrite: Optional[bool] = False) -> SiblingSwap:
    """The commit strategy of an export written from ``plans`` (a merge reads two: the adapter and
    its base), its destination guarded by the one check every output path goes through
    (:func:`~.guards.check_destination`, run in ``begin``): not the source, the directory of a file
    read, an adapter's or model's config directory, nor an ancestor or (inputs) a descendant of one."""
    inputs = sorted({d for p in plans for d in plan_inputs(p)})
    adapter_configs = [os.path.dirname(p.adapter["config"]) for p in plans if (p.adapter or {}).get("config")]
    inputs = [(d, "the adapter config directory") for d in adapter_configs] + inputs  # named first
    return SiblingSwap(dst, overwrite=overwrite, inputs=inputs, configs=[p.config_dir for p in plans])


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
    with SourceFiles() as sources, open_new(path) as fh:  # a new file: never through a link planted at its name
        fh.write(encode_header((t.name, t.dtype, t.shape) for t in tensors))
        for t in tensors:
            got = 0
            for chunk in t.chunks():
                if isinstance(chunk, FileRange):
                    fh.flush()
                    copy_range(sources.fd(chunk.path), fh.fileno(), chunk)
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
    return total


def write_index(directory, split, tensors: Sequence[OutTensor]) -> None:
    """Write ``model.safetensors.index.json`` (only meaningful when ``split.is_sharded``)."""
    names.write_index(directory, split.tensor_to_filename, total_size=sum(t.nbytes for t in tensors),
                      total_parameters=sum(t.nbytes // DTYPE_SIZES[t.dtype] for t in tensors))


def copy_adapter_config(path: str, directory, skipped: List[str]) -> List[str]:
    """Copy the ``adapter_config.json`` at ``path`` into ``directory`` (a regular file only, as
    :func:`~.formats.config.copy_config_files`); return the names copied."""
    problem = copyable_problem(path, os.path.dirname(path))
    if problem is not None:
        skipped.append(problem)
        return []
    name = os.path.basename(path)
    with open(os.path.realpath(path), "rb") as src, open_new(os.path.join(directory, name)) as out:
        shutil.copyfileobj(src, out)
    return [name]


def progress_bar(total, desc, quiet, unit="B"):
    """A tqdm bar on stderr, shown only on a terminal (a log or a pipe gets no bar) and not ``quiet``."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=quiet or not sys.stderr.isatty(),
                leave=False)


def decided(plan: ExportPlan, dtype: Optional[str] = None) -> ExportPlan:
    """``plan`` with every tensor's output dtype decided for ``dtype``: as it is when the registry's
    passes already decided that (:func:`~.plan.decide_dtypes`); a plan built for another dtype (or
    by hand) is decided here, once, by the same rule. Returns ``plan``."""
    if (dtype is not None and dtype_from_name(dtype) != plan.out_dtype) or any(t.out_dtype is None
                                                                              for t in plan.tensors):
        from .sources.fp32_modules import keep_for_plan

        decide_dtypes(plan, dtype, keep_for_plan(plan, dtype))
    return plan


def plan_tensors(plan: ExportPlan, dtype: Optional[str], files: Optional[MappedFiles], *, ranges: bool = False,
                 assignment=None) -> List[OutTensor]:
    """The writer's per-shard inputs for ``plan`` (:func:`decided` for ``dtype`` first), reading
    through ``files``; with ``ranges``, stored bytes come as :class:`~.formats.file_ranges.FileRange`
    (:func:`write_shard` and :mod:`~.formats.torch_save_out` copy those). A tensor produced on request
    (:class:`~.plan.LivePiece`) is read on behalf of the rank ``assignment.writer_of(name)`` names
    (``chunks()`` there; ``drain()``, the same read with its bytes dropped, elsewhere); without an
    ``assignment`` it is sizes only (what the assignment itself needs)."""
    decided(plan, dtype)
    return [out_tensor(t, t.out_dtype, files, ranges=ranges, assignment=assignment) for t in plan.tensors]


def out_tensor(t: TensorPlan, dtype: str, files: Optional[MappedFiles], *, ranges: bool = False,
               assignment=None) -> OutTensor:
    """The :class:`~.formats.out_tensor.OutTensor` of ``t`` in ``dtype`` (:func:`plan_tensors`, one
    tensor); ``files`` None: the tensor maps what it must (only slices to assemble) in a
    :class:`~.mapped_files.MappedFiles` of its own, closed once its bytes are read."""
    if _all_live(t):
        return _produced(t, dtype, assignment)
    if files is None:
        def chunks():
            with MappedFiles() as own:
                yield from iter_bytes(t, dtype, own, ranges=ranges)
    else:
        def chunks():
            return iter_bytes(t, dtype, files, ranges=ranges)
    return OutTensor(t.name, dtype, tuple(t.shape), chunks)


def _all_live(t: TensorPlan) -> bool:
    """Whether every piece of ``t`` is a :class:`~.plan.LivePiece` (and it has one); a ZeRO-3
    :class:`~.plan.StridedPieces` part holds stored pieces only, answered without making them."""
    if any(isinstance(part, StridedPieces) for part in t.parts):
        return False
    pieces = [p for part in t.parts for p in part]
    return bool(pieces) and all(isinstance(p, LivePiece) for p in pieces)


def _produced(t: TensorPlan, d: str, assignment) -> OutTensor:
    if assignment is None:
        return OutTensor(t.name, d, tuple(t.shape), None)
    writer = assignment.writer_of(t.name)
    pieces = [p for part in t.parts for p in part]

    def chunks():
        for p in pieces:
            yield from p.read(p.lo, p.hi, writer, d)

    def drain():
        for _ in chunks():
            pass

    return OutTensor(t.name, d, tuple(t.shape), chunks, drain)
