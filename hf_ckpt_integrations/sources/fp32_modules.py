"""The fp32-kept modules of the model class a ``config.json`` names (the input of :mod:`..dtype_rule`).

The lists are those of the model ``from_pretrained`` would build: the class ``architectures``
names (else the first Auto class mapping the config), built on the meta device by
:func:`~..convert.hub_layout.meta_model` — code named by ``auto_map`` is never imported — and read from the
instance, since transformers 5's ``post_init`` gathers the children's lists (a vision-language
model keeps its text model's). The answer is cached per (transformers release, config), as the
Hub-layout answer is (:mod:`.answer_cache`): an export of every ``checkpoint-N`` of a
run builds the model once.
"""

from typing import TYPE_CHECKING, Any, Callable, Optional, cast

from ..dtype_rule import KeepFp32, keep_fp32_of_model, match_style
from ..formats.config import transformers_major
from ..convert.answer_cache import cache_key, read_answer, write_answer

if TYPE_CHECKING:
    from ..plan import ExportPlan

__all__ = ["keep_fp32_of_config", "keep_for_plan"]

_FORMAT = 1  # bump when what an entry holds changes


def keep_fp32_of_config(config_dir: Optional[str], cfg: Optional[dict] = None) -> Optional[KeepFp32]:
    """The fp32-kept modules of the model ``config_dir/config.json`` describes; None without a
    config, without transformers, or for a model the installed transformers cannot build (nothing
    is then known to be kept: every tensor follows the requested dtype). ``cfg``: that config.json,
    already read (an export's :class:`~.protocol.PlanContext` reads it once)."""
    if config_dir is None or transformers_major() is None:
        return None
    if cfg is None:
        from ..guards import read_config

        cfg = read_config(config_dir)
    key = cache_key("keep-fp32", [_FORMAT, cfg])
    entry = _valid(read_answer("keep-fp32", key))
    if entry is None:
        entry = _derive(config_dir, cfg)
        write_answer("keep-fp32", key, entry)
    if entry["model_class"] is None:
        return None
    return KeepFp32(tuple(entry["modules"]), tuple(entry["strict"]), match_style(transformers_major()),
                    entry["model_class"])


def keep_for_plan(plan: "ExportPlan", dtype: Optional[str], config: Optional[Callable[[], dict]] = None, *,
                  always: bool = False) -> Optional[KeepFp32]:
    """The lists an export of ``plan`` in ``dtype`` needs: those already on the plan, else, when a
    load in ``dtype`` keeps any module in fp32 (bf16/fp16) — or ``always`` (what ``inspect`` shows
    for every dtype) — and the plan is a model (not a PEFT adapter, which peft saves as trained),
    those of its config's class; else None (nothing to read). ``config``: returns
    ``plan.config_dir``'s config.json as already read (an export's :class:`~.protocol.PlanContext`),
    called only when the lists are needed."""
    from ..formats.dtypes import from_user

    if plan.keep_fp32 is not None or plan.adapter is not None or (
            not always and from_user(dtype) not in ("F16", "BF16")):
        return cast(Optional[KeepFp32], plan.keep_fp32)  # the plan types it loosely (object): it holds a KeepFp32
    return keep_fp32_of_config(plan.config_dir, config() if config is not None and plan.config_dir else None)


def _derive(config_dir: str, cfg: dict) -> dict:
    from ..convert.hub_layout import meta_model

    try:
        model = meta_model(config_dir, cfg=cfg)
    except Exception:  # a config this transformers rejects: the Hub-layout pass names the problem
        model = None
    keep = keep_fp32_of_model(model) if model is not None else None
    if keep is None:
        return {"model_class": None, "modules": [], "strict": []}
    return {"model_class": keep.model_class, "modules": list(keep.modules), "strict": list(keep.strict)}


def _valid(entry: Any) -> Optional[dict]:
    """A cache entry exactly as :func:`_derive` writes it, else None (derived again)."""
    ok = (isinstance(entry, dict) and set(entry) == {"model_class", "modules", "strict"}
          and (entry["model_class"] is None or isinstance(entry["model_class"], str))
          and all(isinstance(entry[k], list) and all(isinstance(m, str) for m in entry[k])
                  for k in ("modules", "strict")))
    return entry if ok else None
