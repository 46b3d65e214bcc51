"""torch Distributed Checkpoint (DCP) directories -> :class:`~..plan.ExportPlan`.

What ``torch.distributed.checkpoint.save`` writes with its ``FileSystemWriter`` (FSDP2
``fully_shard``, FSDP1 ``SHARDED_STATE_DICT``, Accelerate ``save_state``, the Trainer's
``checkpoint-N/pytorch_model_fsdp_0``, torchtitan): a ``.metadata`` pickle and ``*.distcp``
files. ``.metadata`` (a ``Metadata`` dataclass) records every state-dict entry: for a tensor its
global size, dtype and chunks (N-D ``offsets``/``sizes``, one per rank's shard), and for each
chunk (keyed by ``MetadataIndex(fqn, offsets)``) a ``_StorageInfo(relative_path, offset,
length)``: bytes ``[offset, offset + length)`` of that ``.distcp`` file hold the chunk as one
``torch.save`` zip archive. ``planner_data`` maps each flattened key to its path in the nested
state dict (``("model", "model.embed_tokens.weight")`` under Accelerate).

Nothing here imports torch or runs the pickles: ``.metadata`` is read by
:func:`~..formats.unpickler.load_pickle` with the allowlist :data:`ALLOWED` (the DCP dataclasses rebuilt as
inert :class:`~..formats.unpickler.Record` s), each chunk's archive by :func:`~..formats.torch_files.load` over its
byte range. Chunks become :class:`~..plan.Chunk` s placed by their N-D offsets (checked to tile
each tensor exactly once): dim-0 shards (FSDP2) are byte ranges laid end to end, any other
layout (a 2-D FSDP x TP mesh) is assembled from its chunks. Optimizer state and non-tensor
entries are skipped.
"""

import json
import math
import os
import re
from functools import partial
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from .. import guards
from ..formats import torch_files, unpickler
from ..formats.dtypes import SIZES as DTYPE_SIZES
from ..errors import CheckpointError, LayoutError, one_line, short_repr
from ..plan import Chunk, ExportPlan, Piece, TensorPlan, check_tiling, row_major_pieces
from ..formats.unpickler import Record, record_type
from .protocol import PlanContext

__all__ = ["ALLOWED", "find_dcp_dir", "read_metadata", "data_archives", "check_archive_crcs", "plan_dcp_dir", "DcpTensor",
           "NAME", "LOOKS_FOR", "MEMORY_NAMES", "TIED_UNDER_BOTH_NAMES", "OPTIONS", "detect", "config_candidates",
           "plan"]

# The source protocol (sources/registry.py).
NAME = "torch-dcp"
LOOKS_FOR = ("a torch DCP checkpoint (.metadata + *.distcp, or pytorch_model_fsdp_0/ holding one; "
             "HuggingFaceStorageWriter's shard-*-model-*.safetensors)")
MEMORY_NAMES = True  # the model's own parameter names: the Hub-layout pass applies
TIED_UNDER_BOTH_NAMES = True  # FSDP state dicts hold a tied weight under both names (passes.tie_embeddings)
OPTIONS = ()

METADATA = ".metadata"
# Where Accelerate's save_state / save_model and the Trainer put the model's DCP checkpoint.
_ACCELERATE_DIRS = ("pytorch_model_fsdp_0",)
# Top-level state-dict entries that are not the model (torchtitan, Accelerate, hand-written saves).
_NOT_MODEL = {"optimizer", "optim", "optimizers", "optimizer_state", "lr_scheduler", "lr_schedulers", "scheduler",
              "dataloader", "train_state", "rng", "rng_state", "extra_state", "step", "epoch"}


def _layout(name: Any) -> str:
    if type(name) is not str:
        raise CheckpointError(f"torch layout {short_repr(name)} is not a name")
    return name


def _mem_format(value: Any) -> int:
    if type(value) is not int:
        raise CheckpointError(f"memory format {short_repr(value)} is not a number")
    return value


def _path(*parts: Any) -> str:
    # StorageMeta.checkpoint_id, a pathlib path: a string of atoms, never used for reading
    if len(parts) > 256 or not all(type(p) is str for p in parts):
        raise CheckpointError(f"path {short_repr(parts)} is not made of strings")
    return "/".join(parts)


_RECORDS = {name: record_type(name) for name in (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta", "_StorageInfo")}
_META = {n: _RECORDS[n] for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                  "TensorProperties", "MetadataIndex", "StorageMeta")}
# module -> name -> stand-in: what torch's own DCP writers pickle into .metadata (torch 2.2 -> 2.13).
ALLOWED: Dict[str, Dict[str, Any]] = {
    "torch": dict(torch_files.TORCH_GLOBALS),
    "torch.serialization": {"_get_layout": _layout},
    "torch.distributed.checkpoint.metadata": {**_META, "_MEM_FORMAT_ENCODING": _mem_format},
    # torch < 2.4 kept TensorProperties with the sharded-tensor metadata
    "torch.distributed._shard.sharded_tensor.metadata": {"TensorProperties": _RECORDS["TensorProperties"],
                                                         "MEM_FORMAT_ENCODING": _mem_format},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo": _RECORDS["_StorageInfo"]},
    # Megatron-Core's torch_dist keeps every rank's SavePlan in Metadata.all_local_plans (to reuse them
    # on the next save): inert records, never read.
    "torch.distributed.checkpoint.planner": {
        **{n: record_type(n) for n in ("SavePlan", "WriteItem", "TensorWriteData", "BytesIOWriteData")},
        "WriteItemType": type("WriteItemType", (unpickler.EnumMember,), {"kind": "WriteItemType"})},
    "pathlib": {"PosixPath": _path, "PurePosixPath": _path, "WindowsPath": _path, "PureWindowsPath": _path,
                "Path": _path},
}


Dims = Tuple[int, ...]
# (fqn, chunk offsets) -> (data file name, byte offset, length): where .metadata stores each chunk's archive
Storage = Dict[Tuple[str, Dims], Tuple[str, int, int]]
# The piece holding the chunk at (offsets, sizes) of one tensor
PieceOf = Callable[[Dims, Dims], Piece]


class DcpTensor:
    """One tensor entry of ``.metadata``: dtype (safetensors name), global ``size`` and its chunks
    ``[(offsets, sizes)]``."""

    def __init__(self, dtype: str, size: Tuple[int, ...], chunks: List[Tuple[Tuple[int, ...], Tuple[int, ...]]]):
        self.dtype, self.size, self.chunks = dtype, size, chunks


def detect(path: str, tag: Optional[str] = None) -> bool:
    """A DCP checkpoint in ``path`` or its ``pytorch_model_fsdp_0/`` (no tag: DCP has none)."""
    return tag is None and find_dcp_dir(path) is not None


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    return [d for d in (path, find_dcp_dir(path), os.path.dirname(os.path.abspath(path))) if d]


def plan(ctx: PlanContext) -> ExportPlan:
    """The registry's entry point (``ctx``: a :class:`~.protocol.PlanContext`): :func:`plan_dcp_dir` of
    the DCP directory ``ctx.path`` is or holds."""
    dcp_dir = find_dcp_dir(ctx.path)
    assert dcp_dir is not None, "plan() of a path detect() did not claim"  # the registry asks detect() first
    return plan_dcp_dir(dcp_dir, config_dir=ctx.config_dir, source=os.path.abspath(ctx.path))


def find_dcp_dir(src: str) -> Optional[str]:
    """The DCP checkpoint directory ``src`` is or holds (Accelerate/Trainer's ``pytorch_model_fsdp_0``;
    the ``sharded/`` directory of torch's HuggingFaceStorageWriter)."""
    for cand in [src] + [os.path.join(src, d) for d in _ACCELERATE_DIRS + ("sharded",)]:
        if os.path.isfile(os.path.join(cand, METADATA)) and _is_pickle(os.path.join(cand, METADATA)):
            return cand
        if _hf_writer_files(cand):
            return cand
    return None


def _is_pickle(path: str) -> bool:
    try:
        with guards.open_regular(path, what="the DCP metadata") as fh:  # a FIFO refuses, never hangs
            return fh.read(1) == b"\x80"  # PROTO: torch pickles .metadata; the HF writer's is JSON
    except OSError:
        return False


def _record(value: Any, kind: str, where: str, what: str) -> Record:
    if not isinstance(value, Record) or value.kind != kind:
        raise LayoutError(f"{where}: {what} is {short_repr(value)}, not a {kind}; the checkpoint is corrupt or "
                          "crafted, or written by a torch release hf-ckpt does not know: please report it")
    return value


def read_metadata(dcp_dir: str) -> Tuple[Dict[str, DcpTensor], Storage, Dict[str, Tuple[str, ...]]]:
    """``(tensors, storage, paths)`` of ``dcp_dir/.metadata``: ``{fqn: DcpTensor}`` (non-tensor entries
    left out), ``{(fqn, offsets): (file name, offset, length)}`` and ``{fqn: path in the nested state
    dict}``. Every value is checked; anything else is a :class:`LayoutError` naming the file."""
    where = os.path.join(dcp_dir, METADATA)
    md = _record(unpickler.load_pickle(where, allowed=ALLOWED), "Metadata", where, "the file")
    sd_meta = md.field("state_dict_metadata")
    if type(sd_meta) is not dict:
        raise LayoutError(f"{where}: no state_dict_metadata; not a torch DCP checkpoint, save it again")
    tensors: Dict[str, DcpTensor] = {}
    for fqn, entry in sd_meta.items():
        if type(fqn) is not str:
            raise LayoutError(f"{where}: key {short_repr(fqn)} is not a name; the checkpoint is corrupt")
        if isinstance(entry, Record) and entry.kind == "BytesStorageMetadata":
            continue
        entry = _record(entry, "TensorStorageMetadata", where, f"entry {one_line(fqn[:100])}")
        props = _record(entry.field("properties"), "TensorProperties", where, f"{one_line(fqn[:100])} properties")
        state = props.state
        dtype = state[0] if type(state) is tuple and state else props.field("dtype")
        if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
            raise LayoutError(f"{where}: {one_line(fqn[:100])} has dtype {short_repr(dtype)}, which hf-ckpt does not "
                              f"export (it reads {', '.join(DTYPE_SIZES)})")
        size = guards.dims(entry.field("size"), f"{one_line(fqn[:100])} size", where)
        chunks = entry.field("chunks")
        if type(chunks) is not list:
            raise LayoutError(f"{where}: {one_line(fqn[:100])} has no chunk list; the checkpoint is corrupt")
        placed = []
        for c in chunks:
            c = _record(c, "ChunkStorageMetadata", where, f"a chunk of {one_line(fqn[:100])}")
            placed.append((guards.dims(c.field("offsets"), "chunk offsets", where),
                           guards.dims(c.field("sizes"), "chunk sizes", where)))
        tensors[fqn] = DcpTensor(dtype, size, placed)
    storage: Storage = {}
    # (file, start, end, fqn, offsets) of every storage entry: distinct chunks never share bytes
    spans: List[Tuple[str, int, int, str, Any]] = []
    sdata = md.field("storage_data")
    if type(sdata) is not dict:
        raise LayoutError(f"{where}: no storage_data (written by a storage writer other than FileSystemWriter?); "
                          "hf-ckpt reads DCP checkpoints of torch's FileSystemWriter")
    for index, info in sdata.items():
        index = _record(index, "MetadataIndex", where, "a storage key")
        info = _record(info, "_StorageInfo", where, "a storage entry")
        fqn, offsets = index.field("fqn"), index.field("offset")
        rel, off, length = info.field("relative_path"), info.field("offset"), info.field("length")
        if type(fqn) is not str or type(rel) is not str or type(off) is not int or type(length) is not int \
                or off < 0 or length < 0:
            raise LayoutError(f"{where}: storage entry {short_repr(info.state)} is malformed; the checkpoint is "
                              "corrupt or crafted: copy it again from the training run")
        if length:
            spans.append((rel, off, off + length, fqn, offsets))
        if fqn not in tensors:
            continue
        if not rel or rel in (".", "..") or "/" in rel or "\\" in rel or "\0" in rel:
            raise LayoutError(f"{where}: names data file {one_line(rel[:64])!r}, which is not a file name in "
                              f"{dcp_dir}; the checkpoint is corrupt or crafted")
        if info.field("transform_descriptors"):
            raise LayoutError(f"{where}: {one_line(fqn[:100])} is stored through storage-writer extensions "
                              f"{short_repr(info.field('transform_descriptors'))} (e.g. compression); hf-ckpt reads "
                              "chunks FileSystemWriter stores plainly: save without _extensions")
        storage[(fqn, guards.dims(offsets, "storage offsets",
                            where))] = (rel, off, length)
    _check_disjoint(dcp_dir, spans, where)
    planner = md.field("planner_data")
    paths: Dict[str, Tuple[str, ...]] = {}
    for fqn in tensors:
        path = planner.get(fqn) if type(planner) is dict else None
        if type(path) not in (tuple, list) or not path or not all(type(p) in (str, int) for p in path):
            path = (fqn,)
        paths[fqn] = tuple(str(p) for p in path)
    return tensors, storage, paths


def _check_disjoint(dcp_dir: str, spans: List[Tuple[str, int, int, str, Any]], where: str) -> None:
    """Refuse storage entries whose byte ranges overlap in one file: FileSystemWriter writes every
    chunk as its own archive, so two entries sharing bytes would export one chunk's values as the
    other's (a sort, then neighbours: N log N)."""
    spans.sort(key=lambda s: (s[0], s[1], s[2]))
    reach = None  # the span reaching furthest so far in the current file
    for span in spans:
        if reach is not None and reach[0] == span[0] and span[1] < reach[2]:
            raise LayoutError(
                f"{os.path.join(dcp_dir, one_line(span[0][:64]))}: bytes {span[1]}+{span[2] - span[1]} are recorded "
                f"(in {where}) as storage of both {one_line(str(reach[3])[:100])} at offsets {short_repr(reach[4])} "
                f"and {one_line(str(span[3])[:100])} at offsets {short_repr(span[4])}; distinct chunks never share "
                "bytes: the metadata is corrupt or crafted, copy the checkpoint again from the training run")
        if reach is None or reach[0] != span[0] or span[2] > reach[2]:
            reach = span


def check_integrity(ranges: Dict[str, List[Tuple[int, int]]]) -> Dict[str, List[str]]:
    """The source hook (:class:`~.protocol.SourceBase`): each ``.distcp`` file whose directory's
    ``.metadata`` records its archives (one per chunk), checked archive by archive within its own bytes."""
    archives: Dict[str, List[Tuple[int, int]]] = {}
    for d in sorted({os.path.dirname(p) for p in ranges if p.endswith(".distcp")}):
        if os.path.isfile(os.path.join(d, METADATA)):
            archives.update(data_archives(d))
    return {path: [f"{path}: {what} fails its CRC-32 check (the checksum torch wrote with it): the source file "
                   "is damaged, copy it again" for what in check_archive_crcs(path, archives[path], ranges[path])]
            for path in sorted(ranges) if path in archives}


def data_archives(dcp_dir: str) -> Dict[str, List[Tuple[int, int]]]:
    """``{data file path: [(start, length)]}``: where ``.metadata`` of the FileSystemWriter checkpoint
    ``dcp_dir`` records each model chunk's ``torch.save`` archive (what :func:`check_archive_crcs` reads)."""
    _, storage, _ = read_metadata(dcp_dir)
    out: Dict[str, List[Tuple[int, int]]] = {}
    for rel, start, length in storage.values():
        out.setdefault(os.path.join(os.path.abspath(dcp_dir), rel), []).append((start, length))
    return {path: sorted(set(spans)) for path, spans in out.items()}




def check_archive_crcs(path: str, archives: List[Tuple[int, int]], ranges: List[Tuple[int, int]]) -> List[str]:
    """CRC-32 of every entry of every archive of ``archives`` (``(start, length)`` in ``path``, from
    :func:`data_archives`) that holds a byte of ``ranges`` (``(offset, nbytes)``, absolute), each archive
    read within its own bytes, against the checksum its zip recorded; returns what fails
    (``"bytes S+L: entry NAME"``). A flipped bit in any chunk of a ``.distcp`` file is found, not
    only in the last one."""
    import zipfile

    spans = sorted((o, o + n) for o, n in ranges if n)
    bad = []
    with guards.open_regular(path, what="a DCP data file") as fh:
        for start, length in archives:
            if not any(lo < start + length and start < hi for lo, hi in spans):
                continue
            where = f"bytes {start}+{length}"
            try:
                with zipfile.ZipFile(torch_files.FileWindow(fh, start, length)) as zf:
                    for info in zf.infolist():
                        try:
                            with zf.open(info) as entry:  # zipfile compares the CRC-32 at the entry's end
                                while entry.read(torch_files.CRC_BLOCK):
                                    pass
                        except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError):
                            bad.append(f"{where}: entry {info.filename}")
            except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as e:
                bad.append(f"{where}: not a readable archive ({type(e).__name__})")
    return bad


def model_names(paths: Dict[str, Tuple[str, ...]]) -> Dict[str, str]:
    """``{fqn: model tensor name}``: the model's own entries. A state dict nested under ``model``
    (Accelerate, the Trainer) loses that wrapper and keeps the model's own names (``model.`` of a
    ``LlamaForCausalLM`` included); a flat one (``dcp.save(model.state_dict())``, torchtitan) keeps
    every entry outside the optimizer/scheduler/dataloader ones."""
    nested = {fqn: ".".join(p[1:]) for fqn, p in paths.items() if len(p) >= 2 and p[0] == "model"}
    if nested:
        return nested
    return {fqn: ".".join(p) for fqn, p in paths.items() if p[0] not in _NOT_MODEL}


def _chunks(name: str, t: DcpTensor, where: str, piece_of: PieceOf) -> List[Chunk]:
    """The non-empty chunks of ``t`` (an empty last shard holds nothing), each holding the piece
    ``piece_of(offsets, sizes)`` gives, after checking they tile the tensor exactly once (refused
    naming ``.metadata`` otherwise: missing, overlapping or uncovered chunks)."""
    shaped = [(off, sz) for off, sz in t.chunks if len(off) == len(t.size) == len(sz)]
    if len(shaped) != len(t.chunks):
        raise LayoutError(f"{where}: a chunk of {name} has offsets or sizes of another rank than its size "
                          f"{list(t.size)}; the checkpoint is corrupt or crafted: copy it again")
    boxes = [Chunk((Piece("", 0, math.prod(sz), t.dtype),), off, sz) for off, sz in shaped if math.prod(sz)]
    try:
        check_tiling(t.size, boxes)
    except ValueError as e:
        raise LayoutError(f"{where}: the chunks recorded for {name} do not tile its size {list(t.size)} ({e}); a "
                          "rank's shard is missing or the metadata belongs to another save: copy the whole "
                          "checkpoint directory again") from None
    return [Chunk((piece_of(c.offsets, c.sizes),), c.offsets, c.sizes) for c in boxes]


def _chunk_piece(dcp_dir: str, name: str, fqn: str, dtype: str, off: Dims, sz: Dims, storage: Storage,
                 where: str, data_files: Dict[str, str]) -> Piece:
    """The piece holding the chunk of ``fqn`` at ``off`` (its archive checked against the metadata);
    ``data_files``: ``{file name: path}`` of the data files seen so far, shared by one plan's calls."""
    entry = storage.get((fqn, off))
    if entry is None:
        raise LayoutError(f"{where}: no storage entry for the chunk of {name} at offsets {list(off)}; the metadata "
                          "is incomplete: copy the whole checkpoint directory again")
    rel, start, length = entry
    # one path string (and one stat) per data file, not per chunk: a plan holds 100k-1M chunks
    path = data_files.get(rel)
    if path is None:
        path = os.path.join(dcp_dir, rel)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing (the chunk of {name} at offsets {list(off)} is stored there); "
                                  "copy every .distcp file of the checkpoint")
        data_files[rel] = path
    ref = torch_files.load(path, offset=start, length=length, allowed=torch_files.TORCH_TENSOR_ALLOWED)
    if not isinstance(ref, torch_files.TensorRef) or ref.shape != tuple(sz) or ref.dtype != dtype:
        got = (f"{ref.dtype} {list(ref.shape)}" if isinstance(ref, torch_files.TensorRef) else type(ref).__name__)
        raise LayoutError(f"{path}: bytes {start}+{length} hold {got}, but .metadata records the chunk of {name} as "
                          f"{dtype} {list(sz)}; the files belong to different saves: copy the checkpoint again")
    byte_offset, _ = ref.byte_range()
    return Piece(path, byte_offset, ref.numel, dtype)


def plan_dcp_dir(dcp_dir: str, *, config_dir: Optional[str] = None, source: Optional[str] = None) -> ExportPlan:
    """Plan the export of the model weights of the DCP checkpoint ``dcp_dir`` (see the module docstring)."""
    dcp_dir = os.path.abspath(dcp_dir)
    entries: List[Tuple[str, DcpTensor, PieceOf]]
    if _hf_writer_files(dcp_dir):
        where, entries, skipped, writer = dcp_dir, _hf_writer_entries(dcp_dir), 0, "HuggingFaceStorageWriter"
    else:
        where, writer = os.path.join(dcp_dir, METADATA), "FileSystemWriter"
        tensors, storage, paths = read_metadata(dcp_dir)
        names = model_names(paths)
        if not names:
            raise CheckpointError(f"{where}: holds no model tensors (only "
                                  f"{', '.join(sorted({p[0] for p in paths.values()}))[:200]}); pass the model's DCP "
                                  "checkpoint directory")
        data_files: Dict[str, str] = {}
        entries = [(name, tensors[fqn], partial(_chunk_piece, dcp_dir, name, fqn, tensors[fqn].dtype, storage=storage,
                                                where=where, data_files=data_files)) for fqn, name in names.items()]
        skipped = len(tensors) - len(names)
    out: List[TensorPlan] = []
    chunk_counts: Dict[int, int] = {}
    split_dims: Set[int] = set()
    for name, t, piece_of in entries:
        chunks = _chunks(name, t, where, piece_of)
        chunk_counts[len(chunks)] = chunk_counts.get(len(chunks), 0) + 1
        split_dims.update(d for c in chunks for d in range(len(t.size)) if c.offsets[d] or c.sizes[d] != t.size[d])
        flat = row_major_pieces(t.size, chunks)
        if flat is not None:  # dim-0 shards (FSDP2): the chunks' bytes laid end to end, a byte-range copy
            out.append(TensorPlan(name, t.size, t.dtype, [flat], kind="module"))
        else:  # split along another dim too (FSDP x TP): assembled from the N-D chunks
            out.append(TensorPlan.from_chunks(name, t.size, t.dtype, chunks, kind="module"))
    dtypes = {t.src_dtype for t in out}
    files = sorted({p.path for t in out for part in t.parts for p in part})
    notes = [f"torch DCP ({writer}): {len(files)} data files; chunks per tensor: "
             + ", ".join(f"{k} ({v} tensors)" for k, v in sorted(chunk_counts.items()))
             + (f"; split along dims {sorted(split_dims)}" if split_dims else "; unsplit")]
    if skipped:
        notes.append(f"{skipped} optimizer/other tensor entries skipped")
    shards = max(chunk_counts) if chunk_counts else 1
    return ExportPlan(engine="torch-dcp", source=source or dcp_dir, tag=None, tensors=out,
                      dtypes={"module": dtypes.pop()} if len(dtypes) == 1 else {},
                      config_dir=config_dir, files=files, notes=notes, detail={"dp_size": shards})


# torch's HuggingFaceStorageWriter: ``model-00001-of-00003.safetensors`` (+ a JSON ``.metadata``) from
# one writer, ``shard-00001-model-00001-of-00001.safetensors`` per rank with ``save_distributed=True``.
_HF_WRITER_RE = re.compile(r"^(?:shard-\d+-)?model-\d+-of-\d+\.safetensors$")
_SHARDING_KEY = "DCP_SHARDING_INFO"


def _hf_writer_files(path: str) -> List[str]:
    """The safetensors files torch's HuggingFaceStorageWriter wrote in ``path`` (the per-rank
    ``shard-*`` ones, else the ones a JSON ``.metadata`` sits beside); empty when it wrote none."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    sharded = [n for n in names if n.startswith("shard-") and _HF_WRITER_RE.match(n)]
    if sharded:
        return sharded
    meta = os.path.join(path, METADATA)
    if os.path.isfile(meta) and not _is_pickle(meta):
        return [n for n in names if _HF_WRITER_RE.match(n)]
    return []


def _piece_at(pieces: Mapping[Tuple[Dims, Dims], Piece], off: Dims, sz: Dims) -> Piece:
    """The piece of the chunk at (``off``, ``sz``) among ``pieces``."""
    return pieces[(tuple(off), tuple(sz))]


def _hf_writer_entries(dcp_dir: str) -> List[Tuple[str, DcpTensor, PieceOf]]:
    """``[(name, DcpTensor, piece_of)]`` of the safetensors files HuggingFaceStorageWriter wrote: each
    tensor of each file is a chunk at the offsets its ``DCP_SHARDING_INFO`` records (0 without it);
    a tensor's size is where its chunks end."""
    from ..formats.safetensors import read_header

    placed: Dict[str, list] = {}
    dtypes: Dict[str, str] = {}
    for fname in _hf_writer_files(dcp_dir):
        f = os.path.join(dcp_dir, fname)
        header = read_header(f, check_loader=False)
        info: Any = header.metadata.get(_SHARDING_KEY) if isinstance(header.metadata, dict) else None
        try:
            info = json.loads(info) if info is not None else {}
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise LayoutError(f"{f}: its {_SHARDING_KEY} metadata is not a JSON object; the file is corrupt: copy "
                              "it again")
        for name, e in header.tensors.items():
            rec = info.get(name)
            off = rec.get("saved_offsets") if isinstance(rec, dict) else (0,) * len(e.shape) if rec is None else None
            off = guards.dims(off, f"{one_line(name[:100])} saved_offsets",
                        f)
            if name in dtypes and dtypes[name] != e.dtype:
                raise LayoutError(f"{f}: {one_line(name[:100])} is {e.dtype} here, {dtypes[name]} in another file; the "
                                  "files belong to different saves: copy the checkpoint again")
            dtypes[name] = e.dtype
            placed.setdefault(name, []).append((off, e.shape, Piece(f, e.offset, math.prod(e.shape), e.dtype)))
    entries: List[Tuple[str, DcpTensor, PieceOf]] = []
    for name, chunks in placed.items():
        if name.split(".")[0] in _NOT_MODEL:
            continue
        ndim = {len(off) for off, _, _ in chunks} | {len(sz) for _, sz, _ in chunks}
        if len(ndim) != 1:
            raise LayoutError(f"{dcp_dir}: the chunks of {one_line(name[:100])} disagree on its number of dimensions; "
                              "the files belong to different saves: copy the checkpoint again")
        size = tuple(max(o[d] + s[d] for o, s, _ in chunks) for d in range(ndim.pop()))
        pieces = {(tuple(o), tuple(s)): p for o, s, p in chunks}
        t = DcpTensor(dtypes[name], size, [(tuple(o), tuple(s)) for o, s, _ in chunks])
        entries.append((name, t, partial(_piece_at, pieces)))
    if not entries:
        raise CheckpointError(f"{dcp_dir}: its safetensors files hold no model tensors; pass the model's checkpoint "
                              "directory")
    return entries
