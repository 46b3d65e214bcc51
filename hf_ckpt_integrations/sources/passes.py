"""Post-passes the registry runs on every plan, whatever the source (:mod:`.registry`).

- :func:`find_config_dir` — config discovery: the first candidate a source proposes that holds a
  usable ``config.json``;
- :func:`drop_tied_aliases` — the tied-weight policy of ``save_pretrained``;
- the Hub-layout conversion lives in :mod:`.hub_layout` (:func:`~.hub_layout.convert_plan`).
"""

from dataclasses import replace
from typing import Optional

from .. import guards
from ..plan import ExportPlan

__all__ = ["find_config_dir", "drop_tied_aliases"]


def find_config_dir(candidates) -> Optional[str]:
    """The first candidate holding a usable config.json (a regular file inside it, see guards)."""
    for d in candidates:
        if d and guards.config_problem(d) is None:
            return d
    return None


def drop_tied_aliases(plan: ExportPlan):
    """Tied names (``lm_head.weight`` -> ``model.embed_tokens.weight``) are written once, as
    ``save_pretrained`` does; ``from_pretrained`` re-ties them. Kept when the config says the
    weights are not tied (the engine shared them by hand)."""
    cfg = guards.read_config(plan.config_dir)
    if cfg.get("tie_word_embeddings", True) is False and plan.aliases:
        by_name = {t.name: t for t in plan.tensors}
        for alias, target in plan.aliases.items():
            if target in by_name and alias not in by_name:
                t = by_name[target]
                plan.tensors.append(replace(t, name=alias))  # the same placement, merges, unpadding
        plan.notes.append("config.json says tie_word_embeddings=false: tied aliases written as copies")
        plan.aliases = {}
