"""Per-rank ``torch.save`` files of an FSDP sharded state dict -> :class:`~..plan.ExportPlan`.

Who writes them, and where (each rank ``R`` of ``W`` saves its own ``model.state_dict()``):

- verl's ``FSDPCheckpointManager``: ``global_step_N/actor/model_world_size_{W}_rank_{R}.pt`` (and
  ``critic/``), beside ``optim_…``/``extra_state_…`` twins, ``fsdp_config.json``
  (``{"FSDP_version": …, "world_size": W}``, verl >= 0.4.1) and ``huggingface/`` (config and
  tokenizer); ``latest_checkpointed_iteration.txt`` at the root names the last step. verl's SFT
  trainer writes the files into ``global_step_N/`` itself; SkyRL uses the same names under
  ``policy/``.
- Accelerate's ``save_fsdp_model(..., use_dcp=False)`` under ``SHARDED_STATE_DICT``:
  ``pytorch_model_fsdp_0_rank{R}.bin`` in the output directory.
- Accelerate's ``save_fsdp_model`` under FSDP1's ``LOCAL_STATE_DICT``: ``pytorch_model_fsdp_rank{R}.bin``,
  one flat parameter per FSDP unit, split by the config's model in :mod:`.local`.

FSDP2 (and FSDP1 given a device mesh, as verl does) state dicts hold DTensors: the local shard,
the global size and dtype, the device mesh (its shape and this rank's coordinate) and one
placement per mesh dim (``Shard(d)``, ``_StridedShard(d, split_factor)``, ``Replicate()``,
``Partial()``). torch pickles each one as ``_rebuild_from_type_v2(_rebuild_wrapper_subclass,
DTensor, args, state)``; :data:`ALLOWED` rebuilds them, the mesh and the placements as inert
stand-ins (nothing is called, torch.distributed is never imported), and :func:`local_indices`
places each rank's shard with torch's own arithmetic (``compute_local_shape_and_global_offset``:
mesh dims left to right, ``torch.chunk`` sizes, so uneven last shards and empty ones come out as
torch made them). Blocks held by several ranks (a ``Replicate`` mesh dim, a DTensor on FSDP's "dp"
sub-mesh beside "tp", a plain tensor every rank holds whole) are written once and every other copy
is checked bitwise equal to it (``TensorPlan.tied_copies`` under the tensor's own name);
``Partial`` (unreduced sums) is refused. FSDP1 ``SHARDED_STATE_DICT`` without a mesh saves
``ShardedTensor`` s: their local shards are placed at the offsets their ``ShardMetadata`` records.

Refused, naming the file: a rank file missing, a world size that disagrees with
``fsdp_config.json``, shards that overlap or leave a gap (:func:`~..plan.check_tiling`), a shard
whose shape is not what its placements give, ranks that disagree on a tensor's size, dtype, mesh
or placements.
"""

import itertools
import json
import math
import os
import re
import time
from typing import Any, Collection, Dict, List, Optional, Sequence, Set, Tuple

from ... import guards
from ...errors import CheckpointError, LayoutError, one_line, short_repr
from ...formats import torch_files
from ...plan import Chunk, ExportPlan, Piece, TensorPlan, check_tiling
from . import local, workers
from .placement import box_pieces, index_runs, local_indices
from .rows import Irregular, RowShards
from .stand_ins import ALLOWED, TYPES, DTensorRef, ShardedRef  # ALLOWED: this source's allowlist
from ..protocol import PlanContext

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "TIED_UNDER_BOTH_NAMES", "OPTIONS", "ALLOWED", "detect", "needs_config",
           "config_candidates", "plan", "find_rank_files", "local_indices", "DTensorRef", "read_for_worker"]

NAME = "fsdp-rank-files"
LOOKS_FOR = ("per-rank torch.save FSDP state dicts (verl/SkyRL model_world_size_W_rank_R.pt in global_step_N/, "
             "actor/ or policy/; Accelerate use_dcp=False pytorch_model_fsdp_0_rankR.bin, LOCAL_STATE_DICT "
             "pytorch_model_fsdp_rankR.bin)")
MEMORY_NAMES = True  # FSDP state dicts use the model's own parameter names
TIED_UNDER_BOTH_NAMES = True  # and hold a tied weight under both names
OPTIONS = ()

_VERL_RE = re.compile(r"^model_world_size_(\d{1,6})_rank_(\d{1,6})\.pt$")
_ACCELERATE_RE = re.compile(r"^pytorch_model_fsdp_0_rank(\d{1,6})\.bin$")
# FSDP1 LOCAL_STATE_DICT: flat parameters, which only the model's parameter shapes can split.
_LOCAL_RE = re.compile(r"^pytorch_model_fsdp_rank(\d{1,6})\.bin$")
# The name each writer gives rank R of W (verl's FSDPCheckpointManager, Accelerate's save_fsdp_model).
_NAMES = {"verl": lambda w, r: f"model_world_size_{w}_rank_{r}.pt",
          "accelerate": lambda w, r: f"pytorch_model_fsdp_0_rank{r}.bin",
          "local": lambda w, r: f"pytorch_model_fsdp_rank{r}.bin"}
_MODEL_DIRS = ("actor", "policy")  # verl's actor (the policy; critic/ beside it), SkyRL's policy
_LATEST = "latest_checkpointed_iteration.txt"
_FSDP_CONFIG = "fsdp_config.json"
_HF_DIR = "huggingface"
_LORA_DIR = "lora_adapter"  # verl's fsdp worker writes a LoRA actor's adapter (config + weights) there


# ---- where the files are ---------------------------------------------------------------------

def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _rank_names(path: str) -> Dict[str, List[Tuple[int, str]]]:
    """``{"verl": [(rank, name)], "accelerate": [...], "local": [...]}`` of ``path``'s rank files."""
    out: Dict[str, List[Tuple[int, str]]] = {}
    for name in _listdir(path):
        for kind, pattern in (("verl", _VERL_RE), ("accelerate", _ACCELERATE_RE), ("local", _LOCAL_RE)):
            m = pattern.match(name)
            if m:
                out.setdefault(kind, []).append((int(m.groups()[-1]), name))
    return out


def _model_dir(path: str) -> Optional[str]:
    """The directory holding the rank files: ``path``, its ``actor/`` or ``policy/``, or (a verl
    run's root) the step ``latest_checkpointed_iteration.txt`` names."""
    for cand in [path] + [os.path.join(path, d) for d in _MODEL_DIRS]:
        if _rank_names(cand):
            return cand
    latest = os.path.join(path, _LATEST)
    if os.path.isfile(latest):
        step = guards.read_small_text(latest, limit=64, what=_LATEST).strip()
        if step.isdigit():
            step_dir = os.path.join(path, f"global_step_{int(step)}")
            if os.path.isdir(step_dir) and step_dir != path:
                return _model_dir(step_dir)
    return None


def detect(path: str, tag: Optional[str] = None) -> bool:
    """Rank files in ``path``, its ``actor/``/``policy/``, or the step a verl root names (file names only)."""
    return tag is None and _model_dir(path) is not None


def needs_config(path: str, tag: Optional[str] = None) -> bool:
    """For FSDP1 LOCAL_STATE_DICT files: only the config's model splits their flat parameters."""
    model = _model_dir(path)
    return model is not None and set(_rank_names(model)) == {"local"}


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    model = _model_dir(path) or path
    parent = os.path.dirname(os.path.abspath(model))
    return [os.path.join(model, _HF_DIR), model, os.path.join(parent, _HF_DIR), parent, path]


def find_rank_files(model_dir: str) -> Tuple[str, int, List[str]]:
    """``(layout, world size, [path of rank 0, 1, ...])`` of the rank files in ``model_dir``; refused
    (naming the file) when a rank is missing, two world sizes are mixed, or ``fsdp_config.json``
    records another world size."""
    found = _rank_names(model_dir)
    if "verl" in found:
        layout, entries = "verl", found["verl"]
        sizes = sorted({int(m.group(1)) for _, n in entries if (m := _VERL_RE.match(n))})  # each matched it
        if len(sizes) != 1:
            raise CheckpointError(f"{model_dir}: holds model files of world sizes {sizes}; keep one save's files in a "
                                  "step directory")
        world = sizes[0]
    else:
        layout = "accelerate" if "accelerate" in found else "local"
        entries = found[layout]
        world = max(r for r, _ in entries) + 1
    by_rank: Dict[int, str] = {}
    for rank, name in sorted(entries, key=lambda e: e[1]):
        guards.claim_file(by_rank, rank, os.path.join(model_dir, name), where=model_dir,
                          canonical=_NAMES[layout](world, rank))
    by_rank = {r: os.path.basename(p) for r, p in by_rank.items()}
    if world < 1 or world > 1_000_000:
        raise CheckpointError(f"{model_dir}: world size {world} is not one a save writes")
    beyond = sorted(r for r in by_rank if r >= world)
    if beyond:  # verl's names record the world size: a rank past it is a file of another save
        raise CheckpointError(f"{os.path.join(model_dir, by_rank[beyond[0]])}: rank {beyond[0]} of a save of {world} "
                              "ranks; a file of another save was copied in or renamed: remove it")
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        name = _NAMES[layout](world, missing[0])
        raise CheckpointError(f"{os.path.join(model_dir, name)}: missing (the save has {world} ranks; "
                              f"{len(missing)} rank file(s) missing); copy every rank's file of the checkpoint")
    cfg_path = os.path.join(model_dir, _FSDP_CONFIG)
    if os.path.exists(cfg_path):
        try:
            cfg = json.loads(guards.read_small_text(cfg_path, limit=1 << 16, what=_FSDP_CONFIG))
        except ValueError:
            raise CheckpointError(f"{cfg_path}: not JSON; the file is corrupt: copy it again") from None
        recorded = cfg.get("world_size") if isinstance(cfg, dict) else None
        if recorded is not None and recorded != world:
            raise CheckpointError(f"{cfg_path}: records world_size {short_repr(recorded)}, but {model_dir} holds the "
                                  f"model files of {world} ranks; files of different saves are mixed: copy the "
                                  "checkpoint again")
    return layout, world, [os.path.join(model_dir, by_rank[r]) for r in range(world)]


# ---- reading one rank's DTensors ---------------------------------------------------------------

class _Shard:
    """One rank's piece of one tensor, read from its file: where its blocks land."""

    def __init__(self, shape: Tuple[int, ...], dtype: str, chunks: List[Chunk], describe: str):
        self.shape, self.dtype, self.chunks, self.describe = shape, dtype, chunks, describe


def _mesh(mesh: Any, where: str, rank: int) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[str, ...]]:
    """``(shape, this rank's coordinate, dim names)`` of a pickled DeviceMesh (torch 2.4 -> 2.13 keep
    the coordinate as ``_coordinate_on_dim``; the shape is the ``mesh`` tensor's, or since 2.9 the
    ``_layout``'s axes')."""
    if not isinstance(mesh, TYPES["DeviceMesh"]):
        raise LayoutError(f"{where}: a DTensor's mesh is {short_repr(mesh)}, not a DeviceMesh; the file is corrupt or "
                          "written by a torch release hf-ckpt does not know: please report it")
    layout = mesh.field("_layout")
    if isinstance(layout, TYPES["_MeshLayout"]):
        axes = layout.field("axes")
        if type(axes) is not tuple or not all(isinstance(a, TYPES["_FlatLayout"]) for a in axes):
            raise LayoutError(f"{where}: the device mesh layout {short_repr(axes)} is malformed; the file is corrupt")
        shape = tuple(math.prod(guards.dims(a.field("shape"), "mesh axis", where)) for a in axes)
    elif isinstance(mesh.field("mesh"), torch_files.TensorRef):
        shape = mesh.field("mesh").shape
    else:
        raise LayoutError(f"{where}: the device mesh records no shape (neither _layout nor mesh); written by a torch "
                          "release hf-ckpt does not know: please report it")
    coord = guards.dims(mesh.field("_coordinate_on_dim"), "mesh coordinate", where)
    recorded = mesh.field("_rank")
    if len(coord) != len(shape) or any(c >= s for c, s in zip(coord, shape)) or \
            (type(recorded) is int and recorded != rank):
        raise LayoutError(f"{where}: the device mesh places this file at coordinate {list(coord)} of a "
                          f"{list(shape)} mesh as rank {short_repr(recorded)}, but it is rank {rank}'s file; files "
                          "were renamed or mixed: copy the checkpoint again")
    names = mesh.field("_mesh_dim_names", mesh.field("mesh_dim_names"))
    names = tuple(str(n) for n in names) if type(names) is tuple and all(type(n) is str for n in names) else ()
    return shape, coord, names


def _placement(p: Any, ndim: int, where: str) -> Tuple[str, int, int]:
    kind = getattr(p, "kind", None)
    if kind == "Replicate":
        return ("replicate", -1, 0)
    if kind == "Partial":
        raise LayoutError(f"{where}: holds a Partial placement (per-rank partial sums, not weights); save the state "
                          "dict after the reduction (full_tensor() or redistribute to Replicate)")
    if kind in ("Shard", "_StridedShard"):
        dim, factor = p.field("dim"), p.field("split_factor", 1)
        if type(dim) is not int or not 0 <= dim < ndim or type(factor) is not int or factor < 1:
            raise LayoutError(f"{where}: placement {short_repr(p.state)} is malformed; the file is corrupt")
        return ("shard", dim, 0) if kind == "Shard" else ("strided", dim, factor)
    raise LayoutError(f"{where}: placement {short_repr(p)} is not one hf-ckpt reads (Shard, _StridedShard, Replicate)")


def _describe(p: Tuple[str, int, int]) -> str:
    return {"replicate": "Replicate()", "shard": f"Shard({p[1]})", "strided": f"_StridedShard({p[1]}, {p[2]})"}[p[0]]


def _dtensor_meta(name: str, t: DTensorRef, where: str, rank: int, meshes: Dict[int, Any]
                  ) -> Tuple[Tuple[int, ...], torch_files.TensorRef, Tuple[Any, ...], List[Tuple[str, int, int]]]:
    """``(size, local tensor, (mesh shape, coordinate, dim names), placements)`` of a DTensor, checked;
    ``meshes``: the file's meshes read so far, by identity (every DTensor of a file shares one)."""
    shape = guards.dims(t.shape, f"{name} size", where)
    local = t.local
    spec = t.spec
    if not isinstance(local, torch_files.TensorRef) or not isinstance(spec, TYPES["DTensorSpec"]):
        raise LayoutError(f"{where}: DTensor {name} has no local tensor or spec; the file is corrupt or crafted")
    if str(t.dtype) != local.dtype:
        raise LayoutError(f"{where}: DTensor {name} is {short_repr(str(t.dtype))} but its local shard {local.dtype}; the "
                          "file is corrupt")
    mesh = spec.field("mesh")
    if id(mesh) not in meshes:
        meshes[id(mesh)] = (mesh, _mesh(mesh, where, rank))  # (the mesh kept: its id stays its own)
    mesh_info = meshes[id(mesh)][1]
    placements = spec.field("placements")
    if type(placements) is not tuple or len(placements) != len(mesh_info[0]):
        raise LayoutError(f"{where}: DTensor {name} has placements {short_repr(placements)} for a "
                          f"{len(mesh_info[0])}-D mesh; the file is corrupt")
    return shape, local, mesh_info, [_placement(p, len(shape), f"{where}: {name}") for p in placements]


def _dtensor_shard(name: str, shape: Tuple[int, ...], local: torch_files.TensorRef, mesh_info: Tuple[Any, ...],
                   placed: List[Tuple[str, int, int]], described: str, where: str) -> _Shard:
    """``described``: the placements as :func:`_describe` spells them, joined."""
    mesh_shape, coord, _ = mesh_info
    idx = local_indices(shape, mesh_shape, coord, placed)
    if tuple(len(i) for i in idx) != local.shape:
        raise LayoutError(f"{where}: the shard of {name} is {list(local.shape)}, but placements "
                          f"{described} on mesh {list(mesh_shape)} at {list(coord)} give "
                          f"{[len(i) for i in idx]}; the file is corrupt or from another save")
    chunks = []
    for combo in itertools.product(*(index_runs(i) for i in idx)):
        lo = tuple(c[0] for c in combo)
        hi = tuple(c[0] + c[2] for c in combo)
        chunks.append(Chunk(tuple(box_pieces(local, lo, hi)), tuple(c[1] for c in combo),
                            tuple(c[2] for c in combo)))
    return _Shard(shape, local.dtype, chunks, described)


def _sharded_shard(name: str, t: ShardedRef, where: str, rank: int) -> _Shard:
    """A ShardedTensor's local shards, each placed at the offsets its ShardMetadata records."""
    shape = guards.dims(t.shape, f"{name} size", where)
    if type(t.shards) is not list:
        raise LayoutError(f"{where}: ShardedTensor {name} has no list of local shards; the file is corrupt")
    chunks = []
    for s in t.shards:
        ref, md = getattr(s, "field", lambda n: None)("tensor"), getattr(s, "field", lambda n: None)("metadata")
        if not isinstance(ref, torch_files.TensorRef) or not isinstance(md, TYPES["ShardMetadata"]):
            raise LayoutError(f"{where}: a local shard of {name} is {short_repr(s)}; the file is corrupt or crafted")
        off = guards.dims(md.field("shard_offsets"), "shard offsets", where)
        sizes = guards.dims(md.field("shard_sizes"), "shard sizes", where)
        dev = md.field("placement")
        owner = dev.field("_rank") if isinstance(dev, TYPES["_remote_device"]) else None
        if sizes != ref.shape or len(off) != len(shape) or ref.dtype != str(t.dtype) or \
                (type(owner) is int and owner != rank):
            raise LayoutError(f"{where}: a local shard of {name} holds {ref.dtype} {list(ref.shape)} for rank "
                              f"{short_repr(owner)}, its metadata says {list(sizes)} at {list(off)} of a {t.dtype} "
                              f"tensor on rank {rank}'s file; files were renamed or mixed: copy the checkpoint again")
        chunks.append(Chunk(tuple(box_pieces(ref, (0,) * len(sizes), sizes)), off, sizes))
    return _Shard(shape, str(t.dtype), chunks, "ShardedTensor")


def _plain_shard(ref: torch_files.TensorRef, rank: int) -> _Shard:
    """A plain tensor (a buffer) every rank holds whole: each rank's is a copy."""
    pieces = box_pieces(ref, (0,) * len(ref.shape), ref.shape)
    return _Shard(ref.shape, ref.dtype, [Chunk(tuple(pieces), (0,) * len(ref.shape), tuple(ref.shape))],
                  "whole on every rank")


def _read_rank(path: str, rank: int, sd: Optional[dict] = None, skip: Collection[str] = (),
               rows: Optional[RowShards] = None) -> Tuple[Dict[str, _Shard], Dict[str, Dict[str, Any]], int, List[str]]:
    """``(shards placed the general way, placement facts, entries skipped, names)`` of one rank file;
    ``rows``: the ``Shard(0)`` tensors it takes (:mod:`.rows`) are not among the shards."""
    sd = torch_files.load(path, allowed=ALLOWED) if sd is None else sd
    if not isinstance(sd, dict):
        raise LayoutError(f"{path}: holds {type(sd).__name__}, not a state dict; pass the model's rank files")
    out: Dict[str, _Shard] = {}
    facts: Dict[str, Dict[str, Any]] = {}
    skipped = 0
    meshes: Dict[int, Any] = {}
    names: List[str] = []  # the tensors, in the file's order
    for name, value in sd.items():
        if type(name) is not str:
            raise LayoutError(f"{path}: key {short_repr(name)} is not a name; the file is corrupt")
        if name in skip:
            continue
        if local.is_flat_param(name, value):  # renamed LOCAL_STATE_DICT files: never exported as a tensor
            raise LayoutError(f"{path}: holds FSDP1 flat parameter {one_line(name[:200])} (a LOCAL_STATE_DICT save) "
                              "under a SHARDED_STATE_DICT file name; keep the name it was saved under "
                              "(pytorch_model_fsdp_rank{R}.bin)")
        if isinstance(value, DTensorRef):
            names.append(name)
            shown = one_line(name[:200])
            shape, ref, mesh_info, placed = _dtensor_meta(shown, value, path, rank, meshes)
            spelled = [_describe(p) for p in placed]
            described = ", ".join(spelled)
            if described not in facts:
                facts[described] = {"mesh": list(mesh_info[0]), "dim_names": list(mesh_info[2]), "placements": spelled}
            if rows is None or not rows.take(name, shape, ref, mesh_info[0], mesh_info[1], placed, rank):
                out[name] = _dtensor_shard(shown, shape, ref, mesh_info, placed, described, path)
        elif isinstance(value, ShardedRef):
            names.append(name)
            out[name] = _sharded_shard(one_line(name[:200]), value, path, rank)
            facts.setdefault("ShardedTensor", {"mesh": None, "dim_names": [], "placements": ["ShardedTensor"]})
        elif isinstance(value, torch_files.TensorRef):
            names.append(name)
            out[name] = _plain_shard(value, rank)
        else:
            skipped += 1
    return out, facts, skipped, names


# ---- the plan ----------------------------------------------------------------------------------

def plan(ctx: PlanContext) -> ExportPlan:
    """The registry's entry point: every rank file read (pickles only), each tensor's shards placed."""
    found = _model_dir(ctx.path)
    assert found is not None, "plan() of a path detect() did not claim"  # the registry asks detect() first
    model_dir = os.path.abspath(found)
    layout, world, files = find_rank_files(model_dir)
    flat_tensors: List[TensorPlan] = []
    flat_facts: Optional[Dict[str, Any]] = None
    states: Sequence[Optional[dict]] = [None] * world
    consumed: Set[str] = set()
    if layout == "local":
        loaded = local.load_states(files)
        states = loaded
        flat_tensors, flat_facts, consumed = local.plan_tensors(local.meta_model_for(ctx, files[0]), files, loaded,
                                                                model_dir)
    try:  # the Shard(0) tensors without keeping their shards (.rows); any other layout at a later rank: again
        ranks, names, by_rows, facts, skipped = _read_ranks(files, states, consumed, RowShards(files))
    except Irregular:
        ranks, names, by_rows, facts, skipped = _read_ranks(files, states, consumed, None)
    out = list(flat_tensors)
    for name in names:
        out.append(by_rows[name] if name in by_rows else _tensor(name, [shards[name] for shards in ranks], files))
    dtypes = {t.src_dtype for t in out}
    mesh = max((f for f in facts.values() if f["mesh"]), key=lambda f: len(f["mesh"]), default=None)  # the widest
    if flat_facts:
        facts["flat parameter"] = {"mesh": None, "dim_names": [], "placements": ["flat parameter"]}
    notes = [f"per-rank torch.save files ({layout}): {world} ranks"
             + (f", mesh {mesh['mesh']}" + (f" {mesh['dim_names']}" if mesh["dim_names"] else "") if mesh else "")
             + f"; placements: {'; '.join(sorted(facts)) or 'none (plain tensors)'}"]
    if skipped:
        notes.append(f"{skipped} non-tensor entries skipped")
    others = [d for d in ("critic",) if os.path.isdir(os.path.join(os.path.dirname(model_dir), d))]
    if others and os.path.basename(model_dir) in _MODEL_DIRS:
        notes.append(f"exported {os.path.basename(model_dir)}/; {', '.join(others)}/ beside it is not exported")
    described = ["Shard(0)" if n in by_rows else ranks[0][n].describe for n in names]
    detail: Dict[str, Any] = {"world_size": world, "layout": layout,
                              "placements": {k: described.count(k) for k in sorted(facts)}}
    if flat_facts:
        detail["placements"]["flat parameter"] = len(flat_tensors)
        detail["flat_parameters"] = flat_facts
        notes.append(f"{flat_facts['units']} FSDP1 flat parameter(s) split into {len(flat_tensors)} parameters by the "
                     "shapes of the config's model ("
                     + ("no padding between parameters" if flat_facts["alignment"] == [0] else
                        f"parameters aligned to {' or '.join(map(str, flat_facts['alignment']))} elements: one layout")
                     + (", each parameter's use_orig_params view where the layout puts it" if flat_facts["views"]
                        else "") + ")")
    if mesh:
        detail.update({"mesh": mesh["mesh"], "mesh_dim_names": mesh["dim_names"]})
    if os.path.isdir(os.path.join(model_dir, _LORA_DIR)):  # verl's LoRA actor: its adapter_config.json
        detail["adapter_config_dirs"] = [os.path.join(model_dir, _LORA_DIR)]
    return ExportPlan(engine=NAME, source=os.path.abspath(ctx.path), tag=None, tensors=out,
                      dtypes={"module": dtypes.pop()} if len(dtypes) == 1 else {}, config_dir=ctx.config_dir,
                      files=files, notes=notes, detail=detail)


def _read_other(path: str, rank: int, sd: Optional[dict], consumed: Collection[str], rows: Optional[RowShards],
                first: Set[str]) -> Tuple[Dict[str, _Shard], Dict[str, dict], int]:
    """A later rank's file read as :func:`_read_rank` reads it; refused unless it holds rank 0's names."""
    shards, facts, skipped, held = _read_rank(path, rank, sd, consumed, rows)
    if set(held) != first:
        odd = sorted(set(held) ^ first)[0]
        raise LayoutError(f"{path}: holds {len(held)} tensors, rank 0's file {len(first)} ({one_line(odd[:100])} "
                          "is in one only); files of different saves are mixed: copy the checkpoint again")
    return shards, facts, skipped


def read_for_worker(job: Any, rank: int) -> Tuple[Any, ...]:
    """A worker process's read of rank ``rank``'s file (:mod:`.workers`), as plain data: ``job`` is
    ``(files, rank 0's row records or None, names skipped, rank 0's names)``, the names as sets (plain
    data too: built once, not for every rank a worker reads)."""
    files, first, consumed, names = job
    rows = None
    if first is not None:
        rows = RowShards(files)
        rows.first = first
    shards, facts, skipped = _read_other(files[rank], rank, None, consumed, rows, names)
    plain = {name: (s.shape, s.dtype, s.describe,
                    [(tuple((p.path, p.offset, p.numel, p.dtype) for p in c.pieces), c.offsets, c.sizes)
                     for c in s.chunks]) for name, s in shards.items()}
    return plain, facts, skipped, rows.shifts[rank] if rows is not None else []


def _from_worker(answer: Tuple[Any, ...], rank: int, rows: Optional[RowShards]
                 ) -> Tuple[Dict[str, _Shard], Dict[str, dict], int]:
    plain, facts, skipped, shifts = answer
    if rows is not None:
        rows.shifts[rank] = shifts
    shards = {name: _Shard(shape, dtype, [Chunk(tuple(Piece(*p) for p in pieces), offsets, sizes)
                                         for pieces, offsets, sizes in chunks], describe)
              for name, (shape, dtype, describe, chunks) in plain.items()}
    return shards, facts, skipped


def _read_ranks(files: List[str], states: Sequence[Optional[dict]], consumed: Set[str], rows: Optional[RowShards]
                ) -> Tuple[List[Dict[str, _Shard]], List[str], Dict[str, TensorPlan], Dict[str, dict], int]:
    """Every rank file read (each unpickled tree dropped before the next; rank 0's here, the others in
    worker processes where that pays, :mod:`.workers`): ``(each rank's shards placed the general way,
    the tensor names in rank 0's order, the tensors ``rows`` took, placement facts, entries skipped)``;
    refused when the files hold different names. A rank no worker delivered is read here, in rank
    order, so a refusal is the one this process raises, for the lowest refused rank."""
    started = time.perf_counter()
    shards, facts, skipped, order = _read_rank(files[0], 0, states[0], consumed, rows)
    first = set(order)
    ranks = [shards]
    n = workers.processes(len(files) - 1, time.perf_counter() - started) \
        if all(s is None for s in states) else 0  # (preloaded states: FSDP1 LOCAL_STATE_DICT, read already)
    answers = workers.read_in_workers((files, rows.first if rows is not None else None, consumed, first),
                                      range(1, len(files)), n) if n else {}
    for r in range(1, len(files)):
        answer = answers.pop(r, None)
        shards, f, s = _from_worker(answer, r, rows) if answer is not None else \
            _read_other(files[r], r, states[r], consumed, rows, first)
        ranks.append(shards)
        facts.update(f)
        skipped = max(skipped, s)
    return ranks, order, rows.tensors() if rows is not None else {}, facts, skipped


def _tensor(name: str, shards: List[_Shard], files: List[str]) -> TensorPlan:
    """One output tensor from every rank's shard. Ranks holding the same block (the same offsets and
    sizes: a Replicate mesh dim, a DTensor on a sub-mesh such as FSDP's "dp" beside "tp", a buffer)
    hold copies: the lowest rank's is written, every other is checked bitwise equal to it
    (``tied_copies`` under the tensor's own name). The distinct blocks must tile the tensor."""
    first = shards[0]
    shown = one_line(name[:100])
    for r, s in enumerate(shards):
        if (s.shape, s.dtype, s.describe) != (first.shape, first.dtype, first.describe):
            raise LayoutError(f"{files[r]}: {shown} is {s.dtype} {list(s.shape)} placed {s.describe}, in rank 0's file "
                              f"{first.dtype} {list(first.shape)} placed {first.describe}; files of different saves "
                              "are mixed: copy the checkpoint again")
    held: Dict[tuple, List[Chunk]] = {}
    for s in shards:
        for c in s.chunks:
            if c.numel:
                held.setdefault((c.offsets, c.sizes), []).append(c)
    primary = [copies[0] for copies in held.values()]
    try:
        check_tiling(first.shape, primary)
    except ValueError as e:
        raise LayoutError(f"{os.path.dirname(files[0])}: the shards of {shown} ({first.describe}) do not tile its "
                          f"size {list(first.shape)} ({e}); a rank's file is missing, duplicated or from another "
                          "save: copy the checkpoint again") from None
    # Chunks kept even for dim-0 shards (still a byte-range copy: TensorPlan.flat_pieces), so each copy is
    # compared block by block and a differing one is named by its file.
    t = TensorPlan.from_chunks(name, first.shape, first.dtype, primary, kind="module")
    for k in range(1, max((len(c) for c in held.values()), default=1)):
        t.tied_copies.append((name, [c[k] if k < len(c) else c[0] for c in held.values()]))
    return t
