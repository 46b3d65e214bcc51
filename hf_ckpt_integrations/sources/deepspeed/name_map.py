"""Name maps from a pipeline's parameter names to HF names, as data (``name_maps/<model_type>.json``
or a user's file), and the TP merge rule each entry gives.

A pipeline-parallel model names its parameters ``"{layer index}.{name inside the layer}"``. A map
is a JSON object::

    {"model_type": "gpt_neox",                       # the HF config's model_type it is for
     "reference": "where the mapping comes from",
     "block_marker": "attention.query_key_value.weight",
     "tensors": [{"layer": "input_layernorm.weight",  # fnmatch pattern on the name inside the layer
                  "hf": "gpt_neox.layers.{block}.input_layernorm.weight",
                  "tp": "replicated"},                # "0" | "1" | "replicated" | "row_bias" (optional)
                 {"layer": "attention.rotary_emb.inv_freq", "drop": "why it is not written"}]}

``{block}`` is the transformer block number: the rank, in layer order, of the layer among the
layers holding a ``block_marker`` parameter; ``{layer}`` is the pipeline layer index itself.
``row_bias``: the bias of a row-parallel linear layer, which every TP rank holds whole; the model
adds it once after the all-reduce (one copy, checked equal) or, with GPT-NeoX's parallel residual
(``use_parallel_residual`` in the HF config), once per rank before it (the HF bias is the sum).
The first entry whose pattern matches decides; a name no entry matches is refused.
"""

import fnmatch
import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ... import guards
from ...errors import CheckpointError

__all__ = ["NameMap", "MapEntry", "load_map", "builtin_map", "builtin_types", "split_native", "TP_VALUES",
           "ROW_BIAS"]

ROW_BIAS = "row_bias"
TP_VALUES = ("0", "1", "replicated", ROW_BIAS)
_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "name_maps")
_MAX_MAP_BYTES = 1 << 20


@dataclass(frozen=True)
class MapEntry:
    layer: str
    hf: Optional[str]
    tp: Optional[str]
    drop: Optional[str]


@dataclass(frozen=True)
class NameMap:
    model_type: Optional[str]
    source: str  # where it was read from (shown by inspect)
    block_marker: Optional[str]
    entries: Tuple[MapEntry, ...]

    def blocks(self, layer_names: Dict[int, List[str]]) -> Dict[int, int]:
        """Layer index -> block number, for the layers holding the block marker."""
        marked = sorted(i for i, names in layer_names.items() if self.block_marker in names)
        return {layer: b for b, layer in enumerate(marked)}

    def lookup(self, layer: int, inner: str, blocks: Dict[int, int]) -> Optional[MapEntry]:
        """The first entry matching ``inner`` (the name inside layer ``layer``); None when none does.
        Raises ``ValueError`` when the entry needs a block number the layer has none of."""
        for e in self.entries:
            if fnmatch.fnmatchcase(inner, e.layer):
                if e.hf is not None and "{block}" in e.hf and layer not in blocks:
                    raise ValueError(f"{layer}.{inner}: map entry {e.layer!r} names a block, but layer {layer} holds "
                                     f"no {self.block_marker!r}")
                return e
        return None

    def hf_name(self, entry: MapEntry, layer: int, blocks: Dict[int, int]) -> str:
        return entry.hf.replace("{block}", str(blocks.get(layer, ""))).replace("{layer}", str(layer))


def split_native(name: str) -> Tuple[int, str]:
    """``"3.attention.dense.weight"`` -> ``(3, "attention.dense.weight")``; ValueError otherwise."""
    head, sep, inner = name.partition(".")
    if not sep or not head.isdigit() or not inner:
        raise ValueError(f"{name!r} is not a pipeline parameter name ('<layer index>.<name inside the layer>')")
    return int(head), inner


def _parse(obj, where: str) -> NameMap:
    if not isinstance(obj, dict) or not isinstance(obj.get("tensors"), list):
        raise ValueError(f"{where}: a name map is a JSON object with a 'tensors' list")
    marker = obj.get("block_marker")
    if marker is not None and not isinstance(marker, str):
        raise ValueError(f"{where}: 'block_marker' must be a string")
    entries = []
    for i, e in enumerate(obj["tensors"]):
        if not isinstance(e, dict) or not isinstance(e.get("layer"), str) or not e["layer"]:
            raise ValueError(f"{where}: tensors[{i}] needs a 'layer' pattern (a string)")
        drop = e.get("drop")
        hf, tp = e.get("hf"), e.get("tp")
        if drop is not None:
            if hf is not None or not isinstance(drop, str):
                raise ValueError(f"{where}: tensors[{i}] ({e['layer']}): 'drop' is a reason (a string), without 'hf'")
        elif not isinstance(hf, str) or not hf:
            raise ValueError(f"{where}: tensors[{i}] ({e['layer']}) needs an 'hf' name or a 'drop' reason")
        if tp is not None and (not isinstance(tp, str) or tp not in TP_VALUES):
            raise ValueError(f"{where}: tensors[{i}] ({e['layer']}): 'tp' must be one of {', '.join(TP_VALUES)}")
        if hf is not None and "{block}" in hf and marker is None:
            raise ValueError(f"{where}: tensors[{i}] ({e['layer']}) uses {{block}} but the map has no 'block_marker'")
        entries.append(MapEntry(e["layer"], hf, tp, drop))
    model_type = obj.get("model_type")
    return NameMap(model_type if isinstance(model_type, str) else None, where, marker, tuple(entries))


def load_map(path: str) -> NameMap:
    """A user's name map file; ``ValueError`` saying what is wrong with it."""
    try:
        with guards.open_regular(path, limit=_MAX_MAP_BYTES, what="the name map") as fh:  # a FIFO refuses, never hangs
            raw = fh.read(_MAX_MAP_BYTES + 1)
    except CheckpointError as e:
        raise ValueError(str(e)) from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the name map ({e.strerror})") from None
    if len(raw) > _MAX_MAP_BYTES:
        raise ValueError(f"{path}: a name map larger than {_MAX_MAP_BYTES} bytes")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return _parse(obj, path)


def builtin_types() -> List[str]:
    return sorted(n[:-5] for n in os.listdir(_DIR) if n.endswith(".json"))


def builtin_map(model_type) -> Optional[NameMap]:
    """The map shipped for an HF ``model_type``; None when there is none."""
    if not isinstance(model_type, str) or model_type not in builtin_types():
        return None
    with open(os.path.join(_DIR, f"{model_type}.json"), "rb") as fh:
        m = _parse(json.load(fh), f"built-in {model_type} map")
    return m
