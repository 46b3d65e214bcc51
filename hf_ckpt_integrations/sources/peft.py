"""PEFT adapters over any engine checkpoint: detection, peft's names, the adapter plan.

A PEFT model trained under DeepSpeed (or saved live) holds its adapter parameters under the
in-memory names of the ``PeftModel``: ``base_model.model.<module>.lora_A.<adapter>.weight``,
``base_model.model.<module>.modules_to_save.<adapter>.weight``. ``PeftModel.save_pretrained``
writes ``adapter_config.json`` and ``adapter_model.safetensors`` holding the adapter only, under
the names of peft's ``get_peft_model_state_dict``: the adapter-name segment removed
(``…lora_A.weight``, ``…lora_embedding_A``), a ``modules_to_save`` copy under the wrapped module's
own name (``base_model.model.lm_head.weight``), the frozen base weights and the
``original_module``/``base_layer`` copies left out. (The Trainer leaves frozen parameters out of
a DeepSpeed checkpoint of a PEFT model anyway, ``exclude_frozen_parameters``.)

A checkpoint is a PEFT one when it holds adapter tensors (a ``lora_*``/``modules_to_save``
segment followed by an adapter name) or when an ``adapter_config.json`` sits beside it; the plan
then keeps only the adapter, renamed, and records the adapter's config (:func:`adapter_plan`).
"""

import json
import os
import re
from typing import Dict, Iterable, List, Optional

from ..errors import CheckpointError, LayoutError

__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "adapter_names_in", "save_name", "find_adapter_config",
           "is_adapter_config_dir",
           "read_adapter_config", "adapter_plan", "adapter_summary", "is_peft_model", "check_not_empty",
           "adapter_out_dir"]

from ..formats.names import ADAPTER_CONFIG_NAME  # noqa: E402  (re-exported)
from ..formats.names import ADAPTER_SAFETENSORS_NAME as ADAPTER_WEIGHTS_NAME  # noqa: E402
_CONFIG_LIMIT = 1 << 20

# A LoRA parameter: `<module>.lora_A.<adapter>.weight`, `<module>.lora_embedding_A.<adapter>`,
# `<module>.lora_magnitude_vector.<adapter>.weight` (DoRA); a modules_to_save copy.
_ADAPTER_SEGMENT = re.compile(r"\.(lora_[A-Za-z_]+|modules_to_save)\.([^.]+)(?:\.|$)")


def adapter_names_in(names: Iterable[str]) -> List[str]:
    """The adapter names the tensor ``names`` carry (``default`` for a plain ``get_peft_model``)."""
    found = set()
    for n in names:
        m = _ADAPTER_SEGMENT.search(n)
        if m:
            found.add(m.group(2))
    return sorted(found)


def save_name(name: str, adapter: str = "default") -> Optional[str]:
    """The name ``PeftModel.save_pretrained`` writes for the parameter ``name`` of adapter
    ``adapter``; ``None`` when ``name`` is not part of that adapter (a base weight, the
    ``original_module``/``base_layer`` copy, another adapter's tensor)."""
    segs = name.split(".")
    if "original_module" in segs or "base_layer" in segs:
        return None
    if "modules_to_save" in segs:
        i = segs.index("modules_to_save")
        if i + 1 < len(segs) and segs[i + 1] == adapter:
            return ".".join(segs[:i] + segs[i + 2:])
        return None
    # peft's _remove_adapter_name_from_state_dict_key: the adapter name last, or second to last.
    if len(segs) >= 2 and segs[-1] == adapter:
        return ".".join(segs[:-1])
    if len(segs) >= 3 and segs[-2] == adapter:
        return ".".join(segs[:-2] + segs[-1:])
    return None


def is_peft_model(model) -> bool:
    """True for a live ``peft.PeftModel`` (without importing peft when it is not loaded)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_out_dir(directory, adapter: str) -> str:
    """Where ``PeftModel.save_pretrained(directory)`` puts adapter ``adapter``: a subdirectory for
    any adapter but ``default``."""
    return os.fspath(directory) if adapter == "default" else os.path.join(os.fspath(directory), adapter)


def find_adapter_config(dirs: Iterable[Optional[str]], adapter: str = "default") -> Optional[str]:
    """The first ``adapter_config.json`` in ``dirs`` (or their ``adapter`` subdirectory), else None."""
    for d in dirs:
        if not d:
            continue
        for cand in (os.path.join(adapter_out_dir(d, adapter), ADAPTER_CONFIG_NAME), os.path.join(d, ADAPTER_CONFIG_NAME)):
            if os.path.isfile(cand):
                return cand
    return None


def is_adapter_config_dir(directory) -> bool:
    """True when ``directory`` holds an ``adapter_config.json`` and no ``config.json`` (``--config``
    naming a PEFT adapter's directory)."""
    return (os.path.isfile(os.path.join(directory, ADAPTER_CONFIG_NAME))
            and not os.path.lexists(os.path.join(directory, "config.json")))


def read_adapter_config(path) -> dict:
    """``adapter_config.json`` as a dict (a bounded JSON object with a ``peft_type``)."""
    try:
        if os.path.getsize(path) > _CONFIG_LIMIT:
            raise CheckpointError(f"{path}: larger than {_CONFIG_LIMIT:,} bytes, not an adapter config; pass "
                                  "--config a directory holding the adapter_config.json peft wrote")
        with open(path, "rb") as fh:
            cfg = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable ({str(e)[:200]}); fix it or pass --config a directory holding "
                              "the adapter_config.json peft wrote") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("peft_type"), str):
        raise CheckpointError(f"{path}: not a peft adapter config (no peft_type); pass --config a directory "
                              "holding the adapter_config.json PeftModel.save_pretrained wrote")
    return cfg


def adapter_summary(cfg: dict, path: Optional[str], adapter: str) -> dict:
    """What ``inspect`` shows of an adapter: type, rank, targets, base."""
    targets = cfg.get("target_modules")
    return {"config": path, "name": adapter, "peft_type": cfg.get("peft_type"), "r": cfg.get("r"),
            "lora_alpha": cfg.get("lora_alpha"), "use_rslora": cfg.get("use_rslora", False),
            "target_modules": sorted(targets) if isinstance(targets, list) else targets,
            "modules_to_save": cfg.get("modules_to_save"), "base_model_name_or_path": cfg.get("base_model_name_or_path"),
            "rank_pattern": cfg.get("rank_pattern") or {}, "alpha_pattern": cfg.get("alpha_pattern") or {}}


def check_not_empty(tensors, where) -> None:
    """Refuse an adapter with no tensor or a zero-size one (the ZeRO-3 ``save_pretrained`` bug writes
    exactly that: partitioned parameters read as empty tensors)."""
    if not tensors:
        raise LayoutError(f"{where}: the adapter holds no tensors; nothing trainable was saved — check that the "
                          "model is a PeftModel and that the checkpoint is the training run's")
    empty = [t.name for t in tensors if 0 in tuple(t.shape)]
    if empty:
        raise LayoutError(f"{where}: adapter tensor {empty[0]} has no elements ({len(empty)} such); an adapter read "
                          "from partitioned ZeRO-3 parameters without gathering them: save it again from the engine "
                          "checkpoint (hf-ckpt export)")


def adapter_plan(plan, src, *, config: Optional[str] = None):
    """Turn ``plan`` into the adapter directory ``PeftModel.save_pretrained`` writes when the
    checkpoint is a PEFT one (see the module doc); otherwise return it unchanged.

    ``config``: a directory holding ``adapter_config.json`` (default: beside the checkpoint).
    Raises :class:`~..errors.LayoutError` for adapter tensors of several adapters, or without an
    ``adapter_config.json`` anywhere.
    """
    names = [t.name for t in plan.tensors]
    adapters = adapter_names_in(names)
    # Beside the checkpoint; the parent directory (a save dir's tag, an output dir's checkpoint-N)
    # only when adapter tensors say it is a PEFT checkpoint: a full model is never taken for one.
    dirs = [config, src] + ([os.path.dirname(os.path.abspath(os.fspath(src)))] if adapters else [])
    cfg_path = find_adapter_config(dirs, adapters[0] if len(adapters) == 1 else "default")
    if not adapters and cfg_path is None:
        return plan
    if len(adapters) > 1:
        raise LayoutError(f"{src}: holds the tensors of {len(adapters)} adapters ({', '.join(adapters[:4])}); "
                          "export one at a time is not supported: save each adapter with PeftModel.save_pretrained")
    adapter = adapters[0] if adapters else "default"
    if cfg_path is None:
        raise LayoutError(f"{src}: holds LoRA adapter tensors ({names[0]} …) but no {ADAPTER_CONFIG_NAME}; pass "
                          f"--config DIR holding the {ADAPTER_CONFIG_NAME} PeftModel.save_pretrained wrote")
    cfg = read_adapter_config(cfg_path)
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LayoutError(f"{cfg_path}: bias={cfg.get('bias')!r}/lora_bias adapters are not supported; save them "
                          "with PeftModel.save_pretrained")
    kept: List = []
    renamed: Dict[str, str] = {}
    for t in plan.tensors:
        out = save_name(t.name, adapter)
        if out is not None:
            renamed[t.name] = out
            t.name = out
            kept.append(t)
    check_not_empty(kept, src)
    plan.tensors = kept
    plan.aliases = {}  # tied base weights are not part of an adapter
    plan.conversions = []
    plan.config_dir = None
    plan.notes = [n for n in plan.notes if "config.json" not in n]
    plan.adapter = adapter_summary(cfg, cfg_path, adapter)
    return plan
