"""The Hub layout: the tensor names and splits ``save_pretrained`` writes, from the in-memory ones.

transformers 5 fuses some weights in memory (MoE experts: ``mlp.experts.gate_up_proj`` [E, 2I, H])
and converts them back on save (``revert_weight_conversion`` in ``transformers/core_model_loading.py``,
called by ``PreTrainedModel.save_pretrained``): Mixtral's experts become
``block_sparse_moe.experts.N.w1/w2/w3.weight``, Qwen2-MoE's ``mlp.experts.N.{gate,up,down}_proj.weight``.
A checkpoint (DeepSpeed names its parameters as the model does in memory) or a live model holds
the fused names, so every export path converts them here, with transformers' own machinery:

1. a model of the checkpoint's family is built on the meta device from its config
   (:func:`meta_model`: ``model_type``/``architectures`` choose the conversion mapping, no table here);
2. ``revert_weight_conversion`` runs on meta tensors with the recorded names and shapes, with
   ``Tensor.contiguous`` made a no-op, so every output stays a *view* of the input it came from:
   its storage offset and strides say which elements of which source tensor it holds;
3. an output that is a contiguous view of one source is element range ``[a, a + numel)`` of that
   source's flat tensor (a split along the leading dims: expert N, gate or up half), so the copy
   path stays a byte-range copy. Any other result (a transpose, a concatenation of several sources,
   a new tensor) is refused with the tensor and the model type named: a layout that only one
   transformers version reads is never written.

On transformers 4.x (no ``revert_weight_conversion``) the layout is the identity.
"""

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Type, Union

from ..errors import LayoutError

from ..formats.config import transformers_major  # re-exported: the hooks and tests ask here
from .answer_cache import cache_key, read_answer, write_answer

if TYPE_CHECKING:
    from types import ModuleType

    import torch
    from torch.overrides import TorchFunctionMode
    from transformers import PretrainedConfig, PreTrainedModel

    from ..plan import ExportPlan

__all__ = ["HubTensor", "meta_model", "transformers_major", "hub_layout", "describe_conversions", "convert_plan",
           "live_layout",
           "tied_renames"]


@dataclass(frozen=True)
class HubTensor:
    """Output tensor ``name`` = elements ``[offset, offset + numel(shape))`` of source ``source``'s
    flat (row-major) tensor, viewed as ``shape``. ``offset == 0`` and the source's shape: a rename
    or the identity."""

    name: str
    source: str
    shape: Tuple[int, ...]
    offset: int = 0


def _builders(cfg: "PretrainedConfig", model_class: Optional[Type["PreTrainedModel"]]
              ) -> Iterator[Callable[["PretrainedConfig"], "torch.nn.Module"]]:
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    if model_class is not None:
        yield model_class._from_config
    for arch in getattr(cfg, "architectures", None) or ():
        cls = getattr(transformers, str(arch), None)
        if cls is not None and hasattr(cls, "_from_config"):
            yield cls._from_config
    yield from (AutoModelForCausalLM.from_config, AutoModelForSeq2SeqLM.from_config)
    auto_vlm = getattr(transformers, "AutoModelForImageTextToText", None)  # Llava, Qwen2-VL: text_config nested
    if auto_vlm is not None:
        yield auto_vlm.from_config
    yield AutoModel.from_config


def meta_model(config: Union[str, "PretrainedConfig"], model_class: Optional[Type["PreTrainedModel"]] = None, *,
               cfg: Optional[dict] = None) -> Optional["torch.nn.Module"]:
    """A model of ``config``'s family (a config object, or a directory holding config.json) on the
    meta device: ``model_class`` when given (a live model's own class), else the class
    ``architectures`` names (what ``save_pretrained`` recorded), else the first Auto class that maps
    the config. None without transformers, or for a config directory whose ``model_type``
    transformers does not know: code named by ``auto_map`` is never imported. CheckpointError for a
    config.json that is not a JSON object or that transformers cannot build a model from.
    ``cfg``: that config.json, already read (an export's :class:`~.protocol.PlanContext` reads it once)."""
    try:
        import torch
        import transformers.modeling_utils as modeling_utils
        from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig
    except ImportError:
        return None
    if isinstance(config, PretrainedConfig):
        return _meta_model(config, model_class, torch, modeling_utils)
    from ..errors import CheckpointError
    from ..guards import read_config

    model_type = (cfg if cfg is not None else read_config(config)).get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return None
    try:
        cfg = AutoConfig.from_pretrained(config, trust_remote_code=False)
        return _meta_model(cfg, model_class, torch, modeling_utils)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, OSError) as e:
        raise CheckpointError(f"{config}/config.json: transformers cannot build the {model_type!r} model it "
                              f"describes ({type(e).__name__}: {str(e)[:200]}); fix it, pass --config a directory "
                              "holding the model's config.json, or describe the merge with --tp-rule") from e


def _meta_model(cfg: "PretrainedConfig", model_class: Optional[Type["PreTrainedModel"]], torch: "ModuleType",
                modeling_utils: "ModuleType") -> "torch.nn.Module":
    # Inside a live ZeRO-3 run (a save-time hook) from_config would build the model under
    # deepspeed.zero.Init and initialise it there, which fails on the meta device; transformers'
    # own "zero.Init already entered" flag makes it build a plain (meta) model.
    not_zero3 = getattr(modeling_utils, "set_zero3_state", contextlib.nullcontext)
    error: Optional[ValueError] = None
    for build in _builders(cfg, model_class):
        with torch.device("meta"), not_zero3():
            try:
                return build(cfg)
            except ValueError as e:  # this Auto class does not map the config
                error = e
    assert error is not None  # _builders yields AutoModel.from_config last: one build ran and failed
    raise error


def _keep_views() -> "TorchFunctionMode":
    """A ``TorchFunctionMode`` in which ``Tensor.contiguous`` returns its input: the conversion ops'
    copies would otherwise hide which source elements an output holds. Values are unchanged."""
    import torch
    from torch.overrides import TorchFunctionMode

    class KeepViews(TorchFunctionMode):
        def __torch_function__(self, func: Callable[..., Any], types: Any, args: Tuple[Any, ...] = (),
                               kwargs: Optional[Dict[str, Any]] = None) -> Any:
            if func is torch.Tensor.contiguous:
                return args[0]
            return func(*args, **(kwargs or {}))

    return KeepViews()


def _revert() -> Optional[Callable[..., Any]]:
    if (transformers_major() or 0) < 5:  # 4.x fuses nothing in memory: the layout is the identity
        return None
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: no in-memory fusion, the layout is the identity
        return None
    return revert_weight_conversion


def tied_renames(model: Optional["torch.nn.Module"], aliases: Dict[str, str]) -> Dict[str, str]:
    """``{stored: name}`` for tied groups (``aliases``: tied name -> stored name) where
    ``save_pretrained`` keeps another name than the one stored (``remove_tied_weights_from_state_dict``
    of transformers 5, asked on the meta model); empty where they agree or transformers has no such rule."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        return {}
    if not aliases or model is None:
        return {}
    kept = set(remove_tied_weights_from_state_dict(dict(model.state_dict()), model))
    renames = {}
    for alias, stored in aliases.items():
        if stored not in kept and alias in kept:
            renames[stored] = alias
    return renames


def hub_layout(shapes: Dict[str, Tuple[int, ...]], model: Optional["torch.nn.Module"]) -> Optional[List[HubTensor]]:
    """The tensors ``save_pretrained`` of ``model`` writes for a state dict with these names and
    shapes (tied aliases already removed), in its order; None when it writes them unchanged.

    ``model``: a meta model (:func:`meta_model`) or the live model itself (its config and its
    ``_weight_conversions`` from ``from_pretrained`` drive the conversion). Raises
    :class:`LayoutError` naming the tensor and the model type where an output is not a slice along
    the leading dims of one source tensor.
    """
    revert = _revert()
    if revert is None or model is None or not shapes:
        return None
    import torch

    sources = {n: torch.empty(tuple(s), device="meta") for n, s in shapes.items()}
    roots = {id(t): n for n, t in sources.items()}
    with torch.no_grad(), _keep_views():
        out = revert(model, dict(sources))
    if list(out) == list(sources) and all(out[n] is sources[n] for n in sources):
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    result = []
    for name, t in out.items():
        base = t if id(t) in roots else t._base
        src = roots.get(id(base)) if base is not None else None
        if src is None or not t.is_contiguous():
            from_ = f"a view of {src} with strides {tuple(t.stride())}" if src else "a new tensor (concatenated?)"
            raise LayoutError(
                f"{name}: transformers' save_pretrained for model type {model_type!r} writes it as {from_}, "
                "not as a slice along the leading dims of one trained tensor; hf_ckpt_integrations does not "
                "convert this layout and refuses rather than write names only one transformers version loads: "
                "load the checkpoint in transformers and call save_pretrained, or report the model type")
        result.append(HubTensor(name, src, tuple(t.shape), t.storage_offset()))
    _check_tiling(result, shapes, model_type)
    return result


def _check_tiling(layout: Sequence[HubTensor], shapes: Dict[str, Tuple[int, ...]], model_type: Optional[str]) -> None:
    """Each trained tensor is written exactly once: its slices tile it, no element dropped or doubled."""
    spans: Dict[str, List[Tuple[int, int]]] = {}
    for h in layout:
        spans.setdefault(h.source, []).append((h.offset, h.offset + math.prod(h.shape)))
    if set(spans) - set(shapes):
        raise LayoutError(f"{sorted(set(spans) - set(shapes))[:3]}: not tensors of the checkpoint; refused")
    for src, shape in shapes.items():
        covered = sorted(spans.get(src, []))
        ends = [0] + [b for _, b in covered]
        if [a for a, _ in covered] != ends[:-1] or ends[-1] != math.prod(shape):
            raise LayoutError(f"{src}: transformers' save_pretrained for model type {model_type!r} does not write "
                              f"it exactly once (slices {covered} of {math.prod(shape)} elements); refused: "
                              "report the model type")


def describe_conversions(layout: Optional[Sequence[HubTensor]], shapes: Dict[str, Tuple[int, ...]]) -> List[dict]:
    """Per source tensor that is split or renamed: ``{"source", "shape", "into": [names], "op"}``
    (what ``inspect`` prints)."""
    if not layout:
        return []
    groups: Dict[str, List[HubTensor]] = {}
    for h in layout:
        groups.setdefault(h.source, []).append(h)
    out = []
    for src, hs in groups.items():
        if len(hs) == 1 and hs[0].name == src:
            continue
        whole = len(hs) == 1 and hs[0].offset == 0 and math.prod(hs[0].shape) == math.prod(shapes[src])
        out.append({"source": src, "shape": list(shapes[src]), "into": [h.name for h in hs],
                    "op": "rename" if whole else f"split into {len(hs)} leading-dim slices"})
    return out


def _model_for(config_dir: str, model_type: Optional[str], cfg: Optional[dict] = None) -> Optional["torch.nn.Module"]:
    """:func:`meta_model`, or None where it cannot be built and transformers registers no conversion
    for ``model_type`` (custom code: written as trained is then what save_pretrained writes)."""
    try:
        return meta_model(config_dir, cfg=cfg)
    except Exception as e:  # an unknown model type, remote code, a config this transformers rejects
        try:
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        except ImportError:
            return None
        if model_type is None or get_checkpoint_conversion_mapping(model_type) is None:
            return None
        raise LayoutError(f"{config_dir}/config.json: transformers registers a save-time conversion for model type "
                          f"{model_type!r} but cannot build the model from this config ({type(e).__name__}: {e}); "
                          "fix the config or pass --config with one transformers loads") from None


# Bump when what a cache entry holds (or how it is derived) changes.
_LAYOUT_CACHE_FORMAT = 3  # 3: written only for a config.json that fits the tensors, key and digest inside


def _layout_cache_key(cfg: dict, shapes: Dict[str, Tuple[int, ...]], aliases: Dict[str, str]) -> str:
    """Everything the answer depends on: the cache format, the config, the names and shapes, the tied
    names (:func:`~.answer_cache.cache_key` adds the releases)."""
    return cache_key("hub-layout", [_LAYOUT_CACHE_FORMAT, cfg, [[n, list(s)] for n, s in shapes.items()],
                                    sorted(aliases.items())])


def _read_cached(key: str, shapes: Mapping[str, Tuple[int, ...]], aliases: Mapping[str, str]) -> Optional[dict]:
    """The answer cached under ``key`` (:func:`~.answer_cache.read_answer`), or None (then it is
    derived again) when absent, not ours, malformed in any way, or not exactly what :func:`_derive`
    writes. A bad entry is a miss, never an error: the cache is a speed-up, never an authority."""
    answer: Any = read_answer("hub-layout", key)  # whatever JSON the file holds: checked below
    try:
        renames, layout, note = answer["renames"], answer["layout"], answer["note"]
        missing = answer.get("missing", [])
        ok = (isinstance(missing, list) and all(isinstance(m, str) for m in missing)
              and isinstance(renames, dict) and all(k in shapes and isinstance(v, str) and aliases.get(v) == k
                                                    for k, v in renames.items())
              and (note is None or isinstance(note, str))
              and (layout is None or (isinstance(layout, list) and all(
                  isinstance(h, list) and len(h) == 4 and isinstance(h[0], str) and isinstance(h[1], str)
                  and isinstance(h[2], list) and all(type(d) is int and d >= 0 for d in h[2])
                  and type(h[3]) is int and h[3] >= 0 for h in layout))))
        if ok and layout is not None:  # it must still tile every tensor exactly once
            renamed = {renames.get(n, n): sh for n, sh in shapes.items()}
            _check_tiling([HubTensor(h[0], h[1], tuple(h[2]), h[3]) for h in layout], renamed, None)
        return answer if ok else None
    except Exception:  # None, a wrong type anywhere, LayoutError: a miss
        return None


def _write_cached(key: str, answer: dict) -> None:
    write_answer("hub-layout", key, answer)


def _derive(config_dir: str, model_type: Optional[str], shapes: Dict[str, Tuple[int, ...]], aliases: Dict[str, str],
            cfg: Optional[dict] = None) -> dict:
    """Ask transformers (a meta model of the config's family): ``{"renames": {stored: kept name},
    "layout": [[name, source, shape, offset], ...] or None (unchanged), "note": str or None}``.
    Raises :class:`LayoutError` for a conversion that is refused."""
    from .config_fit import bounded_build, check_fits

    with bounded_build(config_dir, shapes, cfg):  # a config.json far larger than the checkpoint is refused, not built
        model = _model_for(config_dir, model_type, cfg)
    if model is None:
        return {"renames": {}, "layout": None,
                "note": f"config.json's model (type {model_type!r}) cannot be built by the installed transformers "
                        "and has no registered save-time conversion: names written as trained"}
    renames = tied_renames(model, aliases)
    shapes = {renames.get(n, n): s for n, s in shapes.items()}
    missing = check_fits(model, shapes, config_dir)  # so a cached entry also says config.json fits these tensors
    layout = hub_layout(shapes, model)
    return {"renames": renames, "note": None, "missing": missing,
            "layout": None if layout is None else [[h.name, h.source, list(h.shape), h.offset] for h in layout]}


def convert_plan(plan: "ExportPlan", cfg: dict, *, use_cache: bool = True) -> None:
    """Rewrite ``plan.tensors`` (already without tied aliases) into the Hub layout in place: renamed,
    fused tensors split into byte ranges (:meth:`~..plan.TensorPlan.narrowed`), in save_pretrained's
    order; ``plan.conversions`` says what was done. Needs ``plan.config_dir`` and ``cfg``, its
    config.json (read once per export, :class:`~.protocol.PlanContext`). The answer transformers
    gives is cached (:func:`_read_cached`, :func:`_write_cached`) unless ``use_cache`` is false
    (``verify`` derives it afresh, so a wrong entry can never make it agree with an export)."""
    import dataclasses

    if plan.config_dir is None or (transformers_major() or 0) < 5:
        return
    model_type = cfg.get("model_type")
    shapes = {t.name: tuple(t.shape) for t in plan.tensors}
    key = _layout_cache_key(cfg, shapes, plan.aliases)
    entry = _read_cached(key, shapes, plan.aliases) if use_cache else None
    if entry is None:
        entry = _derive(plan.config_dir, model_type, shapes, plan.aliases, cfg)
        if use_cache:
            _write_cached(key, entry)
    if entry["note"]:
        plan.notes.append(entry["note"])
    if entry.get("missing"):  # config.json's model has tensors the checkpoint does not hold
        plan.detail["missing_tensors"] = sorted(set(plan.detail.get("missing_tensors", [])) | set(entry["missing"]))
    renames = entry["renames"]
    if renames:  # the tied group written under the name save_pretrained keeps
        plan.tensors = [dataclasses.replace(t, name=renames[t.name]) if t.name in renames else t for t in plan.tensors]
        plan.aliases = {(s if a == renames.get(s) else a): renames.get(s, s) for a, s in plan.aliases.items()}
        plan.notes.append("tied weights written under the names save_pretrained keeps: "
                          + ", ".join(f"{a} (stored as {s})" for s, a in renames.items()))
    if entry["layout"] is None:
        return
    shapes = {t.name: tuple(t.shape) for t in plan.tensors}
    layout = [HubTensor(n, src, tuple(shape), offset) for n, src, shape, offset in entry["layout"]]
    by_name = {t.name: t for t in plan.tensors}
    tensors = []
    for h in layout:
        t = by_name[h.source]
        if h.offset == 0 and h.shape == tuple(t.shape):
            tensors.append(t if h.name == t.name else dataclasses.replace(t, name=h.name, hub_source=t.name))
        else:
            tensors.append(t.narrowed(h.name, h.shape, h.offset))
    plan.conversions = describe_conversions(layout, shapes)
    renamed = {h.source: h.name for h in layout if h.offset == 0 and h.shape == shapes[h.source]}
    plan.aliases = {renamed.get(a, a): renamed.get(s, s) for a, s in plan.aliases.items()}
    plan.tensors = tensors


def live_layout(module: "torch.nn.Module", shapes: Dict[str, Tuple[int, ...]], aliases: Optional[Dict[str, str]] = None
                ) -> List[Tuple[str, str, Tuple[int, ...], int]]:
    """``[(name, source, shape, offset)]`` to write for a live ``module`` whose (untied) state dict
    has these names and full shapes (``aliases``: tied name -> the name kept in ``shapes``):
    :func:`tied_renames` and :func:`hub_layout` of a meta copy of ``module``'s class (with the
    ``_weight_conversions`` ``from_pretrained`` attached, as ``save_pretrained`` uses them), or the
    identity for a module transformers does not convert."""
    identity = [(n, n, tuple(s), 0) for n, s in shapes.items()]
    config = getattr(module, "config", None)
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return identity
    if _revert() is None or config is None or not isinstance(module, PreTrainedModel):
        return identity
    import copy

    model = meta_model(copy.deepcopy(config), type(module))
    assert model is not None  # from a PretrainedConfig (the module's own) meta_model builds or raises
    conversions = getattr(module, "_weight_conversions", None)
    if conversions is not None:
        model._weight_conversions = conversions
    renames = tied_renames(model, aliases or {})
    back = {new: old for old, new in renames.items()}
    layout = hub_layout({renames.get(n, n): s for n, s in shapes.items()}, model)
    if layout is None:
        return [(renames.get(n, n), n, s, o) for n, _, s, o in identity]
    return [(h.name, back.get(h.source, h.source), h.shape, h.offset) for h in layout]
