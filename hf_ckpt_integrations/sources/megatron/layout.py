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
  A virtual-pipeline (interleaved) file holds ``model0``, ``model1``, ...: its chunks are placed in
  Megatron's order (:func:`_layer_offsets`).

Nothing here imports torch or Megatron, and nothing in a pickle runs.
"""

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ...errors import CheckpointError, LayoutError, UnsafeCheckpointError, one_line, short_repr
from ...formats import torch_files, unpickler
from ...formats.dtypes import SIZES
from ...plan import Chunk, Piece, check_tiling
from .. import dcp
from .common_state import COMMON_STATE_KEY, LEGACY_ALLOWED, read_common_state

LATEST = "latest_checkpointed_iteration.txt"
ITER_RE = re.compile(r"^iter_(\d{7})$")
RANK_RE = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LEGACY_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM = "distrib_optim.pt"  # the distributed optimizer's state beside LEGACY_FILE: never read
COMMON = "common.pt"
MCORE_META = "metadata.json"
# What a legacy file / common.pt may pickle: tensors, containers, and args as inert records.
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
    # Megatron-Core 0.17+ writes no common.pt: its common state is a bytes entry of the .distcp files
    # (read_common_state). With neither, the model's shape comes from --config alone (the plan asks for it).
    if not os.path.isfile(common_path):
        common_path = f"{os.path.join(ckpt_dir, dcp.METADATA)} ({COMMON_STATE_KEY})"
    common = torch_files.load(common_path, allowed=LEGACY_ALLOWED) if os.path.isfile(common_path) else \
        read_common_state(ckpt_dir) or {}
    if not isinstance(common, dict):
        raise LayoutError(f"{common_path}: holds {short_repr(common)}, not Megatron's common state dict")
    args = _namespace(common.get("args"), common_path) if "args" in common else {}
    tensors_meta, storage, _ = dcp.read_metadata(ckpt_dir)
    where = os.path.join(ckpt_dir, dcp.METADATA)
    out: Dict[str, GlobalTensor] = {}
    data_files: Dict[str, str] = {}
    for fqn, t in tensors_meta.items():
        if fqn.startswith(NOT_MODEL):
            continue
        chunks = dcp._chunks(fqn, t, where, lambda off, sz, fqn=fqn, t=t: dcp._chunk_piece(
            ckpt_dir, fqn, fqn, t.dtype, off, sz, storage, where, data_files))
        out[fqn] = GlobalTensor(fqn, tuple(t.size), t.dtype, chunks)
    files = sorted({p.path for g in out.values() for c in g.chunks for p in c.pieces})
    it = common.get("iteration")
    return Save("torch_dist", ckpt_dir, it if type(it) is int else None, args, out, files,
                {"data_files": len([n for n in os.listdir(ckpt_dir) if n.endswith(".distcp")]),
                 **_torch_dist_optimizer(common, tensors_meta)})


def _torch_dist_optimizer(common: Dict[str, Any], tensors_meta: Dict[str, Any]) -> Dict[str, Any]:
    """What a torch_dist save says of its optimizer, for ``inspect`` (never read for the export): the
    distributed optimizer's ``param_state_sharding_type`` (common.pt's ``optimizer``: ``dp_reshardable``
    keeps its per-bucket flat state under ``optimizer.distributed.*``, ``fully_reshardable`` its state per
    model tensor under ``optimizer.state.*``) and how many ``optimizer.`` tensors the files hold."""
    opt = common.get("optimizer")
    sharding = opt.get("param_state_sharding_type") if isinstance(opt, dict) else None
    return {"optimizer_sharding": sharding if isinstance(sharding, str) else None,
            "optimizer_tensors": sum(1 for n in tensors_meta if n.startswith("optimizer."))}


def tp_dim(name: str) -> Optional[int]:
    """The dim (of the unstacked tensor) Megatron's tensor parallelism splits ``name`` on; None when
    every TP rank holds it whole (norms, row-parallel biases, position embeddings, the router, a shared
    expert's gate_weight)."""
    leaf = name.rsplit(".", 2)
    module, kind = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
    if kind.startswith("layer_norm_") or kind == "gate_weight" or module in (
            "final_layernorm", "position_embeddings", "router", "input_layernorm", "pre_mlp_layernorm", "q_layernorm",
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
    ranks = _expert_ranks(ranks)
    tps = sorted({k[0] for k in ranks})
    pps = sorted({k[1] for k in ranks})
    eps = sorted({k[2] for k in ranks})
    tp, pp, ep = len(tps), len(pps), len(eps)
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                if (t, p, e) not in ranks:
                    name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                    raise CheckpointError(f"{os.path.join(ckpt_dir, name, LEGACY_FILE)}: missing (TP {tp} x PP {pp}"
                                          + (f" x EP {ep}" if ep > 1 else "") + " saves one file per model-parallel "
                                          "rank); copy every mp_rank_* directory")
    # (tp, pp, ep) -> its model chunks (virtual pipeline stages: model0, model1...; one without them)
    loaded: Dict[Tuple[int, int, int], List[Dict[str, Any]]] = {}
    args: Dict[str, Any] = {}
    iteration = None
    for (t, p, e), path in sorted(ranks.items()):
        obj = torch_files.load(path, allowed=LEGACY_ALLOWED)
        loaded[(t, p, e)] = _model_chunks(obj, path)
        if (t, p, e) == (0, 0, 0):
            args = _namespace(obj.get("args"), path) if "args" in obj else {}
            iteration = obj.get("iteration") if type(obj.get("iteration")) is int else None
    for key, value in args.items():
        if key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size") \
                and type(value) is int:
            have = tp if key.startswith("tensor") else pp if key.startswith("pipeline") else ep
            if value != have:
                raise CheckpointError(f"{ckpt_dir}: args.{key} is {value} but {have} rank directories are there; "
                                      "copy every mp_rank_* directory of the save")
    # the layer placement is the same in every EP rank's files: counted in the first EP rank's
    offsets, num_layers = _layer_offsets(ckpt_dir, ranks, {(t, p): ms for (t, p, e), ms in loaded.items() if e == eps[0]},
                                         args, tp, pp, eps[0])
    if type(args.get("num_layers")) is int and args["num_layers"] != num_layers:
        raise LayoutError(f"{ckpt_dir}: the files hold {num_layers} layers, args.num_layers is {args['num_layers']}; "
                          "the save is incomplete or mixes two runs: copy it again")
    gated = bool(args.get("swiglu")) or bool(args.get("gated_linear_unit"))
    # (every chunk's names: local experts are numbered alike in each virtual stage)
    local_experts = _local_expert_counts({k: {n: None for m in ms for n in m} for k, ms in loaded.items()}, ranks, args, ep)
    num_experts = local_experts * ep
    pieces: Dict[str, List[Tuple[Tuple[int, ...], Tuple[int, ...], Piece, int]]] = {}
    shapes: Dict[str, Tuple[Optional[int], Tuple[int, ...], str]] = {}  # name -> (stacked?, local shape, dtype)
    files = []
    for (t, p, e, v), model in sorted((k + (v,), m) for k, ms in loaded.items() for v, m in enumerate(ms)):
        path = ranks[(t, p, e)]
        if v == 0:
            files.append(path)
        for raw, ref in model.items():
            if ref is None or raw.endswith("._extra_state"):
                continue
            if not isinstance(ref, torch_files.TensorRef):
                raise LayoutError(f"{path}: model entry {one_line(raw[:100])} is {short_repr(ref)}, not a tensor")
            if not ref.is_contiguous():
                raise LayoutError(f"{path}: {one_line(raw[:100])} is stored as a non-contiguous view; hf-ckpt reads "
                                  "the contiguous tensors Megatron saves")
            expert = _canonical_expert(raw, offsets[(p, v)], e * local_experts)
            name, layer = expert[:2] if expert else _canonical(raw, offsets[(p, v)])
            if expert is None and e != 0:
                continue  # the dense weights every EP rank's file holds: EP rank 0's copy is the one read
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
            lead = ((layer,) if layer is not None else ()) + ((expert[2],) if expert else ())
            pieces.setdefault(name, []).append((lead, local, piece, t))
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
        lead_shape = ((num_layers,) if stacked else ()) + ((num_experts,) if _EXPERT in name else ())
        shape = lead_shape + tuple(full)
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
                    chunks.append(Chunk((part,), tuple(lead) + tuple(off), (1,) * len(lead) + (half,) + tuple(loc[1:])))
                continue
            if dim is not None:
                base[dim] = t * loc[dim]
            chunks.append(Chunk((piece,), tuple(lead) + tuple(base), (1,) * len(lead) + tuple(loc)))
        try:
            check_tiling(shape, chunks)
        except ValueError as e:
            raise LayoutError(f"{ckpt_dir}: the files' slices of {name} do not tile {list(shape)} ({e}); a stage "
                              "or rank is missing or the files mix two saves: copy the checkpoint again") from None
        out[name] = GlobalTensor(name, shape, dtype, chunks)
    # The distributed optimizer's state (Megatron-LM's ``distrib_optim.pt`` beside each rank's file): counted
    # for ``inspect``, never opened (the model's weights are all in model_optim_rng.pt's ``model``).
    distrib = sum(1 for p in ranks.values() if os.path.isfile(os.path.join(os.path.dirname(p), DISTRIB_OPTIM)))
    return Save("legacy", ckpt_dir, iteration, args, out, files, {"rank_files": len(ranks),
                                                                  "distrib_optim_files": distrib})


# ---------------------------------------------------------------- expert parallelism (legacy files)

# A SequentialMLP's experts: ``decoder.layers.L.mlp.experts.local_experts.K.X`` in a legacy file (K the EP
# rank's local index), ``decoder.layers.mlp.experts.experts.X`` stacked [layers, experts, ...] in torch_dist.
_LOCAL_EXPERT_RE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_EXPERT = "mlp.experts.experts."


def _expert_ranks(ranks: Dict[Tuple[int, int, int], str]) -> Dict[Tuple[int, int, int], str]:
    """``ranks`` keyed (TP, PP, EP). Megatron-LM names a rank's directory ``mp_rank_TT[_PPP][_EEE]`` (the
    pipeline rank only with PP > 1, the expert rank only with EP > 1), so ``mp_rank_TT_NNN`` is ambiguous:
    it is an expert rank when the save's args say EP > 1 and PP 1 (read from TP rank 0's first file)."""
    names = {k: os.path.basename(os.path.dirname(v)) for k, v in ranks.items()}
    if not ranks or any(m is not None and m.group(3) is not None for m in map(RANK_RE.match, names.values())):
        return ranks
    if len({k[1] for k in ranks}) < 2:
        return ranks
    path = ranks[min(ranks)]
    obj = torch_files.load(path, allowed=LEGACY_ALLOWED)
    args = _namespace(obj.get("args"), path) if isinstance(obj, dict) and "args" in obj else {}
    ep, pp = args.get("expert_model_parallel_size"), args.get("pipeline_model_parallel_size")
    if type(ep) is int and ep > 1 and pp in (None, 1):
        return {(t, 0, n): v for (t, n, _), v in ranks.items()}
    return ranks


def _canonical_expert(name: str, layer_offset: int, expert_offset: int) -> Optional[Tuple[str, int, int]]:
    """A legacy local expert's name -> (torch_dist name, global layer, global expert); None for others."""
    m = _LOCAL_EXPERT_RE.match(name)
    if not m:
        return None
    return (f"decoder.layers.{_EXPERT}{m.group(3)}", layer_offset + int(m.group(1)),
            expert_offset + int(m.group(2)))


def _local_expert_counts(loaded: Dict[Tuple[int, int, int], Dict[str, Any]],
                         ranks: Dict[Tuple[int, int, int], str], args: Dict[str, Any], ep: int) -> int:
    """How many experts each EP rank's files hold per layer (local indices 0..n-1 in every file, the same
    n everywhere, n x EP = args.num_experts); a file that disagrees is refused by name."""
    counts: Dict[Tuple[int, int, int], int] = {}
    for key, model in loaded.items():
        per_layer: Dict[str, set] = {}
        for raw in model:
            m = _LOCAL_EXPERT_RE.match(raw)
            if m:
                per_layer.setdefault(m.group(1), set()).add(int(m.group(2)))
        sizes = {len(v) for v in per_layer.values()}
        if len(sizes) > 1 or any(v != set(range(len(v))) for v in per_layer.values()):
            raise LayoutError(f"{ranks[key]}: its layers hold different local experts "
                              f"({ {k: sorted(v) for k, v in sorted(per_layer.items())} }); the file is cut short or "
                              "mixes two saves: copy the checkpoint again")
        counts[key] = sizes.pop() if sizes else 0
    found = sorted(set(counts.values()))
    if len(found) > 1:
        odd = min(counts, key=lambda k: (list(counts.values()).count(counts[k]), k))
        raise LayoutError(f"{ranks[odd]}: holds {counts[odd]} local experts per layer, other EP ranks' files "
                          f"{[n for n in found if n != counts[odd]][0]}; the files belong to different saves or a "
                          "different EP size: copy the checkpoint again")
    local = found[0] if found else 0
    want = args.get("num_experts")
    if local and type(want) is int and local * ep != want:
        raise LayoutError(f"{ranks[min(ranks)]}: {ep} EP rank(s) x {local} local experts is {local * ep} experts, "
                          f"args.num_experts is {want}; an EP rank's files are missing or from another save: copy "
                          "every mp_rank_* directory")
    if not local and ep > 1:
        raise LayoutError(f"{ranks[min(ranks)]}: EP {ep} rank files without local experts (decoder.layers.N.mlp."
                          "experts.local_experts.K.*); hf-ckpt reads SequentialMLP experts (grouped-GEMM saves "
                          "not yet)")
    return local


def _model_chunks(obj: Any, path: str) -> List[Dict[str, Any]]:
    """A legacy file's model state dicts: ``[model]``, or a virtual-pipeline (interleaved) save's ``model0``,
    ``model1``, ... (Megatron-LM's ``save_checkpoint`` with ``len(model) > 1``), in chunk order."""
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        return [obj["model"]]
    found = sorted(int(k[5:]) for k in obj if isinstance(k, str) and k.startswith("model") and k[5:].isdigit()) \
        if isinstance(obj, dict) else []
    if not found:
        raise LayoutError(f"{path}: no 'model' state dict; not a Megatron-LM model_optim_rng.pt")
    if found != list(range(len(found))) or not all(isinstance(obj[f"model{v}"], dict) for v in found):
        raise LayoutError(f"{path}: virtual-pipeline model chunks {', '.join(f'model{v}' for v in found)} are not "
                          "model0..modelN state dicts; the file is corrupt: copy the checkpoint again")
    return [obj[f"model{v}"] for v in found]


def _layer_offsets(ckpt_dir: str, ranks: Dict[Tuple[int, int, int], str], loaded: Dict[Tuple[int, int], List[Dict[str, Any]]],
                   args: Dict[str, Any], tp: int, pp: int, ep: int) -> Tuple[Dict[Tuple[int, int], int], int]:
    """The global index of each (stage, virtual stage)'s first layer, and the layer count. Layers are placed
    virtual stage by virtual stage, each over the pipeline stages in order (Megatron-Core's
    ``get_transformer_layer_offset``: chunk v of stage p starts after chunks 0..v-1 of every stage and chunk v
    of stages 0..p-1), counted in TP rank 0's files, so uneven stages work; without virtual stages it is the
    layer count of the stages before."""
    vpp = {len(loaded[(t, p)]) for t in range(tp) for p in range(pp)}
    if len(vpp) > 1:
        p0 = min((k for k in loaded if len(loaded[k]) != len(loaded[(0, 0)])))
        raise LayoutError(f"{ranks[p0 + (ep,)]}: holds {len(loaded[p0])} model chunk(s), mp_rank_00's file "
                          f"{len(loaded[(0, 0)])}; the files mix two saves or one is cut short: copy the checkpoint again")
    chunks = vpp.pop()
    want = args.get("virtual_pipeline_model_parallel_size")
    if type(want) is int and want != chunks or want is None and chunks > 1 and "virtual_pipeline_model_parallel_size" in args:
        raise LayoutError(f"{ckpt_dir}: the files hold {chunks} virtual-pipeline model chunk(s) per stage (model0...), "
                          f"args.virtual_pipeline_model_parallel_size is {want}; the save is incomplete or mixes two "
                          "runs: copy it again")
    if chunks > 1 and args.get("pipeline_model_parallel_layout"):
        raise CheckpointError(f"{ckpt_dir}: args.pipeline_model_parallel_layout is set (a custom layer placement); "
                              "hf-ckpt places interleaved stages by Megatron's default order only")
    offsets, at = {}, 0
    for v in range(chunks):
        for p in range(pp):
            offsets[(p, v)] = at
            at += len({int(m.group(1)) for n in loaded[(0, p)][v]
                       for m in [re.match(r"^decoder\.layers\.(\d+)\.", n)] if m})
    return offsets, at


def read_args(ckpt_dir: str) -> Dict[str, Any]:
    """The saved ``args`` of the iteration directory ``ckpt_dir`` (common.pt, or the first legacy file)."""
    if _torch_dist(ckpt_dir):
        path = os.path.join(ckpt_dir, COMMON)
        if not os.path.isfile(path):  # Megatron-Core 0.17+: the common state is inside the .distcp files
            common = read_common_state(ckpt_dir) or {}
            return _namespace(common["args"], f"{os.path.join(ckpt_dir, dcp.METADATA)} ({COMMON_STATE_KEY})") \
                if "args" in common else {}
    else:
        ranks = _rank_dirs(ckpt_dir)
        if not ranks:
            return {}
        path = ranks[min(ranks)]
    obj = torch_files.load(path, allowed=LEGACY_ALLOWED)
    return _namespace(obj.get("args"), path) if isinstance(obj, dict) and "args" in obj else {}
