"""FSDP1 ``LOCAL_STATE_DICT`` rank files: flat parameters split by the model's parameter shapes.

Accelerate's ``save_fsdp_model`` under ``LOCAL_STATE_DICT`` writes ``pytorch_model_fsdp_rank{R}.bin``:
each rank's ``model.state_dict()``, in which every FSDP unit (a wrapped module) is one 1-D
``ShardedTensor`` named ``{unit path}._flat_param`` (``_flat_param`` for the root). What it records
(torch's ``_local_post_state_dict_hook``): the flat parameter's element count without the
world-size padding and this rank's shard at offset ``rank * padded shard size`` (the padding cut
off). What it does not record: which parameters the unit holds, their order, shapes, and the
padding FSDP put between them. Those come from the model ``config.json`` describes, built on the
meta device (:func:`~...convert.hub_layout.meta_model`), as FSDP1 builds a flat parameter
(``FlatParamHandle._init_flat_param_and_metadata``): the unit module's ``named_modules`` in order,
each module's own parameters, those under a nested unit left to it, a tied parameter once (its
first name). With ``use_orig_params=True`` FSDP pads each parameter to an address alignment of 16
bytes of the *compute* dtype (a ``MixedPrecision`` ``param_dtype`` the file does not record) and
the whole to a multiple of the world size; the file then also holds each parameter's 1-D view of
this rank's shard under its own name, sharing the flat parameter's storage.

Every candidate alignment (none, 2, 4, 8, 16 elements) is laid out; the candidates whose total is
the recorded count and which put every recorded view at its place in the shard (element count
and storage offset) are kept. One layout left (several candidates giving the same offsets count
as one): it is used. None: refused (the config is not the model's, or the wrapping moved
parameters). Several: refused, naming what the file lacks.
"""

import math
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from ...errors import CheckpointError, LayoutError, one_line, short_repr
from ...formats import torch_files
from ...plan import Chunk, TensorPlan, check_tiling, narrow_pieces, row_major_pieces
from .placement import box_pieces
from .stand_ins import ALLOWED, ShardedRef

if TYPE_CHECKING:
    import torch

    from ..protocol import PlanContext

__all__ = ["FLAT", "is_flat_param", "unit_params", "layouts", "plan_tensors"]

FLAT = "_flat_param"
_ALIGNMENTS = (0, 2, 4, 8, 16)  # 16 bytes of a 8-, 4-, 2- or 1-byte compute dtype; 0: use_orig_params=False


def is_flat_param(name: Any, value: Any) -> bool:
    return isinstance(value, ShardedRef) and type(name) is str and (name == FLAT or name.endswith("." + FLAT))


def unit_params(model: "torch.nn.Module", units: List[str], where: str
                ) -> Tuple[Dict[str, List[Tuple[str, tuple]]], Dict[str, str], List[Tuple[str, tuple]]]:
    """``({unit: [(name, shape)] in flat order}, {tied alias: name}, [(name, shape)] in no unit)`` of the
    meta ``model``: each unit module's ``named_modules(remove_duplicate=False)``, the parameters each
    module registers itself, modules under a nested unit skipped, a parameter seen before in the unit
    an alias of its first name (what FSDP1 flattens, in its order)."""
    owner: Dict[int, str] = {}
    out, aliases = {}, {}
    first_name: Dict[int, str] = {}
    for unit in units:
        try:
            module = model.get_submodule(unit) if unit else model
        except AttributeError:
            raise LayoutError(f"{where}: holds the flat parameter of an FSDP unit at {one_line(unit[:200])!r}, which is "
                              f"not a module of the {type(model).__name__} config.json describes; pass --config the "
                              "directory of the trained model's config.json") from None
        nested = [u for u in units if u != unit and (not unit or u.startswith(unit + "."))]
        params = []
        for path, sub in module.named_modules(remove_duplicate=False, prefix=unit):
            if any(path == u or path.startswith(u + ".") for u in nested):
                continue
            for pname, p in sub._parameters.items():
                if p is None:
                    continue
                name = f"{path}.{pname}" if path else pname
                if id(p) in owner and owner[id(p)] != unit:
                    raise LayoutError(f"{where}: {name} is tied to {first_name[id(p)]}, which another FSDP unit "
                                      "holds; flat parameters of weights tied across units are not read: save with "
                                      "SHARDED_STATE_DICT or FULL_STATE_DICT")
                if id(p) in owner:
                    aliases[name] = first_name[id(p)]
                    continue
                owner[id(p)], first_name[id(p)] = unit, name
                params.append((name, tuple(p.shape)))
        out[unit] = params
    loose = [(n, tuple(p.shape)) for n, p in model.named_parameters() if id(p) not in owner]
    return out, aliases, loose


def layouts(numels: List[int], world: int, total: int) -> Dict[tuple, List[int]]:
    """``{start offsets: [alignments giving them]}`` of the candidate layouts whose element count
    (alignment padding before each parameter, the whole padded to a multiple of ``world``) is ``total``."""
    found: Dict[tuple, List[int]] = {}
    for align in _ALIGNMENTS:
        starts, at = [], 0
        for n in numels:
            if align and at % align:
                at += align - at % align
            starts.append(at)
            at += n
        if align and at % world:
            at += world - at % world
        if at == total:
            found.setdefault(tuple(starts), []).append(align)
    return found


def _shard(ref: ShardedRef, name: str, path: str,
           rank: int) -> Tuple[int, str, Optional[Tuple[int, int, torch_files.TensorRef]]]:
    """``(element count, dtype, (offset, size, local tensor) or None)`` of one rank's flat parameter."""
    shape = ref.shape
    if type(shape) not in (tuple, list) or len(shape) != 1 or type(shape[0]) is not int or shape[0] < 0:
        raise LayoutError(f"{path}: flat parameter {name} has size {short_repr(shape)}, not one element count; the "
                          "file is corrupt")
    if type(ref.shards) is not list or len(ref.shards) > 1:
        raise LayoutError(f"{path}: flat parameter {name} holds {short_repr(ref.shards)} as its local shards; FSDP "
                          "saves at most one per rank: the file is corrupt")
    if not ref.shards:
        return shape[0], str(ref.dtype), None
    s = ref.shards[0]
    t, md = s.field("tensor"), s.field("metadata")
    off: Any = md.field("shard_offsets") if md is not None and hasattr(md, "field") else None
    size: Any = md.field("shard_sizes") if md is not None and hasattr(md, "field") else None
    if not isinstance(t, torch_files.TensorRef) or type(off) not in (list, tuple) or type(size) not in (list, tuple) \
            or len(off) != 1 or len(size) != 1 or t.shape != (size[0],) or t.dtype != str(ref.dtype) \
            or type(off[0]) is not int or off[0] < 0 or off[0] + size[0] > shape[0]:
        raise LayoutError(f"{path}: the local shard of flat parameter {name} ({short_repr(s)}) is not a 1-D piece of "
                          f"its {shape[0]} elements; the file is corrupt or crafted")
    return shape[0], str(ref.dtype), (off[0], size[0], t)


def plan_tensors(model: "torch.nn.Module", files: List[str], states: List[dict],
                 where: str) -> Tuple[List[TensorPlan], Dict[str, Any], Set[str]]:
    """The parameters of every flat parameter of ``states`` (each rank's loaded state dict), split
    as FSDP1 laid them out: ``(tensors, facts, names consumed)`` (the flat parameters and the
    parameters' views; the caller reads every other entry as a plain tensor)."""
    world = len(files)
    keys = [k for k, v in states[0].items() if is_flat_param(k, v)]
    for path, sd in zip(files[1:], states[1:]):
        odd = sorted(set(keys) ^ {k for k, v in sd.items() if is_flat_param(k, v)})
        if odd:
            raise LayoutError(f"{path}: flat parameter {one_line(odd[0][:200])} is in this file or rank 0's only; files "
                              "of different saves are mixed: copy the checkpoint again")
    units = [k[: -len(FLAT)].rstrip(".") for k in keys]
    params, aliases, loose = unit_params(model, units, where)
    out: List[TensorPlan] = []
    consumed: Set[str] = set()
    aligns: Set[int] = set()
    with_views = False
    for unit in units:
        key = f"{unit}.{FLAT}" if unit else FLAT
        shown = one_line(key[:200])
        names = [n for n, _ in params[unit]]
        numels = [math.prod(s) for _, s in params[unit]]
        shards = []
        for r, (path, sd) in enumerate(zip(files, states)):
            if not is_flat_param(key, sd.get(key)):
                raise LayoutError(f"{path}: holds no flat parameter {shown} (rank 0's file does); files of different "
                                  "saves are mixed: copy the checkpoint again")
            shards.append(_shard(sd[key], shown, path, r))
        total, dtype = shards[0][:2]
        for r, (n, d, _) in enumerate(shards):
            if (n, d) != (total, dtype):
                raise LayoutError(f"{files[r]}: flat parameter {shown} is {d} of {n} elements, in rank 0's file {dtype} "
                                  f"of {total}; files of different saves are mixed: copy the checkpoint again")
        chunks = [Chunk(tuple(box_pieces(s[2], (0,), (s[1],))), (s[0],), (s[1],))
                  for _, _, s in shards if s and s[1]]
        try:
            check_tiling((total,), chunks)
        except ValueError as e:
            raise LayoutError(f"{where}: the shards of flat parameter {shown} do not tile its {total} elements ({e}); a "
                              "rank's file is missing, duplicated or from another save: copy the checkpoint again") \
                from None
        flat = row_major_pieces((total,), chunks)
        assert flat is not None  # 1-D chunks tiling the tensor are always laid end to end
        found = layouts(numels, world, total)
        views = _views(states, names + [a for a, p in aliases.items() if p in names])
        consumed.update(views)
        with_views |= bool(views)
        consumed.add(key)
        if views:
            found = {starts: al for starts, al in found.items()
                     if _views_fit(starts, names, numels, aliases, shards, states, views)}
        if len(found) != 1:
            desc = ", ".join(f"{n} {list(s)}" for n, s in params[unit][:4]) + (", ..." if len(names) > 4 else "")
            if not found:
                raise LayoutError(f"{where}: flat parameter {shown} holds {total} elements, which no FSDP layout of the "
                                  f"parameters the config's model has in that unit ({len(names)}: {desc}; "
                                  f"{sum(numels)} elements) gives; the config is not the trained model's, or the "
                                  "model was changed before FSDP wrapped it: pass --config the model's own config")
            raise LayoutError(f"{where}: flat parameter {shown} fits several layouts (alignment padding of "
                              f"{' or '.join(str(a[0]) for a in found.values())} elements between parameters), and "
                              "the file records neither use_orig_params nor the compute dtype that decides it; save "
                              "with SHARDED_STATE_DICT (use_dcp=True or False) or FULL_STATE_DICT")
        (starts, al), = found.items()
        aligns.update(al)
        for (name, shape), start, n in zip(params[unit], starts, numels):
            out.append(TensorPlan(name, shape, dtype, [narrow_pieces(flat, start, n)], kind="module"))
    missing = [n for n, _ in loose if n not in states[0] and n not in aliases]
    if missing:
        raise LayoutError(f"{where}: {one_line(missing[0][:200])} ({len(missing)} parameter(s) of the config's model) is "
                          "in no flat parameter of the files and not saved whole; the config is not the trained "
                          "model's: pass --config the model's own config")
    facts = {"units": len(units), "alignment": sorted(aligns), "views": with_views}
    return out, facts, consumed


def _views(states: List[dict], names: List[str]) -> Set[str]:
    """The parameter names every rank's file holds a plain tensor under: use_orig_params' 1-D views."""
    held = [n for n in names if isinstance(states[0].get(n), torch_files.TensorRef)]
    return set(held)


def _views_fit(starts: Tuple[int, ...], names: List[str], numels: List[int], aliases: Dict[str, str],
               shards: List[Tuple[int, str, Optional[Tuple[int, int, torch_files.TensorRef]]]], states: List[dict],
               views: Set[str]) -> bool:
    """Whether every rank's view of every parameter is the piece of its shard this layout gives: its
    element count, and its offset into the flat parameter's storage where they share one."""
    primary = {n: (s, k) for n, s, k in zip(names, starts, numels)}
    for v in views:
        start, n = primary[aliases.get(v, v)]
        for sd, shard in zip(states, shards):
            ref = sd.get(v)
            if not isinstance(ref, torch_files.TensorRef) or len(ref.shape) != 1:
                return False
            lo, hi, local = (shard[2][0], shard[2][0] + shard[2][1], shard[2][2]) if shard[2] else (0, 0, None)
            a, b = max(start, lo), min(start + n, hi)
            if ref.numel != max(0, b - a):
                return False
            if ref.numel and local is not None and ref.storage.key == local.storage.key and \
                    ref.storage_offset - local.storage_offset != a - lo:
                return False
    return True


def load_states(files: List[str]) -> List[dict]:
    states = []
    for path in files:
        sd = torch_files.load(path, allowed=ALLOWED)
        if not isinstance(sd, dict) or not all(type(k) is str for k in sd):
            raise LayoutError(f"{path}: holds {type(sd).__name__}, not a state dict of names; pass the model's rank files")
        states.append(sd)
    return states


def meta_model_for(ctx: "PlanContext", where: str) -> "torch.nn.Module":
    """The model ``ctx``'s config describes, on the meta device; refused without one."""
    from ...convert.hub_layout import meta_model

    if ctx.config_dir is None:
        raise CheckpointError(f"{where}: an FSDP1 LOCAL_STATE_DICT save (flat parameters per rank) is split by the "
                              "model's parameter shapes; pass --config a directory holding the model's config.json")
    model = meta_model(ctx.config_dir, cfg=ctx.config)
    if model is None:
        raise CheckpointError(f"{os.path.join(ctx.config_dir, 'config.json')}: transformers cannot build the model it "
                              "describes (model_type unknown to this install, or transformers missing), and only that "
                              "model's parameter shapes split the flat parameters of an FSDP1 LOCAL_STATE_DICT save")
    return model
