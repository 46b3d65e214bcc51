"""``--merge-adapters``: a LoRA adapter merged into its base model, written in the base's Hub layout.

For every base weight a LoRA module targets, ``W' = W + scale * (B @ A)`` (transposed for
``Conv1D`` layers and for embeddings, as peft's layers decide per layer), computed in
fp32 one tensor at a time when the writer asks for it, then cast to the output dtype (the base's
dtype unless ``dtype`` says otherwise). ``scale`` is ``lora_alpha / r`` (``/ sqrt(r)`` with
``use_rslora``), per module from ``rank_pattern``/``alpha_pattern``. A ``modules_to_save`` copy
replaces the base tensor of the same name. Every other base tensor is copied byte for byte
through the base's plan. Only LoRA merges; DoRA, LoRA biases, convolution adapters and the
other peft methods are refused before anything is written.
"""

import math
import os
import re
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from .errors import LayoutError, OptionError

if TYPE_CHECKING:
    from .plan import ExportPlan, TensorPlan
    from .writer import OutTensor

__all__ = ["write_merged", "lora_scale", "resolve_base"]

_PREFIX = "base_model.model."
_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_LORA = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.weight)?$")


def _scale(cfg: dict, module: str, path: str) -> Tuple[int, float, str]:
    """``(r, scale, field)`` of LoRA module ``module`` as peft's ``LoraModel._create_and_replace``
    derives them: ``rank_pattern``/``alpha_pattern`` through ``get_pattern_key`` (the first key,
    in order, matching the end of the name), else ``r``/``lora_alpha``; ``field`` names where alpha came from."""
    from .sources.peft import check_lora_config, pattern_key

    check_lora_config({**cfg, "peft_type": "LORA"}, path)
    rank_patterns, alpha_patterns = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    r_key = pattern_key(list(rank_patterns), module, path, "rank_pattern")
    a_key = pattern_key(list(alpha_patterns), module, path, "alpha_pattern")
    r = rank_patterns[r_key] if r_key is not None else cfg["r"]
    alpha = alpha_patterns[a_key] if a_key is not None else cfg["lora_alpha"]
    field = f"alpha_pattern[{a_key!r}]" if a_key is not None else "lora_alpha"
    return r, (alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r), field


def lora_scale(cfg: dict, module: str, path: str = "adapter_config.json") -> Tuple[int, float]:
    """``(r, scale)`` of LoRA module ``module`` (its name in the base model) under adapter config ``cfg``
    (CheckpointError naming ``path`` and the field for a value peft could not use)."""
    r, scale, _ = _scale(cfg, module, path)
    return r, scale


def _refuse_unmergeable(cfg: dict, path: str) -> None:
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise OptionError(f"{path}: a {kind} adapter; --merge-adapters merges LoRA adapters only: export the "
                          "adapter directory (without --merge-adapters) and merge it with peft")
    for key, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA bias"), ("target_parameters", "target_parameters"),
                      ("layer_replication", "layer_replication"), ("trainable_token_indices", "trainable tokens")):
        if cfg.get(key):
            raise OptionError(f"{path}: a {what} adapter; --merge-adapters merges plain LoRA only: export the "
                              "adapter directory (without --merge-adapters) and merge it with peft")


def resolve_base(adapter: dict, base: Optional[str]) -> str:
    """The base model directory: ``base``, else the adapter config's ``base_model_name_or_path``
    when it is a local directory."""
    if base is not None:
        if not os.path.isdir(base):
            raise OptionError(f"{base}: --base must be the base model's directory (save_pretrained output)")
        return os.fspath(base)
    named = adapter.get("base_model_name_or_path")
    if isinstance(named, str) and named and os.path.isdir(named):
        return named
    raise OptionError(f"{adapter['config']}: base_model_name_or_path {str(named)[:80]!r} is not a local directory; "
                      "pass --base DIR holding the base model (its config.json and safetensors)")


def _group(adapter_plan: "ExportPlan", cfg_path: str
           ) -> Tuple[Dict[str, Dict[str, "TensorPlan"]], Dict[str, "TensorPlan"]]:
    """``(lora, replaced)``: base module name -> {kind: TensorPlan} for LoRA pairs; base tensor name
    -> TensorPlan for ``modules_to_save`` copies."""
    lora: Dict[str, Dict[str, "TensorPlan"]] = {}
    replaced: Dict[str, "TensorPlan"] = {}
    for t in adapter_plan.tensors:
        if not t.name.startswith(_PREFIX):
            raise LayoutError(f"{cfg_path}: adapter tensor {t.name} is not under {_PREFIX!r}; --merge-adapters "
                              "supports adapters of PeftModel (task models), not of a bare LoraModel")
        name = t.name[len(_PREFIX):]
        m = _LORA.match(name)
        if m:
            lora.setdefault(m.group("module"), {})[m.group("kind")] = t
        elif ".lora_" in f".{name}":
            raise OptionError(f"{cfg_path}: adapter tensor {t.name} is not a plain LoRA weight; --merge-adapters "
                              "merges plain LoRA only: export the adapter directory and merge it with peft")
        else:
            replaced[name] = t
    for module, parts in lora.items():
        if len(parts) != 2 or not ({"lora_A", "lora_B"} == set(parts) or
                                   {"lora_embedding_A", "lora_embedding_B"} == set(parts)):
            raise LayoutError(f"{cfg_path}: LoRA module {module} has {sorted(parts)}; both A and B are needed to "
                              "merge: the checkpoint is incomplete")
    return lora, replaced


def _layer_kinds(base_plan: "ExportPlan", base_dir: str, modules: List[str]) -> Dict[str, Optional[str]]:
    """``{module: "linear" | "conv1d" | "embedding" | <other class name> | None}``: the class of each
    LoRA module in the base model, from config.json's model built on the meta device (bounded by the
    base's tensors, as the Hub-layout pass bounds its build); None where no model can be built from
    config.json or it has no such module."""
    from .errors import CheckpointError
    from .convert.config_fit import bounded_build
    from .convert.hub_layout import meta_model

    kinds: Dict[str, Optional[str]] = dict.fromkeys(modules)
    if base_plan.config_dir is None:
        return kinds
    with bounded_build(base_plan.config_dir, {t.name: tuple(t.shape) for t in base_plan.tensors}):
        try:
            model = meta_model(base_plan.config_dir)
        except CheckpointError:  # transformers cannot build it: the shapes decide (see _plan_merges)
            model = None
    if model is None:
        return kinds
    import torch

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        Conv1D = ()
    for module in modules:
        try:
            layer = model.get_submodule(module)
        except AttributeError:
            continue
        kinds[module] = ("embedding" if isinstance(layer, torch.nn.Embedding) else
                         "linear" if isinstance(layer, torch.nn.Linear) else
                         "conv1d" if Conv1D and isinstance(layer, Conv1D) else type(layer).__name__)
    return kinds


def _plan_merges(cfg: dict, cfg_path: str, targets: Dict[str, Tuple[str, Dict[str, "TensorPlan"]]],
                 base_by_name: Dict[str, "TensorPlan"], base_plan: "ExportPlan",
                 base_dir: str) -> Dict[str, Tuple[int, float, str, bool]]:
    """``{module: (r, scale, alpha field, transpose)}`` for every LoRA module, checked before anything
    is written: selected by ``target_modules`` as peft selects modules, A [r, in] and B [out, r] for
    the rank peft would give it, and the update oriented as peft's layer for that module orients it.

    peft decides ``fan_in_fan_out`` per layer, whatever the config says (``dispatch_default`` in
    ``peft/tuners/lora/layer.py``): off for ``nn.Linear`` (warned and forced), on for transformers'
    ``Conv1D`` (GPT-2's ``[in, out]`` weights), and an ``Embedding``'s update is always transposed.
    The layer's class comes from the base's config.json built on the meta device; where that model
    cannot be built, the base weight's shape decides, and a square weight (either orientation fits)
    is refused."""
    from .sources.peft import is_targeted

    kinds = _layer_kinds(base_plan, base_dir, [module for module, _ in targets.values()])
    merges: Dict[str, Tuple[int, float, str, bool]] = {}
    for weight, (module, parts) in targets.items():
        if not is_targeted(cfg, module, cfg_path):
            raise LayoutError(f"{cfg_path}: target_modules does not select {module} (given exclude_modules, "
                              "modules_to_save, layers_to_transform), but the adapter holds LoRA weights for it: "
                              "peft would not apply them; fix target_modules or export the adapter without "
                              "--merge-adapters")
        r, scale, field = _scale(cfg, module, cfg_path)
        emb = "lora_embedding_A" in parts
        a, b = (parts["lora_embedding_A"], parts["lora_embedding_B"]) if emb else (parts["lora_A"], parts["lora_B"])
        w = tuple(base_by_name[weight].shape)
        a_shape, b_shape = tuple(a.shape), tuple(b.shape)
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != r or b_shape[1] != r:
            raise LayoutError(f"{module}: LoRA A {list(a_shape)} / B {list(b_shape)} do not fit r={r} of {cfg_path} "
                              "(rank_pattern / r); only Linear, Conv1D and Embedding LoRA layers merge")
        kind = kinds.get(module)
        if kind is None:
            kind = "embedding" if emb else None
        if kind not in (None, "linear", "conv1d", "embedding") or (kind == "embedding") != emb:
            raise OptionError(f"{cfg_path}: {module} is a {kind} layer with {'embedding ' if emb else ''}LoRA "
                              "weights; --merge-adapters merges LoRA on Linear, Conv1D and Embedding layers only: "
                              "export the adapter directory (without --merge-adapters) and merge it with peft")
        update = (b_shape[0], a_shape[1])
        if kind is None:  # no model class to ask: only a non-square weight says which way round it is
            if update == w and update[::-1] != w:
                kind = "linear"
            elif update[::-1] == w and update != w:
                kind = "conv1d"
            elif update == w:
                raise LayoutError(f"{base_dir}/config.json: no model transformers can build, so whether {module} "
                                  "is an nn.Linear or a Conv1D (which peft merges transposed) is unknown for its "
                                  "square weight; pass --base a directory whose config.json transformers loads")
        transpose = kind in ("conv1d", "embedding")
        if (update[::-1] if transpose else update) != w:
            raise LayoutError(f"{module}: LoRA update {list(update[::-1] if transpose else update)} does not fit "
                              f"the base weight {list(w)}; pass --base the model the adapter was trained on")
        merges[module] = (r, scale, field, transpose)
    return merges


def write_merged(adapter_plan: "ExportPlan", dst: Union[str, "os.PathLike[str]"], *, base: Optional[str] = None,
                 dtype: Optional[str] = None, max_shard_size: Union[int, str] = "5GB", overwrite: bool = False,
                 quiet: bool = True) -> Dict[str, Any]:
    """Write the LoRA adapter of ``adapter_plan`` merged into its base model at ``dst``.

    Raises :class:`~.errors.OptionError` when the plan is not an adapter, cannot be merged, or has
    no local base; :class:`~.errors.LayoutError` when the adapter and the base do not fit. Nothing
    is written then.
    """
    from dataclasses import replace

    from .assemble import torch_tensor
    from .mapped_files import MappedFiles
    from .plan import LivePiece, check_plan
    from .sources import build_plan
    from .sources.peft import check_lora_config, pattern_budget, read_adapter_config
    from .commit import SiblingSwap
    from .orchestrator import write
    from .formats.config import write_config
    from .writer import check_max_shard_size, decided, plan_inputs

    started = time.perf_counter()
    if adapter_plan.adapter is None:
        raise OptionError(f"{adapter_plan.source}: not a PEFT checkpoint (no adapter_config.json, no lora_ tensors); "
                          "--merge-adapters needs one")
    max_shard_size = check_max_shard_size(max_shard_size)
    cfg_path = adapter_plan.adapter["config"]
    cfg = read_adapter_config(cfg_path)
    _refuse_unmergeable(cfg, cfg_path)
    check_lora_config(cfg, cfg_path)
    if base is None and adapter_plan.adapter.get("base_in_checkpoint"):
        # The checkpoint holds the PeftModel's base weights too (verl's rank files): merge into those.
        base_dir = adapter_plan.source
        base_plan = build_plan(base_dir, tag=adapter_plan.tag, config=adapter_plan.adapter.get("model_config"),
                               peft_base=True)
    else:
        base_dir = resolve_base(adapter_plan.adapter, base)
        base_plan = build_plan(base_dir)
    if base_plan.adapter is not None:
        raise OptionError(f"{base_dir}: is itself a PEFT adapter; pass --base the base model's directory")
    lora, replaced = _group(adapter_plan, cfg_path)
    base_by_name = {t.name: t for t in base_plan.tensors}
    targets: Dict[str, Tuple[str, Dict[str, "TensorPlan"]]] = {}
    for module, parts in lora.items():
        weight = f"{module}.weight"
        if weight not in base_by_name:
            raise LayoutError(f"{base_dir}: has no tensor {weight} for the LoRA module {module} of {cfg_path}; pass "
                              "--base the model the adapter was trained on")
        targets[weight] = (module, parts)
    for name in replaced:
        if name not in base_by_name:
            raise LayoutError(f"{base_dir}: has no tensor {name} for the modules_to_save copy of {cfg_path}; pass "
                              "--base the model the adapter was trained on")
    with pattern_budget():  # every pattern match of this merge, together
        merges = _plan_merges(cfg, cfg_path, targets, base_by_name, base_plan, base_dir)
    skipped: List[str] = []
    decided(base_plan, dtype)
    with MappedFiles() as files:
        out = list(base_plan.tensors)
        by_name = {t.name: i for i, t in enumerate(out)}

        def merged_chunks(wt: "TensorPlan", module: str, parts: Dict[str, "TensorPlan"],
                          out_dtype: str) -> Iterator[memoryview]:
            import torch

            r, scale, field, transpose = merges[module]
            emb = "lora_embedding_A" in parts
            a_plan, b_plan = (parts["lora_embedding_A"], parts["lora_embedding_B"]) if emb else \
                (parts["lora_A"], parts["lora_B"])
            a = torch_tensor(a_plan, files).reshape(a_plan.shape).to(torch.float32)
            b = torch_tensor(b_plan, files).reshape(b_plan.shape).to(torch.float32)
            w = torch_tensor(wt, files).reshape(wt.shape).to(torch.float32, copy=True)
            was_finite = torch.isfinite(w)
            delta = b @ a
            if transpose:
                delta = delta.T
            w += delta * scale
            del a, b, delta
            merged = w.to(getattr(torch, _TORCH[out_dtype]))
            if not bool((torch.isfinite(merged) | ~was_finite).all()):
                raise LayoutError(f"{cfg_path}: merging {module} with {field} (scale {scale:.6g}, r={r}) gives "
                                  f"non-finite values in {wt.name} as {out_dtype}: the adapter's scale or weights "
                                  "are out of range; fix adapter_config.json or the adapter (peft would produce "
                                  "the same inf/nan)")
            del was_finite, w
            yield memoryview(merged.contiguous().view(torch.uint8).reshape(-1).numpy())

        # The merged plan: the base's, each merged weight computed when the writer asks (a
        # LivePiece), each modules_to_save copy read in the base tensor's output dtype.
        for name, (module, parts) in targets.items():
            wt = base_by_name[name]

            def read(lo: int, hi: int, writer: Optional[int], d: str, wt: "TensorPlan" = wt, module: str = module,
                     parts: Dict[str, "TensorPlan"] = parts) -> Iterator[memoryview]:
                return merged_chunks(wt, module, parts, d)

            out[by_name[name]] = replace(wt, parts=[[LivePiece(read, 0, wt.numel, wt.src_dtype)]], chunks=None,
                                         part_shapes=None, cat_dim=None, keep_rows=None, elem_range=None, replicas=[],
                                         module_check=None, tied_copies=[])
        for name, at in replaced.items():
            bt = base_by_name[name]
            if tuple(at.shape) != tuple(bt.shape):
                raise LayoutError(f"{name}: the modules_to_save copy has shape {list(at.shape)}, the base "
                                  f"{list(bt.shape)}; pass --base the model the adapter was trained on")
            out[by_name[name]] = replace(at, name=name, out_dtype=bt.out_dtype)  # the base tensor's output dtype
        merged_plan = replace(base_plan, tensors=out)
        check_plan(merged_plan)

        def finish(staging: str, tensors: Sequence["OutTensor"]) -> Dict[str, Any]:
            copied = write_config(staging, config_dir=base_plan.config_dir, skipped=skipped,
                                  tensor_dtypes=[t.dtype for t in tensors])
            return {"config_files": copied, "warnings": skipped}

        strategy = SiblingSwap(dst, overwrite=overwrite, inputs=plan_inputs(adapter_plan) + plan_inputs(base_plan),
                               configs=[base_plan.config_dir])
        report = write(merged_plan, strategy, files=files, max_shard_size=max_shard_size, finish=finish, quiet=quiet,
                       what=f"merging into {dst}")
    keys = ("destination", "files", "shards", "tensor_bytes", "bytes_on_disk", "config_files", "warnings")
    return {**{k: report[k] for k in keys}, "merged": sorted(targets), "replaced": sorted(replaced), "base": base_dir,
            "seconds": round(time.perf_counter() - started, 3)}
