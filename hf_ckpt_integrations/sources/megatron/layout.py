"""Megatron-Core's two checkpoint layouts, read inertly into one form: global tensors under the
``torch_dist`` names, each tiled by chunks of byte ranges.

- ``torch_dist`` (``dist_checkpointing.save``, Megatron-LM ``ckpt_format torch_dist``): a torch DCP
  directory whose ``.metadata`` also pickles Megatron's ``all_local_plans`` (``SavePlan`` s: read as
  inert records, :data:`..dcp.ALLOWED`), ``metadata.json`` naming the backend, and ``common.pt`` (the
  non-tensor state: ``args`` an ``argparse.Namespace``, ``iteration``). Transformer layers are
  **stacked**: ``decoder.layers.X`` has a leading axis of the global layer count; TP slices and
  pipeline stages are chunks at their global offsets.
- legacy (``ckpt_format torch``): ``iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt``, one
  ``torch.save`` dict per model-parallel rank (``model``: that rank's ``state_dict_for_save_checkpoint``,
  layers numbered within the stage; ``args``). Read here as the same global tensors: a layer's stage
  offset is the layer count of the stages before it, a TP slice lands at its rank's offset along the
  dim Megatron splits (:func:`tp_dim`), and a gated ``linear_fc1`` slice ``[gate_r; up_r]`` is two
  chunks (gate rows at ``r·F/tp``, up rows at ``F + r·F/tp``), so that one mapping serves both layouts.

Nothing here imports torch or Megatron, and nothing in a pickle runs.
"""

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ...errors import CheckpointError, LayoutError, one_line, short_repr
from ...formats import torch_files, unpickler
from ...formats.dtypes import SIZES
from ...plan import Chunk, Piece, check_tiling
from .. import dcp

LATEST = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7})$")
RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LEGACY_FILE = "model_optim_rng.pt"
COMMON = "common.pt"
MCORE_META = "metadata.json"
# What a legacy file / common.pt may pickle: tensors, containers, and args as inert records.
LEGACY_ALLOWED = {**torch_files.TORCH_ALLOWED, **unpickler.CLIENT_STATE}
# Top-level torch_dist keys that are not model weights (Megatron-LM's optimizer, RNG and rerun states).
NOT_MODEL = ("optimizer.", "rng_state", "rerun_state_machine_state", "opt_param_scheduler")
# Legacy (local-spec) names -> the TE names torch_dist records (MCore maps them on save).
LEGACY_RENAMES = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


@dataclass
class GlobalTensor:
    """One model tensor as Megatron's sharded state dict defines it: ``name`` (torch_dist's), global
    ``shape``, ``dtype`` and ``chunks`` tiling it (pieces row-major over each chunk's box)."""
    name: str
    shape: Tuple[int, ...]
    dtype: str
    chunks: List[Chunk]


@dataclass
class Save:
    """One Megatron checkpoint, read: its tensors, ``args`` (the Namespace's fields), the layout."""
    fmt: str  # "torch_dist" | "legacy"
    ckpt_dir: str
    iteration: Optional[int]
    args: Dict[str, Any]
    tensors: Dict[str, GlobalTensor]
    files: List[str]
    layout: Dict[str, Any] = field(default_factory=dict)


def iteration_dir(path: str) -> Optional[str]:
    """The ``iter_NNNNNNN`` (or ``release``) directory ``path`` is or names through
    ``latest_checkpointed_iteration.txt``; None when ``path`` holds no Megatron checkpoint."""
    if _is_iter_dir(path):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        return None
    try:
        with open(latest, "rb") as fh:
            text = fh.read(64).decode("ascii", "replace").strip()
    except OSError:
        return None
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        return None
    cand = os.path.join(path, name)
    return cand if _is_iter_dir(cand) else None


def latest_problem(path: str) -> Optional[str]:
    """Why ``path``'s ``latest_checkpointed_iteration.txt`` names no readable iteration directory although
    ``path`` holds Megatron iteration directories (a corrupt or lying file): one ``error:`` message naming
    the file and the fix; None when the file is fine, absent, or ``path`` holds no ``iter_NNNNNNN/`` (verl's
    checkpoint root also has such a file, beside ``global_step_N/``)."""
    if _is_iter_dir(path) or iteration_dir(path) is not None:
        return None
    latest = os.path.join(path, LATEST)
    try:
        names = sorted(n for n in os.listdir(path) if (ITER_RE.match(n) or n == "release") and
                       _is_iter_dir(os.path.join(path, n)))
        with open(latest, "rb") as fh:
            raw = fh.read(65)
    except OSError:
        return None
    if not names:
        return None
    text = raw[:64].decode("ascii", "replace").strip()
    found = ", ".join(names[-3:])
    if len(raw) > 64 or not (text == "release" or text.isdigit()):
        return (f"{latest}: holds {short_repr(raw[:40])}, not an iteration number (Megatron writes e.g. '200'); the "
                f"file is corrupt: pass an iteration directory ({found}) or write its number into the file")
    name = "release" if text == "release" else f"iter_{int(text):07d}"
    return (f"{latest}: names iteration {text}, but {os.path.join(path, name)} is not a complete iteration "
            f"directory (there: {found}); the save was cut short or the file lies: pass an iteration directory "
            "or fix the file")


def _is_iter_dir(path: str) -> bool:
    base = os.path.basename(os.path.normpath(path))
    if not (ITER_RE.match(base) or base == "release") or not os.path.isdir(path):
        return False
    return _torch_dist(path) or bool(_rank_dirs(path))


def _torch_dist(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MCORE_META)) and os.path.isfile(os.path.join(path, dcp.METADATA))


def _rank_dirs(path: str) -> Dict[Tuple[int, int, int], str]:
    out = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for n in names:
        m = RANK_RE.match(n)
        if m and os.path.isfile(os.path.join(path, n, LEGACY_FILE)):
            out[(int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0))] = os.path.join(path, n, LEGACY_FILE)
    return out


def read(ckpt_dir: str) -> Save:
    """The checkpoint in the iteration directory ``ckpt_dir`` (either layout)."""
    ckpt_dir = os.path.abspath(ckpt_dir)
    if _torch_dist(ckpt_dir):
        return _read_torch_dist(ckpt_dir)
    return _read_legacy(ckpt_dir)


def _namespace(obj, where) -> Dict[str, Any]:
    if not isinstance(obj, unpickler.Opaque):
        raise LayoutError(f"{where}: its 'args' is {short_repr(obj)}, not Megatron's argparse.Namespace; the file "
                          "is not a Megatron-LM checkpoint or is corrupt")
    state = obj.state if isinstance(getattr(obj, "state", None), dict) else {}
    return {k: v for k, v in state.items() if isinstance(k, str)}


def _read_torch_dist(ckpt_dir: str) -> Save:
    where_meta = os.path.join(ckpt_dir, MCORE_META)
    try:
        with open(where_meta, "rb") as fh:
            meta = json.loads(fh.read(1 << 16))
    except (OSError, ValueError) as e:
        raise LayoutError(f"{where_meta}: not readable JSON ({type(e).__name__}); copy the checkpoint again") from None
    backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(f"{where_meta}: sharded backend {short_repr(backend)}; hf-ckpt reads Megatron's "
                              "torch_dist backend (save with ckpt_format torch_dist, or convert with "
                              "Megatron-LM's tools/checkpoint first)")
    common_path = os.path.join(ckpt_dir, COMMON)
    # Megatron-Core 0.17+ writes no common.pt (its common state is a bytes entry of the .distcp files, not
    # read here): the model's shape then comes from --config alone (the source's plan asks for it).
    common = torch_files.load(common_path, allowed=LEGACY_ALLOWED) if os.path.isfile(common_path) else {}
    if not isinstance(common, dict):
        raise LayoutError(f"{common_path}: holds {short_repr(common)}, not Megatron's common state dict")
    args = _namespace(common.get("args"), common_path) if "args" in common else {}
    tensors_meta, storage, _ = dcp.read_metadata(ckpt_dir)
    where = os.path.join(ckpt_dir, dcp.METADATA)
    out: Dict[str, GlobalTensor] = {}
    for fqn, t in tensors_meta.items():
        if fqn.startswith(NOT_MODEL):
            continue
        chunks = dcp._chunks(fqn, t, where, lambda off, sz, fqn=fqn, t=t: dcp._chunk_piece(
            ckpt_dir, fqn, fqn, t.dtype, off, sz, storage, where))
        out[fqn] = GlobalTensor(fqn, tuple(t.size), t.dtype, chunks)
    files = sorted({p.path for g in out.values() for c in g.chunks for p in c.pieces})
    it = common.get("iteration")
    return Save("torch_dist", ckpt_dir, it if type(it) is int else None, args, out, files,
                {"data_files": len([n for n in os.listdir(ckpt_dir) if n.endswith(".distcp")])})


def tp_dim(name: str) -> Optional[int]:
    """The dim (of the unstacked tensor) Megatron's tensor parallelism splits ``name`` on; None when
    every TP rank holds it whole (norms, row-parallel biases, position embeddings, the router)."""
    leaf = name.rsplit(".", 2)
    module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
    if kind.startswith("layer_norm_") or module in ("final_layernorm", "position_embeddings", "router",
                                                    "input_layernorm", "pre_mlp_layernorm", "q_layernorm",
                                                    "k_layernorm"):
        return None
    if module in ("linear_qkv", "linear_fc1", "word_embeddings", "output_layer"):
        return 0
    if module in ("linear_proj", "linear_fc2"):
        return 1 if kind == "weight" else None
    raise LayoutError(f"{name}: hf-ckpt does not know how Megatron's tensor parallelism splits this tensor")


def _canonical(name: str, layer_offset: int) -> Tuple[str, Optional[int]]:
    """A legacy name -> (torch_dist name, global layer or None)."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    if not m:
        return name, None
    rest = m.group(2)
    for old, new in LEGACY_RENAMES.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
    return f"decoder.layers.{rest}", layer_offset + int(m.group(1))


def _read_legacy(ckpt_dir: str) -> Save:
    ranks = _rank_dirs(ckpt_dir)
    if not ranks:
        raise CheckpointError(f"{ckpt_dir}: no mp_rank_*/model_optim_rng.pt files; pass a Megatron iteration "
                              "directory")
    tps = sorted({k[0] for k in ranks})
    pps = sorted({k[1] for k in ranks})
    eps = sorted({k[2] for k in ranks})
    if len(eps) > 1:
        raise CheckpointError(f"{ckpt_dir}: expert-parallel legacy files (mp_rank_TT_PPP_EEE); hf-ckpt reads "
                              "legacy saves without expert parallelism (save with ckpt_format torch_dist)")
    tp, pp = len(tps), len(pps)
    for t in range(tp):
        for p in range(pp):
            if (t, p, eps[0]) not in ranks:
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")
                raise CheckpointError(f"{os.path.join(ckpt_dir, name, LEGACY_FILE)}: missing (TP {tp} x PP {pp} "
                                      "saves one file per model-parallel rank); copy every mp_rank_* directory")
    loaded: Dict[Tuple[int, int], Dict[str, Any]] = {}
    args: Dict[str, Any] = {}
    iteration = None
    for (t, p, _e), path in sorted(ranks.items()):
        obj = torch_files.load(path, allowed=LEGACY_ALLOWED)
        if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
            if isinstance(obj, dict) and any(k.startswith("model") and k[5:].isdigit() for k in obj):
                raise CheckpointError(f"{path}: a virtual-pipeline save (model0, model1...); hf-ckpt does not read "
                                      "interleaved pipeline stages yet")
            raise LayoutError(f"{path}: no 'model' state dict; not a Megatron-LM model_optim_rng.pt")
        loaded[(t, p)] = obj["model"]
        if (t, p) == (0, 0):
            args = _namespace(obj.get("args"), path) if "args" in obj else {}
            iteration = obj.get("iteration") if type(obj.get("iteration")) is int else None
    for key, value in args.items():
        if key in ("tensor_model_parallel_size", "pipeline_model_parallel_size") and type(value) is int:
            have = tp if key.startswith("tensor") else pp
            if value != have:
                raise CheckpointError(f"{ckpt_dir}: args.{key} is {value} but {have} rank directories are there; "
                                      "copy every mp_rank_* directory of the save")
    if args.get("virtual_pipeline_model_parallel_size") not in (None, 1):
        raise CheckpointError(f"{ckpt_dir}: a virtual-pipeline save; hf-ckpt does not read interleaved stages yet")
    # Layers per stage: counted in TP rank 0's files (uneven first/last stages included).
    offsets, at = [], 0
    for p in range(pp):
        offsets.append(at)
        at += len({int(m.group(1)) for n in loaded[(0, p)] for m in [re.match(r"^decoder\.layers\.(\d+)\.", n)] if m})
    num_layers = at
    if type(args.get("num_layers")) is int and args["num_layers"] != num_layers:
        raise LayoutError(f"{ckpt_dir}: the files hold {num_layers} layers, args.num_layers is {args['num_layers']}; "
                          "the save is incomplete or mixes two runs: copy it again")
    gated = bool(args.get("swiglu")) or bool(args.get("gated_linear_unit"))
    pieces: Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...], Piece, int]]] = {}
    shapes: Dict[str, Tuple[Optional[int], Tuple[int, ...], str]] = {}  # name -> (stacked?, local shape, dtype)
    files = []
    for (t, p), model in sorted(loaded.items()):
        path = ranks[(t, p, eps[0])]
        files.append(path)
        for raw, ref in model.items():
            if ref is None or raw.endswith("._extra_state"):
                continue
            if not isinstance(ref, torch_files.TensorRef):
                raise LayoutError(f"{path}: model entry {one_line(raw[:100])} is {short_repr(ref)}, not a tensor")
            if not ref.is_contiguous():
                raise LayoutError(f"{path}: {one_line(raw[:100])} is stored as a non-contiguous view; hf-ckpt reads "
                                  "the contiguous tensors Megatron saves")
            name, layer = _canonical(raw, offsets[p])
            dim = tp_dim(name)
            if dim is None and t != 0:
                continue  # a TP replica: rank 0's copy is the one read
            start, _ = ref.byte_range()
            piece = Piece(ref.path, start, ref.numel, ref.dtype)
            local = tuple(ref.shape)
            prev = shapes.get(name)
            if prev is not None and (prev[1] != local or prev[2] != ref.dtype):
                raise LayoutError(f"{path}: {one_line(raw[:100])} is {ref.dtype} {list(local)}, but another rank's "
                                  f"file holds it as {prev[2]} {list(prev[1])}; the files belong to different saves "
                                  "or a different TP size: copy the checkpoint again")
            shapes[name] = (layer, local, ref.dtype)
            pieces.setdefault(name, []).append(((layer,) if layer is not None else (), local, piece, t))
    out: Dict[str, GlobalTensor] = {}
    for name, entries in pieces.items():
        layer0, local, dtype = shapes[name]
        dim = tp_dim(name)
        full = list(local)
        if dim is not None:
            if dim >= len(local):
                raise LayoutError(f"{ckpt_dir}: {name} has shape {list(local)}; no dim {dim} to split on")
            full[dim] *= tp
        stacked = layer0 is not None
        shape = ((num_layers,) if stacked else ()) + tuple(full)
        chunks = []
        for lead, loc, piece, t in entries:
            base = [0] * len(loc)
            if dim is not None and gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
                # [gate_r; up_r] on TP rank r: gate rows land at r*F/tp, up rows at F + r*F/tp.
                half, row = loc[0] // 2, math.prod(loc[1:])
                for k in (0, 1):
                    off = [0] * len(loc)
                    off[0] = k * full[0] // 2 + t * half
                    part = Piece(piece.path, piece.offset + k * half * row * SIZES[dtype], half * row, dtype)
                    chunks.append(Chunk((part,), tuple(lead) + tuple(off), ((1,) if stacked else ()) + (half,) + tuple(loc[1:])))
                continue
            if dim is not None:
                base[dim] = t * loc[dim]
            chunks.append(Chunk((piece,), tuple(lead) + tuple(base), ((1,) if stacked else ()) + tuple(loc)))
        try:
            check_tiling(shape, chunks)
        except ValueError as e:
            raise LayoutError(f"{ckpt_dir}: the files' slices of {name} do not tile {list(shape)} ({e}); a stage "
                              "or rank is missing or the files mix two saves: copy the checkpoint again") from None
        out[name] = GlobalTensor(name, shape, dtype, chunks)
    return Save("legacy", ckpt_dir, iteration, args, out, files, {"rank_files": len(ranks)})



def read_args(ckpt_dir: str) -> Dict[str, Any]:
    """The saved ``args`` of the iteration directory ``ckpt_dir`` (common.pt, or the first legacy file)."""
    if _torch_dist(ckpt_dir):
        path = os.path.join(ckpt_dir, COMMON)
        if not os.path.isfile(path):
            return {}
    else:
        ranks = _rank_dirs(ckpt_dir)
        if not ranks:
            return {}
        path = ranks[min(ranks)]
    obj = torch_files.load(path, allowed=LEGACY_ALLOWED)
    return _namespace(obj.get("args"), path) if isinstance(obj, dict) and "args" in obj else {}
