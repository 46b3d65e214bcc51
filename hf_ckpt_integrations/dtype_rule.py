"""The one rule deciding the dtype every output tensor is written in, on every path.

The promise is what ``from_pretrained(dir, dtype=X).save_pretrained()`` writes. Loading in ``X``
casts every floating tensor to ``X`` except the modules the model class keeps in fp32:

- transformers 5 (``PreTrainedModel._get_dtype_plan`` and ``core_model_loading``):
  ``_keep_in_fp32_modules_strict`` stay fp32 when ``X`` is fp16 or bf16, ``_keep_in_fp32_modules``
  only when ``X`` is fp16. ``post_init`` gathers both lists from the model's children. A tensor
  is kept when one alternation regex of the names (each ``*`` read as ``.*``, nothing else
  escaped) is *found* (``re.search``) in its in-memory name: ``"gate.weight"`` keeps
  ``mlp.gate.weight`` but not ``mlp.experts.gate_up_proj``.
- transformers 4.x (4.51: ``from_pretrained``): ``_keep_in_fp32_modules`` only, and only for
  fp16; a name is kept when a module name appears in it as whole dotted components
  (``(^|\\.)wo($|\\.)``). 4.x releases that have ``_keep_in_fp32_modules_strict`` add it for
  fp16 and bf16, with the same matching.

Inputs are plain data (:class:`KeepFp32`, read from the model class by
:mod:`.sources.fp32_modules` or from a live model by :func:`keep_fp32_of_model`), so the rule is
tested without torch. Every path asks :func:`request` for the dtype asked for (each caller's
default expressed as its input) and :func:`output_dtype` for each tensor.
"""

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Dict, List, Optional, Pattern, Tuple

from .formats.dtypes import FLOATS, from_user

if TYPE_CHECKING:
    import torch

__all__ = ["KeepFp32", "request", "output_dtype", "kept_reason", "keep_fp32_of_model", "match_style", "trained_dtype"]


@dataclass(frozen=True)
class KeepFp32:
    """A model class's fp32-kept modules as the installed transformers applies them.

    ``modules``: ``_keep_in_fp32_modules`` (kept when loading in fp16); ``strict``:
    ``_keep_in_fp32_modules_strict`` (kept in fp16 and bf16); ``style``: how names match,
    ``"search"`` (transformers 5) or ``"components"`` (4.x); ``model_class``: whose lists they are
    (what ``inspect`` names)."""

    modules: Tuple[str, ...] = ()
    strict: Tuple[str, ...] = ()
    style: str = "search"
    model_class: Optional[str] = None

    def lists_for(self, requested: Optional[str]) -> Tuple[Tuple[str, str], ...]:
        """``((list attribute, module name), ...)`` that apply when loading in ``requested``."""
        out = []
        if requested == "F16":
            out += [("_keep_in_fp32_modules", m) for m in self.modules]
        if requested in ("F16", "BF16"):
            out += [("_keep_in_fp32_modules_strict", m) for m in self.strict]
        return tuple(out)


def match_style(transformers_major: Optional[int]) -> str:
    """The matching of the installed transformers: ``"search"`` from 5 on, ``"components"`` before."""
    return "search" if (transformers_major or 0) >= 5 else "components"


@lru_cache(maxsize=4096)
def _pattern(module: str, style: str) -> Pattern[str]:
    if style == "search":  # transformers 5: core_model_loading.build_glob_alternation, then .search
        return re.compile(module.replace("*", r".*"))
    return re.compile(rf"((^|\.){module}($|\.))")  # 4.x from_pretrained: whole dotted components


def kept_reason(name: str, requested: Optional[str], keep: Optional[KeepFp32]) -> Optional[str]:
    """Why tensor ``name`` (its in-memory name) stays fp32 when loaded in ``requested`` (a
    safetensors name): ``"DeepseekV3ForCausalLM._keep_in_fp32_modules_strict: 'gate.weight'"``;
    None when it is not kept."""
    if keep is None or requested not in ("F16", "BF16"):
        return None
    for attr, module in keep.lists_for(requested):
        if _pattern(module, keep.style).search(name):
            return f"{keep.model_class or 'the model class'}.{attr}: {module!r}"
    return None


def request(dtype: Optional[str] = None, *, training: Optional[str] = None, masters: bool = False) -> Optional[str]:
    """The dtype asked for, as a safetensors name, each path's default expressed as an input:
    ``dtype`` (``"fp32"``/``"bf16"``/``"fp16"``) when given; else ``training`` (the training dtype
    of the model: the Trainer callback's default); else ``"F32"`` when the checkpoint holds fp32
    masters (the offline default); else None: every tensor as stored (the live hooks' default).
    Raises :class:`~.errors.OptionError` for an unknown name."""
    asked = from_user(dtype)
    if asked is not None:
        return asked
    if training is not None:
        return from_user(training)
    return "F32" if masters else None


def output_dtype(name: str, stored: str, requested: Optional[str], keep: Optional[KeepFp32] = None) -> str:
    """The dtype tensor ``name`` (its in-memory name; stored or trained in ``stored``, a safetensors
    name) is written in when ``requested`` (from :func:`request`) is asked: non-floating tensors and
    ``requested`` None keep ``stored``; a tensor the model class keeps in fp32 for ``requested`` is
    ``F32``; every other floating tensor is ``requested``."""
    if stored not in FLOATS or requested is None:
        return stored
    if kept_reason(name, requested, keep) is not None:
        return "F32"
    return requested


def keep_fp32_of_model(model: "torch.nn.Module") -> Optional[KeepFp32]:
    """The lists of a live model (a transformers ``PreTrainedModel``: its instance attributes, which
    transformers 5's ``post_init`` gathers from the children); None for any other module."""
    from .formats.config import model_class_name, transformers_major

    if not hasattr(model, "_keep_in_fp32_modules") and not hasattr(model, "_keep_in_fp32_modules_strict"):
        return None  # not a transformers model: nothing is known to be kept
    modules = getattr(model, "_keep_in_fp32_modules", None)  # None on a class that keeps none
    strict = getattr(model, "_keep_in_fp32_modules_strict", None)
    return KeepFp32(tuple(sorted(modules or ())), tuple(sorted(strict or ())), match_style(transformers_major()),
                    model_class_name(model))


def trained_dtype(model: "Optional[torch.nn.Module]") -> Optional[str]:
    """``"fp32"``/``"bf16"``/``"fp16"``: the dtype ``model`` trains in — the one dtype of its floating
    parameters, not counting fp32 ones its class keeps in fp32 for the others' dtype (a DeepSeek-V3
    loaded in bf16 holds its router in fp32); None when mixed otherwise, or no model."""
    from .formats.dtypes import from_torch, to_user

    if model is None:
        return None
    seen: Dict[str, List[str]] = {}  # dtype -> the parameters of it
    for name, p in model.named_parameters():
        if p.is_floating_point():
            try:
                seen.setdefault(from_torch(p.dtype), []).append(name)
            except ValueError:  # float8 & co: not a dtype written here
                return None
    if len(seen) == 2 and "F32" in seen:
        other = next(d for d in seen if d != "F32")
        keep = keep_fp32_of_model(model)
        if all(kept_reason(n, other, keep) for n in seen["F32"]):
            return to_user(other)
    return to_user(next(iter(seen))) if len(seen) == 1 else None
