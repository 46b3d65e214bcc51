"""DeepSpeed AutoEP (0.19.2+, ``"expert_parallel": {"enabled": true}``) saves under ZeRO-1/2.

What such a save holds (DeepSpeed ``engine._save_moe_checkpoint``, ``module_inject/auto_ep*``,
``moe/ep_repack.py``):

- AutoEP replaced each MoE block of an HF model (``ds_autoep_layers[i]["module_path"]``, e.g.
  ``model.layers.0.mlp``) by an ``AutoEPMoELayer``: a ``router.gate`` linear and TorchTitan-style
  fused experts ``experts.w1`` (gate, ``[local, ffn, hidden]``), ``experts.w2`` (down,
  ``[local, hidden, ffn]``), ``experts.w3`` (up, ``[local, ffn, hidden]``) holding the
  ``num_local_experts`` experts of this expert-parallel rank (global ids ``ep_rank * local + i``);
- ``layer_{L}_expert_{E}_mp_rank_{MM}_model_states.pt`` holds expert ``E``'s module weights
  ``{module_path}.experts.wK.{E}`` (2-D), one file per global expert;
- ``param_shapes`` is rank 0's: its expert group names the fused ``experts.wK`` of expert-parallel
  rank 0; that group is partitioned over the expert-data-parallel group (``partition_count`` =
  world / ``ep_size``), as for ``deepspeed.moe`` (:mod:`.moe`, whose rank orders are tried here too,
  each proven against the expert files before it is used);
- the model-states module also holds ``{module_path}.gate.gate.weight``, a second copy of the
  router kept by AutoEP's HF adapter; it is checked equal to the router and not written.

The output is the model's in-memory transformers layout, which :mod:`..hub_layout` then turns into
``save_pretrained``'s Hub layout like any other checkpoint: per MoE layer ``{module_path}.{router}.weight``
and the preset's fused ``gate_up_proj`` (``[E, 2 ffn, hidden]``: each expert's w1 then w3, the split
AutoEP's repack undid) and ``down_proj`` (``[E, hidden, ffn]``: w2). Which names the preset's model
uses is recorded in ``ds_config.expert_parallel.preset_model``; presets not in :data:`PRESETS` are
refused by name.
"""

import dataclasses
import os
import re
from typing import Dict, List, Optional

from ...errors import LayoutError
from ...formats.torch_files import TensorRef
from ...mapped_files import MappedFiles
from ...plan import Piece, TensorPlan, narrow_pieces
from . import moe
from .allowlist import load
from .fields import tensor_pieces

__all__ = ["PRESETS", "AutoEPExperts", "find_autoep_files", "plan_autoep", "finish_autoep"]

# preset_model -> (the router's name in the HF MoE block, the fused expert names of its transformers 5
# in-memory layout). The preset files (deepspeed/module_inject/auto_ep_presets/*.py) record these as
# router_pattern, expert_w1 (gate and up fused, gate first) and expert_w2.
PRESETS = {
    "mixtral": ("gate", "gate_up_proj", "down_proj"),
}

_W = ("w1", "w2", "w3")
# Elements compared per expert weight while planning (``verify`` compares every element).
SAMPLES = 8


class AutoEPExperts:
    """An AutoEP save's expert files of one model-parallel rank: ``weights`` (``{prefix}.wK.{E}`` ->
    module weight), ``layers`` (``ds_autoep_layers`` as recorded), ``files``."""

    def __init__(self, weights: Dict[str, TensorRef], files: List[str]):
        self.weights = weights
        self.files = files
        self.layers: List[dict] = []

    def __bool__(self):
        return bool(self.files)


def find_autoep_files(tag_dir: str, names: List[str], mp_rank: int) -> Optional[AutoEPExperts]:
    """The AutoEP expert files among ``names`` (the tag dir's listing), or None when the tag holds no
    expert file or its expert files are ``deepspeed.moe``'s (:func:`.moe.find_expert_files`)."""
    paths = sorted(p for by_expert in moe.expert_files(tag_dir, names, mp_rank).values() for p in by_expert.values())
    if not paths:
        return None
    first = load(paths[0])
    if not (isinstance(first, dict) and any(isinstance(k, str) and moe.AUTOEP_NAME_RE.match(k) for k in first)):
        return None
    weights: Dict[str, TensorRef] = {}
    for path in paths:
        state = first if path == paths[0] else load(path)
        expert = int(moe.EXPERT_FILE_RE.match(os.path.basename(path)).group(2))
        if not isinstance(state, dict) or not state:
            raise LayoutError(f"{path}: not a DeepSpeed expert file (no expert weights); the file is corrupt")
        for key, ref in state.items():
            m = moe.AUTOEP_NAME_RE.match(key) if isinstance(key, str) else None
            if m is None or not key.endswith(f".{expert}") or not isinstance(ref, TensorRef) or len(ref.shape) != 2:
                raise LayoutError(f"{path}: holds {key!r}, not a 2-D AutoEP weight of expert {expert}; the file "
                                  "was renamed or is corrupt: copy the tag directory again")
            weights[key] = ref
    return AutoEPExperts(weights, paths)


def _layers(model, model_path):
    layers = model.get("ds_autoep_layers")
    ep_config = (model.get("ds_config") or {}).get("expert_parallel") or {}
    preset = ep_config.get("preset_model")
    if ep_config.get("expert_tensor_parallel_size", 1) != 1:
        # AutoTP folding splits each expert over tensor-parallel ranks too: another layout, never run here
        raise LayoutError(f"{model_path}: a DeepSpeed AutoEP save with expert_tensor_parallel_size "
                          f"{ep_config.get('expert_tensor_parallel_size')!r} (AutoTP folding); hf-ckpt reads AutoEP "
                          "saves without expert tensor parallelism only")
    if not isinstance(layers, list) or not layers:
        raise LayoutError(f"{model_path}: the tag holds AutoEP expert files (experts.w1/w2/w3 per expert) but the "
                          "model-states file records no ds_autoep_layers; files from different saves are mixed: "
                          "copy one save's tag directory again")
    if preset not in PRESETS:
        raise LayoutError(f"{model_path}: a DeepSpeed AutoEP save of preset_model {preset!r}; hf-ckpt writes the "
                          f"HF layout of AutoEP presets {sorted(PRESETS)} only")
    out = []
    for layer in layers:
        try:
            path, prefix = str(layer["module_path"]), str(layer["expert_key_prefix"])
            total, ep = int(layer["num_experts"]), int(layer["ep_size"])
        except (KeyError, TypeError, ValueError):
            raise LayoutError(f"{model_path}: a ds_autoep_layers entry lacks module_path, expert_key_prefix, "
                              "num_experts or ep_size; the file is corrupt") from None
        if ep <= 0 or total % ep:
            raise LayoutError(f"{model_path}: AutoEP layer {path} records {total} experts over ep_size {ep}; "
                              "the file is corrupt")
        out.append({"path": path, "prefix": prefix, "experts": total, "ep": ep})
    return out, PRESETS[preset]


def _prove(files, master: List[Piece], copy: TensorRef, what: str, where: str):
    """A few of ``master``'s fp32 elements, cast to the expert file's dtype, must equal it."""
    from ...casts import cast_bytes

    n = copy.numel
    for pos in sorted({(n - 1) * k // (SAMPLES - 1) for k in range(SAMPLES)} if n else ()):
        (m,) = narrow_pieces(master, pos, 1)
        off, nbytes = copy.byte_range(pos, 1)
        got = cast_bytes(bytes(files.read(m.path, m.offset, 4)), "F32", copy.dtype)
        if got != bytes(files.read(copy.path, off, nbytes)):
            raise LayoutError(f"{where}: its fp32 masters of {what} do not match the expert file "
                              f"{os.path.basename(copy.path)} at element {pos}")


def plan_autoep(ranks, param_groups, model_path, tensors, module, model, experts: AutoEPExperts, notes, *,
                plan_group, partition_count, module_copy, shape_of):
    """Plan every parameter group of an AutoEP save into ``tensors``: dense groups as ZeRO-1/2 does,
    the expert group per expert-parallel rank, its fused ``experts.wK`` cut per expert, proven
    against the expert files, and assembled into the preset's in-memory names. ``plan_group``,
    ``partition_count``, ``module_copy``, ``shape_of``: :mod:`.zero12`'s helpers."""
    layers, (router, gate_up, down) = _layers(model, model_path)
    experts.layers = layers
    fused = {f"{layer['prefix']}.{w}": layer for layer in layers for w in _W}
    dp = len(ranks)
    masters: Dict[str, List[Piece]] = {}  # "{prefix}.wK.{E}" -> fp32 pieces
    for i, group in enumerate(param_groups):
        names = list(group)
        shapes = [shape_of(group[n], model_path, n) for n in names]
        if not names or not all(n in fused for n in names):
            if any(n in fused for n in names):
                raise LayoutError(f"{model_path}: parameter group {i} mixes AutoEP experts with other parameters; "
                                  "hf-ckpt reads AutoEP saves whose experts have their own group only")
            copies = {n: module_copy(module.get(n), s) for n, s in zip(names, shapes)}
            plan_group(ranks, i, names, shapes, model_path, copies, tensors, notes)
            continue
        count = partition_count(ranks[0], i)
        ep = fused[names[0]]["ep"]
        if not isinstance(count, int) or count * ep != dp or any(fused[n]["ep"] != ep for n in names):
            raise LayoutError(f"{ranks[0].path}: records partition_count {count!r} for AutoEP expert group {i}, "
                              f"but ep_size {ep} x that is not the {dp} data-parallel rank files; files from "
                              "different saves are mixed: copy one save's tag directory again")
        failures = []
        for label, rank_of in moe.TOPOLOGIES:
            try:
                found = _plan_experts(ranks, i, names, shapes, count, ep, rank_of, fused, experts, model_path, notes,
                                      plan_group)
            except LayoutError as err:
                failures.append((label, err))
                continue
            masters.update(found)
            notes.append(f"AutoEP: parameter group {i} holds experts over {ep} expert-parallel ranks, each "
                         f"partitioned over {count} expert-data-parallel ranks ({label})")
            break
        else:
            raise LayoutError(f"{model_path}: a DeepSpeed AutoEP save (expert group {i} over {ep} expert-parallel x "
                              f"{count} expert-data-parallel ranks) whose fp32 partitions match the expert files in "
                              f"no rank order DeepSpeed builds; first disagreement: {failures[0][1]}")
    for layer in layers:
        p, total = layer["prefix"], layer["experts"]
        need = [f"{p}.{w}.{e}" for e in range(total) for w in _W]
        absent = [n for n in need if n not in masters or n not in experts.weights]
        if absent:
            raise LayoutError(f"{model_path}: AutoEP layer {layer['path']} has no master or expert file for "
                              f"{absent[:3]}; the copy is incomplete: copy the whole tag directory again")
        w1, w2 = experts.weights[f"{p}.w1.0"], experts.weights[f"{p}.w2.0"]
        ffn, hidden = w1.shape
        for name, shape, order in ((gate_up, (total, 2 * ffn, hidden), ("w1", "w3")), (down, (total, hidden, ffn),
                                                                                          ("w2",))):
            keys = [f"{p}.{w}.{e}" for e in range(total) for w in order]
            out = f"{layer['path']}.experts.{name}"
            mod = [tensor_pieces(experts.weights[k], 0, experts.weights[k].numel) for k in keys]
            tensors[out] = TensorPlan(out, shape, "F32", [[q for k in keys for q in masters[k]]], kind="master",
                                      module_check=([[q for k in keys for q in masters[k]]], [mod]))
        if w2.shape != (hidden, ffn):
            raise LayoutError(f"{w2.path}: AutoEP down projection of shape {w2.shape}, expected {(hidden, ffn)}; "
                              "the file is corrupt")
    return router


def _plan_experts(ranks, i, names, shapes, count, ep, rank_of, fused, experts, model_path, notes, plan_group):
    found = {}
    with MappedFiles() as files:
        for e in range(ep):
            members = {k: ranks[rank_of(e, k, ep, count)] for k in range(count)}
            planned = {}
            plan_group(members, i, names, shapes, model_path, {}, planned, notes)
            for n, shape in zip(names, shapes):
                local = shape[0]
                if len(shape) != 3 or local * ep != fused[n]["experts"]:
                    raise LayoutError(f"{model_path}: AutoEP {n} of shape {shape} does not hold "
                                      f"{fused[n]['experts']} // {ep} experts; the file is corrupt")
                per = shape[1] * shape[2]
                (pieces,) = planned[n].parts
                for j in range(local):
                    key = f"{n}.{e * local + j}"
                    copy = experts.weights.get(key)
                    if copy is None or copy.shape != tuple(shape[1:]):
                        raise LayoutError(f"{model_path}: no layer_*_expert_* file holds {key} of shape "
                                          f"{tuple(shape[1:])}; expert files are missing or from another save")
                    found[key] = narrow_pieces(pieces, j * per, per)
                    _prove(files, found[key], copy, key, members[0].path)
    return found


def finish_autoep(tensors, module, experts: AutoEPExperts, router: str, model_path):
    """Rename each AutoEP router ``{path}.router.gate.weight`` to the model's ``{path}.{router}.weight``
    and drop the adapter's second router copy ``{path}.gate.gate.weight`` after checking it equal."""
    with MappedFiles() as files:
        for layer in experts.layers:
            src = f"{layer['path']}.router.gate.weight"
            if src not in tensors:
                raise LayoutError(f"{model_path}: AutoEP layer {layer['path']} has no router {src}; "
                                  "the file is corrupt")
            t = tensors.pop(src)
            dst = f"{layer['path']}.{router}.weight"
            tensors[dst] = dataclasses.replace(t, name=dst)
            alias = f"{layer['path']}.gate.gate.weight"
            a, b = module.get(alias), module.get(src)
            if alias in tensors:
                tensors.pop(alias)
                if not (isinstance(a, TensorRef) and isinstance(b, TensorRef) and a.shape == b.shape and
                        a.dtype == b.dtype and
                        bytes(files.read(a.path, *a.byte_range(0, a.numel))) ==
                        bytes(files.read(b.path, *b.byte_range(0, b.numel)))):
                    raise LayoutError(f"{model_path}: {alias} differs from the router {src} it copies; "
                                      "the file is corrupt")
    for name in [n for n in tensors if re.match(r".*\.experts\.w[123]$", n)]:
        raise LayoutError(f"{model_path}: {name} is outside every ds_autoep_layers entry; the file is corrupt")
