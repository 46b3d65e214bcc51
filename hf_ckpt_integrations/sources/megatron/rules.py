"""Megatron-Core names -> HF names: the rules files (``rules/<family>.json``, docs/conversions.md's
format) run by the shared conversion layer (:func:`~...convert.execute.apply_rules`).

The source gives the rules its global tensors (:mod:`.layout`: torch_dist's names, TP slices and
pipeline stages already placed, layers stacked) as plans tiled by chunks; every operation then
selects boxes of them (an unstacked layer, the interleaved q/k/v rows per query group, the halves
of a gated ``linear_fc1``, the first ``vocab_size`` rows), so the export stays a byte-range copy and
no tensor is assembled to take a part of it.
"""

import os
from typing import Dict, List, Mapping, Tuple

from ... import boxes
from ...convert.execute import Converted, apply_rules
from ...convert.rules import RuleSet, load_rules
from ...errors import CheckpointError
from ...plan import Chunk, TensorPlan
from .layout import GlobalTensor

RULES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rules")
# family -> its rules file. Qwen2 is Llama's layout with q/k/v biases (llama.json's linear_qkv.bias rule).
FILES: Dict[str, str] = {"llama": "llama.json", "qwen2": "llama.json", "gpt": "gpt.json"}
FILES["mixtral"] = "mixtral.json"  # MoE: router + SequentialMLP experts (stacked [layers, experts, ...])
FILES["qwen2_moe"] = "qwen2_moe.json"  # the same + q/k/v biases + a gated shared expert
_LOADED: Dict[str, RuleSet] = {}
# The tensors whose rows are the (padded) vocabulary: the rules keep the first vocab_size rows.
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def rules_for(family: str) -> RuleSet:
    """The parsed rules of ``family`` (loaded once)."""
    name = FILES[family]
    if name not in _LOADED:
        _LOADED[name] = load_rules(os.path.join(RULES_DIR, name))
    return _LOADED[name]


def select_box(t: GlobalTensor, lo: Tuple[int, ...], hi: Tuple[int, ...]) -> List[Chunk]:
    """The box ``[lo, hi)`` of ``t`` as chunks placed relative to ``lo`` (:func:`~...boxes.select_box`,
    the one box helper: metadata only)."""
    return boxes.select_box(t.shape, t.chunks, lo, hi)


def as_plan(t: GlobalTensor) -> TensorPlan:
    """A global tensor as the plan the rules take (its chunks, model weights)."""
    return TensorPlan.from_chunks(t.name, t.shape, t.dtype, t.chunks, kind="module")


def apply(family: str, tensors: Mapping[str, GlobalTensor], params: Mapping[str, object]) -> Converted:
    """The HF tensors of ``tensors`` under ``family``'s rules file. A vocabulary tensor with fewer rows
    than the config's ``vocab_size`` is refused here (the rules would keep it whole)."""
    vocab = params.get("vocab_size")
    for name in VOCAB_TENSORS:
        t = tensors.get(name)
        if t is not None and isinstance(vocab, int) and t.shape[0] < vocab:
            raise CheckpointError(f"{name}: {t.shape[0]} rows, fewer than the config's vocab_size {vocab}; "
                                  "pass --config DIR of this model")
    return apply_rules(rules_for(family), {n: as_plan(t) for n, t in tensors.items()}, params)
