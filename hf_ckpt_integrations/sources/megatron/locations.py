"""Where a Megatron dist_checkpointing save is: verl's and NeMo 2's layouts around the same directory
Megatron-LM keeps in ``iter_NNNNNNN/`` (split from layout.py by job)."""
import os
from typing import Dict, Optional, Tuple

from ...errors import LayoutError
from .. import dcp
from .layout import MCORE_META, GlobalTensor, Save


# ---------------------------------------------------------------- where the save is: verl, NeMo 2 (issue 37)
# Megatron-Core's dist_checkpointing.save writes the same directory whoever calls it; only its name and
# its parents differ. verl (MegatronCheckpointManager): global_step_N/actor/dist_ckpt/ beside
# actor/huggingface/ (config.json + tokenizer), plain mcore keys, common.pt without Megatron-LM's args.
# NeMo 2 (MegatronStrategy / MegatronCheckpointIO): <ckpt>/weights/ beside <ckpt>/context/ (io.json,
# model.yaml, nemo_tokenizer/), model keys under the Lightning wrapper's "module." prefix.

VERL_DIST, VERL_HF = "dist_ckpt", "huggingface"
NEMO_WEIGHTS, NEMO_CONTEXT = "weights", "context"
MODULE_PREFIX = "module."


def _dist_backend(path: str) -> bool:
    """``path`` is a dist_checkpointing directory: ``.metadata`` beside a ``metadata.json`` (whatever its
    backend: a wrong one is refused by name when read, not taken for a plain DCP save)."""
    return os.path.isfile(os.path.join(path, MCORE_META)) and os.path.isfile(os.path.join(path, dcp.METADATA))


def dist_dir(path: str) -> Optional[Tuple[str, str]]:
    """``(directory, kind)`` of a dist_checkpointing save found at ``path`` outside Megatron-LM's
    ``iter_NNNNNNN/`` layout: kind ``"verl"`` (``path`` is ``actor/`` or its ``dist_ckpt/``), ``"nemo2"``
    (``path`` is the checkpoint holding ``weights/`` + ``context/``, or its ``weights/``), ``"mcore"`` (any
    other directory holding the files); None otherwise."""
    if not os.path.isdir(path):
        return None
    norm = os.path.abspath(path)
    if _dist_backend(norm):
        parent, base = os.path.split(norm)
        if base == VERL_DIST:
            return norm, "verl"
        if base == NEMO_WEIGHTS and os.path.isdir(os.path.join(parent, NEMO_CONTEXT)):
            return norm, "nemo2"
        return norm, "mcore"
    cand = os.path.join(norm, VERL_DIST)
    if _dist_backend(cand):
        return cand, "verl"
    cand = os.path.join(norm, NEMO_WEIGHTS)
    if _dist_backend(cand) and os.path.isdir(os.path.join(norm, NEMO_CONTEXT)):
        return cand, "nemo2"
    return None


def verl_hf_dir(dist: str) -> Optional[str]:
    """verl's ``huggingface/`` directory beside ``dist_ckpt/`` when it holds a config.json."""
    cand = os.path.join(os.path.dirname(os.path.abspath(dist)), VERL_HF)
    return cand if os.path.isfile(os.path.join(cand, "config.json")) else None


def strip_module_prefix(save: Save) -> Save:
    """NeMo 2's keys (``module.decoder.layers...``) as Megatron-LM's: the prefix goes when every model key
    carries it; a save where only some do is refused naming one of each."""
    names = list(save.tensors)
    with_p = [n for n in names if n.startswith(MODULE_PREFIX)]
    if not with_p:
        return save
    without = [n for n in names if not n.startswith(MODULE_PREFIX)]
    if without:
        raise LayoutError(f"{os.path.join(save.ckpt_dir, dcp.METADATA)}: some model keys carry NeMo's 'module.' "
                          f"prefix ({with_p[0]!r}) and some do not ({without[0]!r}); the save mixes two models "
                          "or was edited: re-save it from one model")
    out: Dict[str, GlobalTensor] = {}
    for n in names:
        g = save.tensors[n]
        new = n[len(MODULE_PREFIX):]
        out[new] = GlobalTensor(new, g.shape, g.dtype, g.chunks)
    save.tensors = out
    save.layout["key_prefix"] = MODULE_PREFIX
    return save
