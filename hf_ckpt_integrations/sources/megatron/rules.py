"""Megatron-Core names -> HF names, as data (:data:`RULES`), executed as box selections.

Each rule: ``(megatron name, operation, HF name template(s))``; ``{L}`` is the global layer index of
a stacked ``decoder.layers.X`` tensor (its leading axis). Operations (all of them take boxes of the
global tensor, :func:`select_box`, so the export stays a byte-range copy and no tensor is assembled
to take a part of it):

- ``whole``: the tensor as is; ``vocab``: its first ``vocab_size`` rows (Megatron pads the vocabulary
  to a multiple of ``make_vocab_size_divisible_by x TP``; the padding is dropped after the TP slices are
  placed, seed 003's lesson);
- ``layer``: layer ``L`` of a stacked tensor;
- ``qkv``: layer ``L`` of ``linear_qkv``, interleaved per query group ``[q x heads/groups, k, v] x groups``
  (``kv_channels`` rows each): q/k/v are each one box per group, concatenated;
- ``halves``: layer ``L`` of a gated ``linear_fc1`` ``[gate; up]`` (global order; the legacy files'
  per-TP-slice ``[gate_r; up_r]`` is placed globally by :mod:`.layout`).

The conversion layer of issue 36 (rules as data for every source) was not merged when this was
written; these rules are the same kind of data and move into it unchanged.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from ... import boxes
from ...errors import CheckpointError
from ...plan import Chunk, TensorPlan, row_major_pieces
from .layout import GlobalTensor

_LAYER = "model.layers.{L}."
_LLAMA = (
    ("embedding.word_embeddings.weight", "vocab", "model.embed_tokens.weight"),
    ("decoder.layers.self_attention.linear_qkv.layer_norm_weight", "layer", _LAYER + "input_layernorm.weight"),
    ("decoder.layers.self_attention.linear_qkv.weight", "qkv",
     tuple(_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv")),
    ("decoder.layers.self_attention.linear_qkv.bias", "qkv", tuple(_LAYER + f"self_attn.{p}_proj.bias" for p in "qkv")),
    ("decoder.layers.self_attention.linear_proj.weight", "layer", _LAYER + "self_attn.o_proj.weight"),
    ("decoder.layers.mlp.linear_fc1.layer_norm_weight", "layer", _LAYER + "post_attention_layernorm.weight"),
    ("decoder.layers.mlp.linear_fc1.weight", "halves", (_LAYER + "mlp.gate_proj.weight", _LAYER + "mlp.up_proj.weight")),
    ("decoder.layers.mlp.linear_fc2.weight", "layer", _LAYER + "mlp.down_proj.weight"),
    ("decoder.final_layernorm.weight", "whole", "model.norm.weight"),
    ("output_layer.weight", "vocab", "lm_head.weight"),
)
# family -> rules. Qwen2 is Llama's layout with q/k/v biases (the linear_qkv.bias rule).
RULES: Dict[str, Tuple[Tuple[str, str, object], ...]] = {"llama": _LLAMA, "qwen2": _LLAMA}


def select_box(t: GlobalTensor, lo: Sequence[int], hi: Sequence[int]) -> List[Chunk]:
    """The box ``[lo, hi)`` of ``t`` as chunks placed relative to ``lo`` (:func:`~..boxes.select_box`,
    the one box helper: metadata only)."""
    return boxes.select_box(t.shape, t.chunks, lo, hi)


def _shift(chunks: List[Chunk], drop_lead: bool, row_at: int) -> List[Chunk]:
    out = []
    for c in chunks:
        off, sz = (c.offsets[1:], c.sizes[1:]) if drop_lead else (c.offsets, c.sizes)
        if off:
            off = (off[0] + row_at,) + tuple(off[1:])
        out.append(Chunk(c.pieces, tuple(off), tuple(sz)))
    return out


def _tensor(name: str, shape, dtype, chunks: List[Chunk]) -> TensorPlan:
    flat = row_major_pieces(shape, chunks)
    if flat is not None:  # whole rows: a byte-range copy
        return TensorPlan(name, tuple(shape), dtype, [flat], kind="module")
    return TensorPlan.from_chunks(name, tuple(shape), dtype, chunks, kind="module")


def _rows(t: GlobalTensor, layer: Optional[int], segments: List[Tuple[int, int]]):
    """Rows ``segments`` (each ``[a, b)``) of ``t`` (of its layer ``layer`` when stacked), concatenated."""
    chunks, at = [], 0
    for a, b in segments:
        if layer is None:
            lo, hi = (a,) + (0,) * (len(t.shape) - 1), (b,) + tuple(t.shape[1:])
        else:
            lo, hi = (layer, a) + (0,) * (len(t.shape) - 2), (layer + 1, b) + tuple(t.shape[2:])
        chunks += _shift(select_box(t, lo, hi), layer is not None, at)
        at += b - a
    inner = t.shape[2:] if layer is not None else t.shape[1:]
    return (at,) + tuple(inner), chunks


def apply(family: str, tensors: Dict[str, GlobalTensor], *, vocab_size: int, heads: int, groups: int,
          head_dim: int) -> Tuple[List[TensorPlan], Dict[str, Tuple[int, int]], List[str]]:
    """The output tensors of ``tensors`` under ``RULES[family]``: ``(tensors, padding removed, names
    used)``. A model tensor no rule names is refused (exporting without it would lose weights)."""
    rules = RULES[family]
    out: List[TensorPlan] = []
    padding: Dict[str, Tuple[int, int]] = {}
    used = []
    for src, op, hf in rules:
        t = tensors.get(src)
        if t is None:
            continue
        used.append(src)
        if op in ("whole", "vocab"):
            rows = t.shape[0]
            if op == "vocab":
                if vocab_size > rows:
                    raise CheckpointError(f"{src}: {rows} rows, fewer than the config's vocab_size {vocab_size}; "
                                          "pass --config DIR of this model")
                padding[hf] = (rows, vocab_size)
                rows = vocab_size
            shape, chunks = _rows(t, None, [(0, rows)])
            out.append(_tensor(hf, shape, t.dtype, chunks))
            continue
        for layer in range(t.shape[0]):
            names = [h.replace("{L}", str(layer)) for h in ((hf,) if isinstance(hf, str) else hf)]
            n = t.shape[1] if len(t.shape) > 1 else 0
            if op == "layer":
                lo, hi = (layer,) + (0,) * (len(t.shape) - 1), (layer + 1,) + tuple(t.shape[1:])
                chunks = _shift(select_box(t, lo, hi), True, 0)
                out.append(_tensor(names[0], t.shape[1:], t.dtype, chunks))
            elif op == "halves":
                for k, name in enumerate(names):
                    shape, chunks = _rows(t, layer, [(k * n // 2, (k + 1) * n // 2)])
                    out.append(_tensor(name, shape, t.dtype, chunks))
            elif op == "qkv":
                per = heads // groups
                block = (per + 2) * head_dim
                if n != groups * block:
                    raise CheckpointError(f"{src}: {n} rows, but {groups} query groups of {per} heads x {head_dim} "
                                          f"need {groups * block}; the config does not match the save")
                spans = ((0, per * head_dim), (per * head_dim, (per + 1) * head_dim),
                         ((per + 1) * head_dim, block))
                for name, (a, b) in zip(names, spans):
                    shape, chunks = _rows(t, layer, [(g * block + a, g * block + b) for g in range(groups)])
                    out.append(_tensor(name, shape, t.dtype, chunks))
            else:
                raise AssertionError(op)
    return out, padding, used
