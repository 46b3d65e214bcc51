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

import contextlib
import contextvars
import json
import math
import os
import time
import re
from typing import Dict, Iterable, List, Optional, Sequence

from .. import guards
from ..errors import CheckpointError, LayoutError, one_line

__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "adapter_names_in", "save_name", "find_adapter_config",
           "is_adapter_config_dir",
           "read_adapter_config", "adapter_plan", "adapter_summary", "is_peft_model", "check_not_empty",
           "adapter_out_dir", "check_lora_config", "pattern_key", "is_targeted", "pattern_budget", "base_name", "base_plan",
           "PATTERN_LIMIT"]

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
        with guards.open_regular(path, limit=_CONFIG_LIMIT, what="adapter_config.json") as fh:
            cfg = json.loads(fh.read(_CONFIG_LIMIT + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable ({str(e)[:200]}); fix it or pass --config a directory holding "
                              "the adapter_config.json peft wrote") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("peft_type"), str):
        raise CheckpointError(f"{path}: not a peft adapter config (no peft_type); pass --config a directory "
                              "holding the adapter_config.json PeftModel.save_pretrained wrote")
    return cfg


# The largest rank taken seriously (peft trains r <= a few thousand); it must also equal lora_A's rows.
MAX_RANK = 1 << 20
# The largest |lora_alpha|: alpha / r must be a finite float32, the dtype peft (and the merge) scales in.
MAX_ALPHA = 3.4028234663852886e38
# peft's patterns are module names or short regexes; a longer one is refused unread.
PATTERN_LIMIT = 4096
# A pattern that has not matched one module name within this many seconds is catastrophic
# (nested quantifiers): refused, where plain ``re`` would spin without end.
MATCH_TIMEOUT_S = 2.0
# ... and all of one merge's matches (modules x patterns) together within this many seconds
# (:func:`pattern_budget`): many slow patterns must not add up to a hang either.
MATCH_BUDGET_S = 10.0
_BUDGET: "contextvars.ContextVar[Optional[List[float]]]" = contextvars.ContextVar("hf_ckpt_pattern_budget", default=None)


@contextlib.contextmanager
def pattern_budget(seconds: float = MATCH_BUDGET_S):
    """Bound the total time the pattern matches inside the ``with`` block may take."""
    token = _BUDGET.set([seconds])
    try:
        yield
    finally:
        _BUDGET.reset(token)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_rank(v, path, field) -> None:
    if not _is_int(v) or not 1 <= v <= MAX_RANK:
        raise CheckpointError(f"{path}: {field} is {str(v)[:40]!r}; a LoRA rank is an integer from 1 to {MAX_RANK:,}: "
                              "fix adapter_config.json (PeftModel.save_pretrained writes the rank it trained)")


def _check_alpha(v, path, field) -> None:
    if not (_is_int(v) or isinstance(v, float)) or not math.isfinite(v) or abs(v) > MAX_ALPHA:
        raise CheckpointError(f"{path}: {field} is {str(v)[:40]!r}; lora_alpha is a finite number (|alpha| at most "
                              f"{MAX_ALPHA:.3g}, so that alpha / r is a float32): fix adapter_config.json")


def _check_patterns(patterns, path, field, check_value) -> None:
    if patterns is None:
        return
    if not isinstance(patterns, dict):
        raise CheckpointError(f"{path}: {field} is a JSON {type(patterns).__name__}, not an object of module-name "
                              "patterns: fix adapter_config.json")
    for key, value in patterns.items():
        _compile(f"(.*\\.)?({key})$", key, path, field)
        check_value(value, path, f"{field}[{str(key)[:60]!r}]")


def _check_names(value, path, field, *, regex_ok: bool, ints: bool = False) -> None:
    """``value``: null, a list of names (ints with ``ints``), or (``regex_ok``) one regex string."""
    if value is None:
        return
    if isinstance(value, str) and regex_ok:
        _compile(value, value, path, field)
        return
    ok = (_is_int(value) if ints else False) or (isinstance(value, list) and all(
        (_is_int(v) if ints else isinstance(v, str)) for v in value))
    if not ok:
        what = "integers" if ints else "strings"
        raise CheckpointError(f"{path}: {field} is not {'a regex string or ' if regex_ok else ''}a list of {what}: "
                              "fix adapter_config.json")


def check_lora_config(cfg: dict, path) -> None:
    """Refuse (:class:`CheckpointError`) a LoRA ``adapter_config.json`` whose fields the merge or peft
    use hold a wrong type or value: ``r``, ``lora_alpha`` and every value of ``rank_pattern`` /
    ``alpha_pattern`` (an integer rank, a finite alpha; a bool is not a number), the flags, the
    module lists and every regex among them (compiled as peft compiles it, bounded in length). Any
    other ``peft_type`` passes unchecked."""
    if cfg.get("peft_type") != "LORA":
        return
    _check_rank(cfg.get("r"), path, "r")
    _check_alpha(cfg.get("lora_alpha"), path, "lora_alpha")
    _check_patterns(cfg.get("rank_pattern"), path, "rank_pattern", _check_rank)
    _check_patterns(cfg.get("alpha_pattern"), path, "alpha_pattern", _check_alpha)
    for flag in ("use_rslora", "fan_in_fan_out", "use_dora"):
        if cfg.get(flag) is not None and not isinstance(cfg.get(flag), bool):
            raise CheckpointError(f"{path}: {flag} is {str(cfg.get(flag))[:40]!r}, not true or false: fix "
                                  "adapter_config.json")
    targets = cfg.get("target_modules")
    _check_names(targets, path, "target_modules", regex_ok=True)
    _check_names(cfg.get("exclude_modules"), path, "exclude_modules", regex_ok=True)
    _check_names(cfg.get("modules_to_save"), path, "modules_to_save", regex_ok=False)
    for m in cfg.get("modules_to_save") or ():
        _compile(rf"(^|.*\.){m}($|\..*)", m, path, "modules_to_save")
    _check_names(cfg.get("layers_to_transform"), path, "layers_to_transform", regex_ok=False, ints=True)
    layers_pattern = cfg.get("layers_pattern")
    _check_names([layers_pattern] if isinstance(layers_pattern, str) else layers_pattern, path, "layers_pattern",
                 regex_ok=False)
    for p in ([layers_pattern] if isinstance(layers_pattern, str) else layers_pattern or ()):
        _compile(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", p, path, "layers_pattern")


def _compile(source: str, shown, path, field):
    """``source`` compiled as peft compiles it (``re``, whose errors peft raises); CheckpointError
    naming ``field`` for a pattern that is not a string, too long, or not a regex ``re`` accepts."""
    if not isinstance(shown, str):
        raise CheckpointError(f"{path}: {field} holds {str(shown)[:40]!r}, not a module-name pattern (a string): "
                              "fix adapter_config.json")
    if len(source) > PATTERN_LIMIT:
        raise CheckpointError(f"{path}: a pattern of {field} is {len(shown):,} characters, more than the "
                              f"{PATTERN_LIMIT:,} a module-name pattern may have: fix adapter_config.json")
    try:
        return re.compile(source)
    except (re.error, RecursionError, OverflowError, ValueError) as e:
        raise CheckpointError(f"{path}: {field} pattern {one_line(shown[:60])!r} is not a regex peft can use "
                              f"({one_line(str(e))[:80]}): fix adapter_config.json") from None


def _match(source: str, text: str, path, field, *, full: bool = False):
    """``re.match`` (``re.fullmatch`` with ``full``) of the pattern ``source`` against ``text``, as
    peft calls it, bounded in time where the ``regex`` package is installed (a transformers
    dependency; its default VERSION0 is ``re``-compatible). The pattern is first compiled by ``re``
    (:func:`_compile`), so a pattern peft would reject is refused the same way."""
    compiled = _compile(source, source, path, field)
    try:
        import regex
    except ImportError:  # plain re: the length bound is all there is
        return compiled.fullmatch(text) if full else compiled.match(text)
    budget = _BUDGET.get()
    timeout = MATCH_TIMEOUT_S if budget is None else max(min(MATCH_TIMEOUT_S, budget[0]), 0.001)
    started = time.perf_counter()
    try:
        fast = regex.compile(source)
        return fast.fullmatch(text, timeout=timeout) if full else fast.match(text, timeout=timeout)
    except TimeoutError:
        raise CheckpointError(f"{path}: the {field} pattern {one_line(source[:60])!r} did not finish matching the "
                              f"module name {one_line(text[:80])} within {timeout:g} s (the patterns' time limit; "
                              "nested quantifiers backtrack without end): write it without nested "
                              "repetition") from None
    except Exception as e:  # the regex package rejects what re accepted
        raise CheckpointError(f"{path}: {field} pattern {one_line(source[:60])!r} cannot be matched "
                              f"({type(e).__name__}): fix adapter_config.json") from None
    finally:
        if budget is not None:
            budget[0] -= time.perf_counter() - started


def pattern_key(patterns: Sequence[str], module: str, path, field) -> Optional[str]:
    """peft's ``get_pattern_key``: the first of ``patterns`` (a ``rank_pattern``/``alpha_pattern``
    key) that matches the end of the module name ``module`` after a dot, else None."""
    for key in patterns:
        if _match(rf"(.*\.)?({key})$", module, path, field) is not None:
            return key
    return None


def is_targeted(cfg: dict, module: str, path) -> bool:
    """peft's ``check_target_module_exists`` for the module name ``module``: selected by
    ``target_modules`` (a regex: full match; a list: the name or a suffix after a dot, limited by
    ``layers_to_transform``/``layers_pattern``), not by ``exclude_modules``, not under a
    ``modules_to_save`` module. ``target_modules`` null or ``"all-linear"`` select every module the
    layer filter leaves (peft resolves them from the model; the merge then trusts the adapter's
    tensors to name the modules it resolved)."""
    exclude = cfg.get("exclude_modules")
    if isinstance(exclude, str):
        if _match(exclude, module, path, "exclude_modules", full=True) is not None:
            return False
    elif exclude and (module in exclude or any(module.endswith(f".{e}") for e in exclude)):
        return False
    for m in cfg.get("modules_to_save") or ():
        if _match(rf"(^|.*\.){m}($|\..*)", module, path, "modules_to_save") is not None:
            return False
    targets = cfg.get("target_modules")
    resolved = targets is None or (isinstance(targets, str) and targets.lower() == "all-linear")
    if isinstance(targets, str) and not resolved:
        return _match(targets, module, path, "target_modules", full=True) is not None
    if not resolved and targets is not None and module in targets:
        return True
    # null / "all-linear": peft resolves them to a list of module-name suffixes from the model (its
    # model-type defaults, every linear layer), trusted here to include this module; the layer
    # filter below still applies to such a list
    if not resolved and targets is not None and not any(module.endswith(f".{t}") for t in targets):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = cfg.get("layers_pattern")
    index = None
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
        index = m and m.group("idx")
    else:
        for p in [patterns] if isinstance(patterns, str) else patterns:
            m = _match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module, path, "layers_pattern")
            if m is not None:
                index = m.group("idx")
                break
    if index is None:
        return False
    return int(index) == layers if isinstance(layers, int) else int(index) in layers


def adapter_summary(cfg: dict, path: Optional[str], adapter: str) -> dict:
    """What ``inspect`` shows of an adapter: type, rank, targets, base."""
    targets = cfg.get("target_modules")
    return {"config": path, "name": adapter, "peft_type": cfg.get("peft_type"), "r": cfg.get("r"),
            "lora_alpha": cfg.get("lora_alpha"), "use_rslora": cfg.get("use_rslora", False),
            "target_modules": sorted(targets, key=str) if isinstance(targets, list) else targets,
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
    dirs += plan.detail.get("adapter_config_dirs", []) if adapters else []  # where the source's engine puts one
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
    check_lora_config(cfg, cfg_path)
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LayoutError(f"{cfg_path}: bias={cfg.get('bias')!r}/lora_bias adapters are not supported; save them "
                          "with PeftModel.save_pretrained")
    base_held = sum(1 for n in names if base_name(n) is not None)
    model_config = plan.config_dir
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
    # The base weights a full PeftModel state dict holds (verl's rank files): --merge-adapters needs no --base.
    plan.adapter.update({"base_in_checkpoint": base_held, "model_config": model_config if base_held else None})
    return plan


def base_name(name: str) -> Optional[str]:
    """The base model's name of a frozen base weight a PeftModel's state dict holds
    (``base_model.model.<module>.base_layer.weight`` -> ``<module>.weight``; a ``modules_to_save``
    module's ``original_module`` copy likewise); None for an adapter tensor or any other name."""
    prefix = "base_model.model."
    if not name.startswith(prefix) or _ADAPTER_SEGMENT.search(name):
        return None
    segs = [s for s in name[len(prefix):].split(".") if s not in ("base_layer", "original_module")]
    return ".".join(segs)


def base_plan(plan, src):
    """``plan`` of a PeftModel's full state dict reduced to the base model it holds: the base weights
    under the base model's names, the adapter tensors left out (the base a LoRA merge starts from)."""
    kept = []
    for t in plan.tensors:
        out = base_name(t.name)
        if out is not None:
            t.name = out
            kept.append(t)
    if not kept:
        raise LayoutError(f"{src}: holds no base model weights beside the adapter; pass --base DIR holding the base "
                          "model (its config.json and safetensors)")
    plan.tensors = kept
    plan.aliases = {}
    return plan
