"""``install_colossalai_hooks(booster)``: ``booster.save_model`` writes a loadable HF directory.

After the call, for a model boosted with ``HybridParallelPlugin`` (tensor, pipeline and data
parallel), ``booster.save_model(model, path, shard=True|False, size_per_shard=MB)`` keeps its
signature but writes ``path`` as a HuggingFace directory that ``from_pretrained(path)`` loads:

- safetensors shards (``model-0000K-of-0000N.safetensors`` + ``model.safetensors.index.json``)
  with ``shard=True``, one ``model.safetensors`` with ``shard=False`` (``path`` is then a
  directory too); ``config.json`` / ``generation_config.json`` from the model;
- every TP-sharded tensor gathered first, then its vocabulary padding cut to the recorded
  original length (:mod:`..sources.colossalai`: the pad records describe the global tensor) —
  whatever the installed ColossalAI's
  own save path does;
- streamed: each shard is written by the rank the writer assigns it to; only that rank receives
  the pieces, one tensor at a time; staged and merged into place when every rank succeeded.

Every rank must call ``save_model`` (as ColossalAI already requires). ``use_safetensors``,
``gather_dtensor``, ``prefix`` and ``use_async`` are ignored on this path (HF names, safetensors,
synchronous). Other plugins (LowLevelZero, Gemini, TorchDDP, TorchFSDP) keep the original
``save_model``; see ``docs/integrations/colossalai.md``.
"""

import functools
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from ..formats.config import write_config
from ..comm import default_comm
from ._dist import SAVE_CONSEQUENCE, write_distributed

if TYPE_CHECKING:
    import torch
    from colossalai.booster import Booster

    from ..sources.colossalai import TensorInfo

__all__ = ["install_colossalai_hooks", "save_model"]

logger = logging.getLogger(__name__)

_MIB = 1024 * 1024  # ColossalAI's size_per_shard is in MiB
_ONE_FILE = 1 << 62


def _supported(booster: "Booster") -> bool:
    from colossalai.booster.plugin import HybridParallelPlugin

    return isinstance(getattr(booster, "plugin", None), HybridParallelPlugin)


def save_model(model: "torch.nn.Module", checkpoint: str, *, shard: bool = False, size_per_shard: float = 1024,
               dtype: Optional[str] = None) -> Dict[str, Any]:
    """What the hooked ``booster.save_model`` runs. Collective: every rank calls it.

    Returns the writer's report. Raises :class:`~..comm.WriteError` on every rank when any failed.
    """
    from ..sources.colossalai import describe_model, live_plan

    if hasattr(model, "_force_wait_all_gather"):
        model._force_wait_all_gather()  # ZeRO overlap_allgather may still be filling the params
    module = model.unwrap() if hasattr(model, "unwrap") else model
    infos: "Optional[List[TensorInfo]]" = None
    error: Optional[Exception] = None
    try:
        infos = describe_model(module)
        _check_hub_layout(module, infos)
    except Exception as e:
        error = e
    comm = default_comm()
    comm.all_ok(error, f"booster.save_model into {checkpoint}: reading the layout", SAVE_CONSEQUENCE)
    assert infos is not None  # described on every rank, or all_ok raised
    max_shard_size = int(size_per_shard * _MIB) if shard else _ONE_FILE
    what = f"booster.save_model into {checkpoint}"
    # The writer assigns the shards and gives each read its writing rank (who receives each tensor).
    plan = live_plan(infos, module, dtype=dtype)
    report = write_distributed(plan, checkpoint, max_shard_size=max_shard_size, collective=True,
                               replace_existing=True, what=what)
    comm.on_rank0(lambda: write_config(checkpoint, model=module,  # (dtypes decided: the writer's plan)
                                       tensor_dtypes=[t.out_dtype for t in plan.tensors if t.out_dtype is not None]),
                  f"writing config.json into {checkpoint}", SAVE_CONSEQUENCE)
    return report


def _check_hub_layout(module: "torch.nn.Module", infos: "Sequence[TensorInfo]") -> None:
    """ColossalAI runs on transformers 4.x, where the names in memory are the Hub names; should a
    transformers that fuses weights in memory (5.x MoE experts) ever run here, refuse rather than
    write names only that version loads (this path gathers whole tensors; it does not split them)."""
    from ..errors import LayoutError
    from ..convert.hub_layout import live_layout

    for name, source, _, offset in live_layout(module, {i.name: tuple(i.shape) for i in infos}):
        if name != source or offset:
            raise LayoutError(f"{source}: save_pretrained writes it as {name} (a Hub-layout conversion) and the "
                              "ColossalAI hook does not convert; save with the booster's own save_model, or "
                              "use transformers 4.x")


def install_colossalai_hooks(booster: "Booster", *, dtype: Optional[str] = None) -> "Booster":
    """Make ``booster.save_model`` write HF directories (see module doc). Call once, right after
    ``Booster(plugin=...)``; calling again is a no-op. Returns ``booster``.

    ``dtype``: ``None`` writes each tensor in its training dtype (what ColossalAI writes);
    ``"fp32"``, ``"bf16"``, ``"fp16"`` cast floating tensors, one tensor at a time.
    """
    if getattr(booster, "_hf_ckpt_hooks", None):
        return booster
    original = booster.save_model

    @functools.wraps(original)
    def hooked_save_model(model: "torch.nn.Module", checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                          prefix: Optional[str] = None, size_per_shard: int = 1024, use_safetensors: bool = False,
                          use_async: bool = False) -> Optional[Dict[str, Any]]:
        if not _supported(booster):
            logger.warning("install_colossalai_hooks: %s is not handled; using ColossalAI's own save_model",
                           type(getattr(booster, "plugin", None)).__name__)
            return original(model, checkpoint, shard=shard, gather_dtensor=gather_dtensor, prefix=prefix,
                            size_per_shard=size_per_shard, use_safetensors=use_safetensors, use_async=use_async)
        return save_model(model, checkpoint, shard=shard, size_per_shard=size_per_shard, dtype=dtype)

    booster.save_model = hooked_save_model
    booster._hf_ckpt_hooks = {"original_save_model": original}
    return booster
