"""``--merge-adapters``: a LoRA adapter merged into its base model, written in the base's Hub layout.

For every base weight a LoRA module targets, ``W' = W + scale * (B @ A)`` (transposed for
``fan_in_fan_out`` layers and for embeddings, as peft's ``get_delta_weight`` does), computed in
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
from typing import Dict, List, Optional, Tuple

from .errors import LayoutError, OptionError

__all__ = ["write_merged", "lora_scale", "resolve_base"]

_PREFIX = "base_model.model."
_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_LORA = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.weight)?$")


def _pattern_value(patterns: dict, module: str, default):
    """peft's ``get_pattern_key``: an exact module name, else the first pattern matching its end."""
    if module in patterns:
        return patterns[module]
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_scale(cfg: dict, module: str) -> Tuple[int, float]:
    """``(r, scale)`` of LoRA module ``module`` (its name in the base model) under adapter config ``cfg``."""
    r = _pattern_value(cfg.get("rank_pattern") or {}, module, cfg.get("r"))
    alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha"))
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LayoutError(f"adapter_config.json: r={r!r}, lora_alpha={alpha!r} for {module}; not a LoRA config")
    return r, (alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r)


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


def _group(adapter_plan, cfg_path) -> Tuple[Dict[str, dict], Dict[str, object]]:
    """``(lora, replaced)``: base module name -> {kind: TensorPlan} for LoRA pairs; base tensor name
    -> TensorPlan for ``modules_to_save`` copies."""
    lora: Dict[str, dict] = {}
    replaced: Dict[str, object] = {}
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


def write_merged(adapter_plan, dst, *, base: Optional[str] = None, dtype: Optional[str] = None,
                 max_shard_size="5GB", overwrite: bool = False, quiet: bool = True) -> dict:
    """Write the LoRA adapter of ``adapter_plan`` merged into its base model at ``dst``.

    Raises :class:`~.errors.OptionError` when the plan is not an adapter, cannot be merged, or has
    no local base; :class:`~.errors.LayoutError` when the adapter and the base do not fit. Nothing
    is written then.
    """
    from .assemble import to_torch
    from .mapped_files import MappedFiles
    from .sources import build_plan
    from .sources.peft import read_adapter_config
    from .commit import SiblingSwap
    from .orchestrator import write
    from .writer import OutTensor, check_max_shard_size, copy_config_files, plan_inputs, plan_tensors

    started = time.perf_counter()
    if adapter_plan.adapter is None:
        raise OptionError(f"{adapter_plan.source}: not a PEFT checkpoint (no adapter_config.json, no lora_ tensors); "
                          "--merge-adapters needs one")
    max_shard_size = check_max_shard_size(max_shard_size)
    cfg_path = adapter_plan.adapter["config"]
    cfg = read_adapter_config(cfg_path)
    _refuse_unmergeable(cfg, cfg_path)
    base_dir = resolve_base(adapter_plan.adapter, base)
    base_plan = build_plan(base_dir)
    if base_plan.adapter is not None:
        raise OptionError(f"{base_dir}: is itself a PEFT adapter; pass --base the base model's directory")
    lora, replaced = _group(adapter_plan, cfg_path)
    base_by_name = {t.name: t for t in base_plan.tensors}
    targets: Dict[str, Tuple[str, dict]] = {}
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
    fan_in_fan_out = bool(cfg.get("fan_in_fan_out"))
    skipped: List[str] = []
    with MappedFiles() as files:
        out = plan_tensors(base_plan, dtype, files, ranges=True)
        by_name = {t.name: i for i, t in enumerate(out)}

        def merged_chunks(wt, module, parts, out_dtype):
            import torch

            r, scale = lora_scale(cfg, module)
            emb = "lora_embedding_A" in parts
            a_plan, b_plan = (parts["lora_embedding_A"], parts["lora_embedding_B"]) if emb else \
                (parts["lora_A"], parts["lora_B"])
            a = to_torch(a_plan, files).reshape(a_plan.shape).to(torch.float32)
            b = to_torch(b_plan, files).reshape(b_plan.shape).to(torch.float32)
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
                raise LayoutError(f"{module}: LoRA A {list(a.shape)} / B {list(b.shape)} do not fit r={r} of "
                                  f"{cfg_path}; only Linear and Embedding LoRA layers merge")
            w = to_torch(wt, files).reshape(wt.shape).to(torch.float32, copy=True)
            delta = b @ a
            if emb or fan_in_fan_out:
                delta = delta.T
            delta = delta * scale
            if tuple(delta.shape) != tuple(w.shape):
                raise LayoutError(f"{module}: LoRA update {list(delta.shape)} does not fit the base weight "
                                  f"{list(w.shape)}; pass --base the model the adapter was trained on")
            w += delta
            del a, b, delta
            yield memoryview(w.to(getattr(torch, _TORCH[out_dtype])).contiguous().view(torch.uint8).reshape(-1).numpy())

        for name, (module, parts) in targets.items():
            wt = base_by_name[name]
            d = out[by_name[name]].dtype
            out[by_name[name]] = OutTensor(name, d, tuple(wt.shape),
                                           lambda wt=wt, module=module, parts=parts, d=d: merged_chunks(
                                               wt, module, parts, d))
        from .assemble import iter_bytes

        for name, at in replaced.items():
            bt = base_by_name[name]
            if tuple(at.shape) != tuple(bt.shape):
                raise LayoutError(f"{name}: the modules_to_save copy has shape {list(at.shape)}, the base "
                                  f"{list(bt.shape)}; pass --base the model the adapter was trained on")
            d = out[by_name[name]].dtype  # the base tensor's output dtype
            out[by_name[name]] = OutTensor(name, d, tuple(bt.shape), lambda at=at, d=d: iter_bytes(at, d, files))

        def finish(staging, tensors):
            copied = copy_config_files(base_plan.config_dir, staging, skipped, tensors=tensors)
            return {"config_files": copied, "warnings": skipped}

        strategy = SiblingSwap(dst, overwrite=overwrite, inputs=plan_inputs(adapter_plan) + plan_inputs(base_plan),
                               configs=[base_plan.config_dir])
        report = write(out, strategy, max_shard_size=max_shard_size, finish=finish, quiet=quiet,
                       what=f"merging into {dst}")
    keys = ("destination", "files", "shards", "tensor_bytes", "bytes_on_disk", "config_files", "warnings")
    return {**{k: report[k] for k in keys}, "merged": sorted(targets), "replaced": sorted(replaced), "base": base_dir,
            "seconds": round(time.perf_counter() - started, 3)}
