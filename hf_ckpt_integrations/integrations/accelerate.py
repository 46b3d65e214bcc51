"""``install_accelerate_hooks(accelerator)``: ``accelerator.save_model`` writes a complete, lean HF directory.

After the call, ``accelerator.save_model(model, dir, max_shard_size=..., safe_serialization=...)``
keeps its signature and meaning, but (for DeepSpeed ZeRO-1/2/3 with or without AutoTP, DDP and
single-process models):

- weights come from :mod:`..sources.live`: under ZeRO-3 each parameter's partitions are sent one
  at a time to the rank writing its shard (point to point; broadcast under AutoTP) and streamed
  into the shard, never the whole parameter (works with
  ``stage3_gather_16bit_weights_on_model_save`` false, where Accelerate raises ``ValueError``);
  under ZeRO-1/2 each parameter's own bytes are read in place (no ``clone_tensors_for_torch_save``
  of the whole state dict); under AutoTP each layer's slices are gathered when its tensors are
  written (full shapes: the uneven vocab split is undone);
- shards are spread over the ranks (the writer's assignment: shard ``i`` by rank ``i % world_size``
  from ``torch.distributed``), staged, and merged into place only when every rank succeeded;
- ``safe_serialization=False`` writes ``pytorch_model*.bin`` whose tensors own exactly their
  bytes (one shard in memory at a time): ``torch.save`` of a view into ZeRO's flat buffer would
  write the whole buffer;
- ``config.json`` (and ``generation_config.json``) is written when the model has a ``config``.

Every rank must call ``save_model`` (as Accelerate already requires under DeepSpeed).

With ``save_state_weights=True`` a save-state pre-hook also makes each ``accelerator.save_state(dir)``
directory loadable with ``from_pretrained(dir)``: under DeepSpeed the HF weights are written from
the ZeRO checkpoint ``save_state`` has just written (the exact state ``load_state`` restores).

Not handled (the original ``save_model`` runs): FSDP, XLA, Megatron-LM — see
``docs/integrations/accelerate.md``.
"""

import functools
import logging
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Union

from ..formats.config import write_config
from ..dtype_rule import request, trained_dtype
from ..formats.dtypes import to_user
from ..writer import MAX_SHARD_SIZE
from ..comm import WriteError, default_comm
from ._dist import consolidate_checkpoint, write_config_on_rank0, write_distributed

if TYPE_CHECKING:
    import torch
    from accelerate import Accelerator

__all__ = ["install_accelerate_hooks", "save_model"]

logger = logging.getLogger(__name__)


def _accelerate_default_shard() -> Union[int, str]:
    """``accelerator.save_model``'s own default ``max_shard_size``, read from its signature."""
    import inspect

    from accelerate import Accelerator

    return inspect.signature(Accelerator.save_model).parameters["max_shard_size"].default


def _supported(accelerator: "Accelerator") -> bool:
    from accelerate.utils import DistributedType

    dt = accelerator.distributed_type
    if dt == DistributedType.FSDP:  # FSDP2 (DTensor parameters) only; FSDP1's flat parameters are not read live
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        return getattr(plugin, "fsdp_version", 1) == 2
    return dt in (DistributedType.DEEPSPEED, DistributedType.NO, DistributedType.MULTI_CPU,
                  DistributedType.MULTI_GPU)


def save_model(accelerator: "Accelerator", model: "torch.nn.Module", save_directory: str,
               max_shard_size: Optional[Union[int, str]] = None, safe_serialization: bool = True, *,
               dtype: Optional[str] = None) -> Dict[str, Any]:
    """What the hooked ``accelerator.save_model`` runs. Collective: every rank calls it.

    ``dtype``: ``None`` keeps the training dtype of each tensor. ``max_shard_size``: None is
    ``accelerator.save_model``'s own default. Returns the writer's report.
    Raises :class:`~..comm.WriteError` on every rank when any rank failed.
    """
    from ..sources.live import live_tensors, reads_are_collective

    if os.path.isfile(save_directory):
        raise WriteError("accelerator.save_model", {default_comm().rank: f"{save_directory} is a file, not a directory"})
    module = accelerator.unwrap_model(model)
    from .peft import is_peft_model, save_adapter_live

    if is_peft_model(module):  # only the adapter, as PeftModel.save_pretrained writes it
        return save_adapter_live(module, save_directory, dtype=dtype)
    plan = live_tensors(module, dtype=dtype)
    if max_shard_size is None:
        max_shard_size = _accelerate_default_shard()
    report = write_distributed(plan, save_directory, max_shard_size=max_shard_size,
                               collective=reads_are_collective(module), replace_existing=True,
                               fmt="safetensors" if safe_serialization else "bin",
                               what=f"accelerator.save_model into {save_directory}")
    write_config_on_rank0(module, save_directory, plan)
    return report


def _save_state_pre_hook(accelerator: "Accelerator", dtype: Optional[str], max_shard_size: Optional[Union[int, str]]
                         ) -> Callable[[List["torch.nn.Module"], List[Dict[str, Any]], str], None]:
    def hook(models: List["torch.nn.Module"], weights: List[Dict[str, Any]], output_dir: str) -> None:
        from accelerate.utils import DistributedType

        if accelerator.distributed_type != DistributedType.DEEPSPEED:
            # Accelerate writes model.safetensors itself here; make it loadable with the config.
            if default_comm().rank == 0 and models:
                write_config(output_dir, model=accelerator.unwrap_model(models[0]))
            return
        # save_state has already run model.save_checkpoint(output_dir, "pytorch_model") on all ranks.
        module = accelerator.unwrap_model(models[0])
        write_config_on_rank0(module, output_dir)
        consolidate_checkpoint(output_dir, tag="pytorch_model",
                               dtype=to_user(request(dtype, training=trained_dtype(module))),
                               max_shard_size=max_shard_size,
                               what=f"accelerator.save_state HF copy in {output_dir}")
    return hook


def install_accelerate_hooks(accelerator: "Accelerator", *, dtype: Optional[str] = None,
                             save_state_weights: bool = False,
                             state_max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE) -> "Accelerator":
    """Make ``accelerator.save_model`` (and, with ``save_state_weights``, ``save_state``) write lean,
    complete HF directories. Call once, right after ``Accelerator(...)``; calling again is a no-op.

    ``dtype``: ``None`` = each tensor's training dtype (what Accelerate writes); ``"fp32"``,
    ``"bf16"``, ``"fp16"`` cast floating tensors. For the save-state copy, ``dtype="fp32"`` takes
    the fp32 master weights from the ZeRO checkpoint. Returns ``accelerator``.
    """
    if getattr(accelerator, "_hf_ckpt_hooks", None):
        return accelerator
    original = accelerator.save_model

    @functools.wraps(original)
    def hooked_save_model(model: "torch.nn.Module", save_directory: str,
                          max_shard_size: Optional[Union[int, str]] = _accelerate_default_shard(),
                          safe_serialization: bool = True) -> Optional[Dict[str, Any]]:
        if not _supported(accelerator):
            return original(model, save_directory, max_shard_size=max_shard_size,
                            safe_serialization=safe_serialization)
        return save_model(accelerator, model, save_directory, max_shard_size, safe_serialization, dtype=dtype)

    accelerator.save_model = hooked_save_model
    handles: List[Any] = []  # accelerate's RemovableHandle s
    if save_state_weights:
        handles.append(accelerator.register_save_state_pre_hook(
            _save_state_pre_hook(accelerator, dtype, state_max_shard_size)))
    accelerator._hf_ckpt_hooks = {"original_save_model": original, "handles": handles}
    return accelerator
