"""A DeepSpeed save's rank files: which tag directory, which file holds which rank.

``engine.save_checkpoint`` writes, per tag directory, one optimizer file per (data-parallel,
model-parallel) rank (``[bf16_|fp16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt``) and the model
states (``mp_rank_MM_model_states.pt``; under ZeRO-3 one per data-parallel rank,
``zero_pp_rank_D_mp_rank_MM_model_states.pt``). Ranks are the numbers in the names (never the sort
order); two names for one rank are refused. A source for another per-rank layout (pipeline
stages, universal checkpoints) can reuse :func:`resolve_tag_dir` and :class:`RankFile`.
"""

import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ... import guards
from ...errors import CheckpointError, LayoutError
from .allowlist import load
from .bf16_optimizer import is_bf16_optimizer_state
from .fields import check_optim_types, require

__all__ = ["OPTIM_RE", "MODEL_RE", "RankFile", "is_tag_dir", "list_tags", "resolve_tag_dir",
           "holds_checkpoint", "claim", "find_rank_files", "optim_name", "model_name"]

OPTIM_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def optim_name(prefix: str, dp_rank: int, mp_rank: int) -> str:
    """The optimizer file name DeepSpeed writes (``engine._get_zero_ckpt_name``)."""
    return f"{prefix + '_' if prefix else ''}zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_name(dp_rank: Optional[int], mp_rank: int) -> str:
    """The model-states file name DeepSpeed writes (``engine._get_ckpt_name``; ZeRO-3 adds the dp rank)."""
    return f"{'' if dp_rank is None else f'zero_pp_rank_{dp_rank}_'}mp_rank_{mp_rank:02d}_model_states.pt"


def is_tag_dir(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(OPTIM_RE.match(n) or MODEL_RE.match(n) for n in names)


def resolve_tag_dir(src: str, tag: Optional[str] = None) -> Tuple[str, str]:
    """Return ``(tag_dir, tag)`` for a save dir (``latest`` + tag dirs), a tag dir, or a Trainer
    ``checkpoint-N`` dir. Raises :class:`CheckpointError` naming what to pass instead."""
    src = os.path.abspath(src)
    if tag is not None:
        cand = os.path.join(src, guards.check_tag_name(tag, "--tag"))
        if is_tag_dir(cand):
            return cand, tag
        if os.path.basename(src) == tag and is_tag_dir(src):
            return src, tag
        raise CheckpointError(f"{cand}: tag {tag!r} does not exist or holds no DeepSpeed files; "
                              f"tags found: {list_tags(src) or 'none'}")
    latest = os.path.join(src, "latest")
    if os.path.lexists(latest):
        named = guards.read_latest(latest)  # a regular small file; never echoed beyond a short tag name
        cand = os.path.join(src, named)
        if not is_tag_dir(cand):
            raise CheckpointError(f"{latest}: names tag {named!r}, but {cand} does not exist or holds no "
                                  f"DeepSpeed files; pass --tag with one of: {list_tags(src) or 'none'}")
        return cand, named
    if is_tag_dir(src):
        return src, os.path.basename(src)
    tags = list_tags(src)
    if len(tags) == 1:
        return os.path.join(src, tags[0]), tags[0]
    if tags:
        raise CheckpointError(f"{src}: holds several tags ({', '.join(tags)}) and no 'latest' file; "
                              "pass --tag to choose one")
    raise CheckpointError(f"{src}: no DeepSpeed checkpoint found (no 'latest' file, no *_model_states.pt "
                          "or *_optim_states.pt); pass a DeepSpeed save dir, a tag dir or a Trainer "
                          "checkpoint-N dir")


def holds_checkpoint(path: str) -> bool:
    """True when a DeepSpeed checkpoint resolves in ``path`` without a tag (a Trainer checkpoint-N)."""
    try:
        resolve_tag_dir(path)
        return True
    except CheckpointError:
        return False


def list_tags(src: str) -> List[str]:
    try:
        return sorted(n for n in os.listdir(src) if is_tag_dir(os.path.join(src, n)))
    except OSError:
        return []


def claim(ranks: dict, rank: Optional[int], value: Any, tag_dir: str, name: str, name_of: object = None, *,
          what: str = "rank", canonical: Optional[str] = None) -> None:
    """Place a rank file (:func:`~...guards.claim_file`): two names for one rank (``mp_rank_0`` and
    ``mp_rank_00``) are refused, naming both."""
    guards.claim_file(ranks, rank, os.path.join(tag_dir, name), where=tag_dir, what=what, canonical=canonical,
                      value=value)


class RankFile:
    """One data-parallel rank of one model-parallel rank: its optimizer file, read lazily."""

    def __init__(self, path: str, dp_rank: int, prefix: str):
        self.path = path
        self.dp_rank = dp_rank
        self.prefix = prefix
        self._osd: Optional[Dict[str, Any]] = None

    @property
    def osd(self) -> Dict[str, Any]:
        if self._osd is None:
            obj = load(self.path)
            self._osd = require(obj, "optimizer_state_dict", self.path, "ZeRO optimizer")
            if not isinstance(self._osd, dict) or ("zero_stage" not in self._osd and
                                                   not is_bf16_optimizer_state(self._osd)):
                keys = sorted(map(str, self._osd))[:6] if isinstance(self._osd, dict) else type(self._osd).__name__
                raise CheckpointError(f"{self.path}: its optimizer state records neither 'zero_stage' (a ZeRO "
                                      "optimizer) nor BF16_Optimizer's fp32 partitions (it holds "
                                      f"{keys}); this optimizer's saves are not supported")
            check_optim_types(self._osd, self.path)
        return self._osd


def find_rank_files(tag_dir: str) -> Tuple[Dict[int, Dict[int, RankFile]], Dict[int, Dict[Optional[int], str]]]:
    """The rank files of ``tag_dir``: ``(optim, models)``, ``optim[mp][dp]`` a :class:`RankFile`,
    ``models[mp][dp]`` a model-states path (``dp`` None for ZeRO-1/2's one file per model-parallel
    rank). Without ZeRO and its optimizer files, ``optim[mp]`` is empty. Raises :class:`CheckpointError`/:class:`LayoutError` for an incomplete or mixed set."""
    names = sorted(os.listdir(tag_dir))
    guards.refuse_unreadable_layouts(tag_dir, names)
    optim: Dict[int, Dict[int, RankFile]] = {}
    prefixes = set()
    models: Dict[int, Dict[Optional[int], str]] = {}
    for n in names:
        m = OPTIM_RE.match(n)
        if m:
            prefix, dp_rank, mp_rank = m.group(1) or "", int(m.group(2)), int(m.group(3))
            prefixes.add(prefix)
            claim(optim.setdefault(mp_rank, {}), dp_rank, RankFile(os.path.join(tag_dir, n), dp_rank, prefix),
                  tag_dir, n, what=f"model-parallel rank {mp_rank}'s data-parallel rank",
                  canonical=optim_name(prefix, dp_rank, mp_rank))
        m = MODEL_RE.match(n)
        if m:
            model_dp = int(m.group(1)) if m.group(1) is not None else None
            claim(models.setdefault(int(m.group(2)), {}), model_dp, os.path.join(tag_dir, n), tag_dir, n,
                  what=f"the model states of model-parallel rank {int(m.group(2))}, data-parallel rank",
                  canonical=model_name(model_dp, int(m.group(2))))
    if not optim:  # no ZeRO (stage 0): the model-states files alone (see .stage0)
        optim = {mp: {} for mp in models}
    if len(prefixes) > 1:
        raise LayoutError(f"{tag_dir}: optimizer files of different precisions mixed "
                          f"({sorted(p or 'fp32' for p in prefixes)}); files from two saves were copied "
                          "together: keep only one save's files")
    mp_ranks = sorted(optim)
    if mp_ranks != list(range(len(mp_ranks))) or sorted(models) != mp_ranks:
        raise LayoutError(f"{tag_dir}: model-parallel ranks {mp_ranks} of optimizer files and "
                          f"{sorted(models)} of model files do not match 0..N-1; a rank file is missing: "
                          "copy the whole tag directory again")
    return optim, models
