"""Post-passes the registry runs on every plan, whatever the source (:mod:`..sources.registry`), each
handed the export's :class:`~..sources.protocol.PlanContext` (whose config.json is read once for all of them).

- :func:`find_config_dir` — config discovery: the first candidate a source proposes that holds a
  usable ``config.json``;
- :func:`drop_tied_aliases` — the tied-weight policy of ``save_pretrained``;
- :func:`tie_embeddings` — for state dicts holding a tied weight under both names: one written,
  the other checked to be a byte-identical replica;
- the Hub-layout conversion lives in :mod:`.hub_layout` (:func:`~.hub_layout.convert_plan`);
- :func:`finish_plan` — the passes that close every plan, offline or live: the output dtype
  (:func:`~..plan.decide_dtypes`, the one rule) and :func:`~..plan.check_plan`.
"""

from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Optional

from .. import guards
from ..plan import ExportPlan, check_plan, decide_dtypes

if TYPE_CHECKING:  # the registry's context type; the conversion layer imports nothing from sources/
    from ..sources.protocol import PlanContext

__all__ = ["find_config_dir", "drop_tied_aliases", "tie_embeddings", "finish_plan"]


def finish_plan(plan: ExportPlan, dtype: Optional[str] = None, keep: Optional[object] = None) -> ExportPlan:
    """The last passes of every plan, whatever the source (the registry's offline plans, the live
    ones of :mod:`.live` and :mod:`.colossalai`): every tensor's output dtype decided once by the
    one rule (:func:`~..plan.decide_dtypes`; ``keep``: the model class's fp32-kept modules), then
    :func:`~..plan.check_plan`. Returns ``plan``."""
    decide_dtypes(plan, dtype, keep)
    check_plan(plan)
    return plan


def find_config_dir(candidates: Iterable[Optional[str]]) -> Optional[str]:
    """The first candidate holding a usable config.json (a regular file inside it, see guards)."""
    for d in candidates:
        if d and guards.config_problem(d) is None:
            return d
    return None


def drop_tied_aliases(plan: ExportPlan, ctx: "PlanContext") -> None:
    """Tied names (``lm_head.weight`` -> ``model.embed_tokens.weight``) are written once, as
    ``save_pretrained`` does; ``from_pretrained`` re-ties them. Kept when the config says the
    weights are not tied (the engine shared them by hand)."""
    if ctx.tie_word_embeddings is False and plan.aliases:
        by_name = {t.name: t for t in plan.tensors}
        for alias, target in plan.aliases.items():
            if target in by_name and alias not in by_name:
                t = by_name[target]
                plan.tensors.append(replace(t, name=alias))  # the same placement, merges, unpadding
        plan.notes.append("config.json says tie_word_embeddings=false: tied aliases written as copies")
        plan.aliases = {}


# Input-embedding names of the transformers families whose output embedding save_pretrained ties to it.
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight", "shared.weight",
               "embeddings.weight")


def tie_embeddings(plan: ExportPlan, ctx: "PlanContext") -> None:
    """For sources whose state dicts hold tied weights under both names (``lm_head.weight`` and the
    input embedding: FSDP, torch DCP): when config.json ties them, write the embedding once, as
    ``save_pretrained`` does, and check the other copy is byte-identical to it (a replica, never
    written)."""
    tied = ctx.tie_word_embeddings
    by_name = {t.name: t for t in plan.tensors}
    head = by_name.get("lm_head.weight")
    if tied is not True or head is None:
        return
    embeds = [t for t in plan.tensors if t.name.endswith(_EMBEDDINGS) and t.shape == head.shape
              and t.src_dtype == head.src_dtype]
    if len(embeds) != 1:
        return
    emb = embeds[0]
    # Checked bitwise against the embedding in whatever chunk layout each has (1-D rows, 2-D blocks...):
    # save_pretrained writes the embedding alone, so a head that differs would be lost silently.
    emb.tied_copies.append((head.name, head.placement()))
    plan.tensors = [t for t in plan.tensors if t is not head]
    plan.aliases[head.name] = emb.name
    plan.notes.append(f"config.json ties the word embeddings: {head.name} written once, as {emb.name}")
