"""HF file names, the shard split and the index file: what ``save_pretrained`` writes, to the letter.

``model.safetensors`` or ``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {tensor: file}}``); the ``.bin`` twins
``pytorch_model*.bin``; the config/tokenizer files ``from_pretrained`` and ``AutoTokenizer`` read;
and a PEFT adapter directory's ``adapter_config.json`` + ``adapter_model.safetensors``. Shard names
come from ``huggingface_hub``'s splitter (its ``filename_pattern``), never formatted here.
"""

import functools
import json
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Optional, Tuple, Union

from ..errors import CheckpointError, one_line
from ..guards import StrPath, open_regular

if TYPE_CHECKING:
    from huggingface_hub import StateDictSplit

INDEX_LIMIT = 256 * 2**20  # a weight index (JSON); a real one of a 1T-parameter model is a few MB

__all__ = ["SAFETENSORS_NAME", "SAFETENSORS_INDEX", "SAFETENSORS_PATTERN", "BIN_NAME", "BIN_INDEX", "BIN_PATTERN",
           "INDEX_NAMES", "SINGLE_NAMES", "CONFIG_FILES", "CONFIG_NAME", "GENERATION_CONFIG_NAME",
           "ADAPTER_CONFIG_NAME", "ADAPTER_SAFETENSORS_NAME", "ADAPTER_BIN_NAME", "SAVED_WEIGHTS_RE",
           "WEIGHT_FILES_RE", "MAX_SHARD_SIZE", "default_max_shard_size", "weight_names", "has_weights", "split_shards", "write_index", "read_index"]

SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_PATTERN = "model{suffix}.safetensors"
BIN_NAME = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_PATTERN = "pytorch_model{suffix}.bin"
INDEX_NAMES = (SAFETENSORS_INDEX, BIN_INDEX)  # in the order from_pretrained prefers them
SINGLE_NAMES = (SAFETENSORS_NAME, BIN_NAME)
# A max_shard_size of None (the default everywhere) means save_pretrained's own default in the
# installed transformers: :func:`default_max_shard_size`, read from its signature, never copied here.
MAX_SHARD_SIZE: Optional[Union[int, str]] = None

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
# Copied from a config directory when present: what from_pretrained and AutoTokenizer read.
CONFIG_FILES = (CONFIG_NAME, GENERATION_CONFIG_NAME, "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json",
                "vocab.txt", "merges.txt", "chat_template.jinja", "chat_template.json",
                "preprocessor_config.json")

# PeftModel.save_pretrained (peft's ``CONFIG_NAME``, ``SAFETENSORS_WEIGHTS_NAME``, ``WEIGHTS_NAME``).
ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_SAFETENSORS_NAME = "adapter_model.safetensors"
ADAPTER_BIN_NAME = "adapter_model.bin"

# Exactly the weight files save_pretrained / Accelerate write: what a save-time hook replaces as a whole.
SAVED_WEIGHTS_RE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                              r"pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)$")
# Any weight file of an HF directory, including other writers' numbering (ColossalAI's
# ``pytorch_model-00001.bin``): what the storage audit reads; never ``optimizer.pt`` & co.
WEIGHT_FILES_RE = re.compile(r"^(?:pytorch_model.*\.bin|model.*\.safetensors)$")


def split_shards(items: Dict[str, object], get_size: Callable[[object], int], *,
                 max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE,
                 pattern: str = SAFETENSORS_PATTERN) -> "StateDictSplit":
    """``huggingface_hub``'s split of ``items`` (name -> item, in the given order) into shards of at
    most ``max_shard_size`` (one item larger than that gets its own shard), so the file names and the
    split are the ones ``save_pretrained`` writes. Returns its ``StateDictSplit``."""
    from huggingface_hub import split_state_dict_into_shards_factory

    return split_state_dict_into_shards_factory(items, get_storage_size=get_size, filename_pattern=pattern,
                                                max_shard_size=max_shard_size if max_shard_size is not None
                                                else default_max_shard_size())


@functools.lru_cache(maxsize=1)
def default_max_shard_size() -> Union[int, str]:
    """``save_pretrained``'s default ``max_shard_size`` in the installed transformers, read from its
    signature (transformers 5: ``"50GB"``, 4.x: ``"5GB"``); without transformers,
    ``huggingface_hub``'s own default (what its ``save_torch_state_dict`` uses).

    The signature is read from the source of ``modeling_utils.py`` (the literal default of
    ``PreTrainedModel.save_pretrained``): importing transformers imports torch, seconds and hundreds
    of MB that an export served from the Hub-layout cache never needs. Where the source cannot be
    read that way, ``inspect.signature`` of the imported method answers."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        from huggingface_hub.serialization._base import MAX_SHARD_SIZE as HUB_DEFAULT

        return HUB_DEFAULT
    found = _literal_default(os.path.join(list(spec.submodule_search_locations)[0], "modeling_utils.py"),
                             "PreTrainedModel", "save_pretrained", "max_shard_size")
    if found is not None:
        return found
    import inspect

    from transformers import PreTrainedModel

    return inspect.signature(PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


def _literal_default(path: str, cls: str, method: str, arg: str) -> Any:
    """The default of ``arg`` in ``cls.method`` as written in the Python file ``path``, when it is a
    literal; None otherwise."""
    import ast

    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == method:
                    args = fn.args
                    positional = args.posonlyargs + args.args
                    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
                    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
                    for a, d in pairs:
                        if a.arg == arg:
                            try:
                                return ast.literal_eval(d)
                            except ValueError:
                                return None
    return None


def write_index(directory: StrPath, weight_map: Dict[str, str], *, total_size: int, total_parameters: Optional[int] = None,
                name: str = SAFETENSORS_INDEX) -> str:
    """Write the index ``name`` into ``directory``: ``{"metadata": {"total_size": ...,
    ["total_parameters": ...]}, "weight_map": {...}}`` (keys sorted, as transformers writes it).
    Returns its path."""
    meta: Dict[str, int] = {"total_size": total_size}
    if total_parameters is not None:
        meta["total_parameters"] = total_parameters
    path = os.path.join(directory, name)
    from ..outfiles import open_new

    with open_new(path, "w", encoding="utf-8") as fh:  # a new file: never through a planted link
        json.dump({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2, sort_keys=True)
        fh.write("\n")
    return path


def read_index(path: StrPath) -> Dict[str, str]:
    """The ``weight_map`` of the index file ``path``: tensor name -> file name, each a plain name in
    the same directory (never a path that leads out of it). Raises
    :class:`~..errors.CheckpointError` naming the index otherwise."""
    try:
        with open_regular(path, limit=INDEX_LIMIT, what="the weight index") as fh:  # a FIFO refuses, never hangs
            weight_map = json.loads(fh.read(INDEX_LIMIT + 1).decode("utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable index ({one_line(str(e))[:200]}); save the model again") from e
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{path}: 'weight_map' is not a mapping of tensor names to file names; save the "
                              "model again")
    bad = sorted(f for f in set(weight_map.values()) if not f or f in (".", "..") or "/" in f or "\\" in f
                 or "\0" in f)
    if bad:
        raise CheckpointError(f"{path}: names weight file {one_line(bad[0][:64])!r}, which is not a file name "
                              "in this directory; save the model again")
    return weight_map


def weight_names(directory: StrPath, *, formats: Collection[str] = ("safetensors", "bin")
                 ) -> Optional[Tuple[str, Optional[str], List[str]]]:
    """``(kind, index_or_None, [weight file names])`` of the HF directory ``directory``, taking the
    first of (safetensors index, single safetensors, bin index, single bin) that exists, as
    ``from_pretrained`` does; None when it holds none. The index is read and checked
    (:func:`read_index`)."""
    for kind, index, single in (("safetensors", SAFETENSORS_INDEX, SAFETENSORS_NAME), ("bin", BIN_INDEX, BIN_NAME)):
        if kind not in formats:
            continue
        if os.path.isfile(os.path.join(directory, index)):
            return kind, index, sorted(set(read_index(os.path.join(directory, index)).values()))
        if os.path.isfile(os.path.join(directory, single)):
            return kind, None, [single]
    return None


def has_weights(directory: StrPath) -> bool:
    """True when ``directory`` holds an HF index or single weight file (safetensors or bin)."""
    return any(os.path.isfile(os.path.join(directory, n)) for n in INDEX_NAMES + SINGLE_NAMES)

