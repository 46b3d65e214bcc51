"""``ConsolidatedCheckpointCallback``: every Trainer ``checkpoint-N/`` also holds loadable HF weights.

When ``on_save`` fires, the Trainer has already written ``checkpoint-N/`` including DeepSpeed's
``global_stepN/`` (every rank's partition files, behind DeepSpeed's closing barrier) or, under FSDP
with ``SHARDED_STATE_DICT``, ``pytorch_model_fsdp_0/`` (torch DCP, behind ``dcp.save``'s barrier;
the callback also writes ``config.json`` from the model, which the Trainer does not write there). The callback
builds the export plan from those files — exactly the state a resume loads — and writes the HF
shards with the writer's building blocks, spread over the ranks (see :mod:`._dist`). Nothing is
gathered in memory: each rank streams byte ranges of the partition files.

Decisions (documented in ``docs/integrations/trainer.md``):

- **dtype**: default is the training dtype of the module weights (``model`` parameter dtype at save
  time), what ``save_pretrained`` would have written; ``dtype="fp32"`` writes the fp32 masters.
- **Weights the Trainer already wrote** (ZeRO-1/2, or ZeRO-3 with
  ``stage3_gather_16bit_weights_on_model_save``): kept when they already have the target dtype
  (same bytes, no second write), replaced as a whole otherwise (``existing="replace"`` always
  replaces).
- **Final model**: ``trainer.save_model()`` is not a callback event. Use :func:`save_model`
  (or ``callback.save_model(trainer)``) instead of ``trainer.save_model()``; with
  ``checkpoints="last"`` only the last checkpoint of the run is consolidated, at ``on_train_end``.
"""

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, Optional, Union

from transformers import TrainerCallback

from ..dtype_rule import request, trained_dtype
from ..formats.dtypes import from_user as dtype_from_name, to_user, training_dtype
from ..sources import dcp
from ..sources.registry import engine_checkpoint
from ..writer import MAX_SHARD_SIZE
from ..comm import default_comm
from ._dist import consolidate_checkpoint, existing_weights, write_config_on_rank0

if TYPE_CHECKING:
    import torch
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

__all__ = ["ConsolidatedCheckpointCallback", "consolidate_checkpoint", "save_model", "training_dtype"]

logger = logging.getLogger(__name__)

def _has_engine_checkpoint(directory: str) -> bool:
    """The directory holds a training engine's checkpoint (the source registry says which)."""
    return engine_checkpoint(directory) is not None


def _has_dcp(directory: str) -> bool:
    """An FSDP checkpoint (``pytorch_model_fsdp_0/``, torch DCP): the Trainer writes no config.json beside it."""
    return engine_checkpoint(directory) == dcp.NAME


def _consolidate_engine_checkpoint(directory: str, model: "Optional[torch.nn.Module]", **kwargs: Any) -> Dict[str, Any]:
    """HF weights (and, for an FSDP checkpoint, config.json from ``model``) into ``directory`` from the
    engine checkpoint the Trainer has just written there. Collective."""
    if model is not None and _has_dcp(directory):  # the same answer on every rank (the DCP save is behind)
        write_config_on_rank0(model, directory, keep_existing=True)
    return consolidate_checkpoint(directory, **kwargs)


def save_model(trainer: "Trainer", output_dir: Optional[str] = None, *, dtype: Optional[str] = None,
               max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE, existing: str = "auto") -> Dict[str, Any]:
    """``trainer.save_model(output_dir)``, then make ``output_dir`` loadable with ``from_pretrained``.

    Call it on every rank where you would call ``trainer.save_model()``. Under ZeRO-3 without
    ``stage3_gather_16bit_weights_on_model_save`` the Trainer writes a DeepSpeed checkpoint there
    and no weights; this writes them from it. Otherwise the Trainer's own weights are kept (or
    replaced when ``dtype`` asks for another dtype and a DeepSpeed checkpoint is there).
    ``dtype`` defaults to the training dtype.
    """
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    trainer.save_model(output_dir)
    default_comm().barrier()
    from .peft import consolidate_adapter, is_peft_model

    if is_peft_model(trainer.model) and _has_engine_checkpoint(output_dir):
        return consolidate_adapter(output_dir, trainer.model, dtype=dtype)
    if not _has_engine_checkpoint(output_dir):
        return {"action": "kept", "files": existing_weights(output_dir)}
    return _consolidate_engine_checkpoint(output_dir, trainer.model, dtype=_default_dtype(dtype, trainer.model),
                                          max_shard_size=max_shard_size, existing=existing)


def _default_dtype(dtype: Optional[str], model: "Optional[torch.nn.Module]") -> Optional[str]:
    """The dtype asked for, by default the training dtype (:func:`~..dtype_rule.request`): what
    ``save_pretrained`` of the trained model writes (its fp32-kept modules still from the masters)."""
    return to_user(request(dtype, training=trained_dtype(model)))


class ConsolidatedCheckpointCallback(TrainerCallback):
    """Make every ``checkpoint-N/`` the Trainer saves loadable with ``from_pretrained``.

    ``Trainer(..., callbacks=[ConsolidatedCheckpointCallback()])``. Options (keyword-only):

    - ``dtype``: ``None`` = the training dtype of the module weights; ``"fp32"`` = the fp32 masters;
      ``"bf16"``/``"fp16"``.
    - ``max_shard_size``: as ``save_pretrained``; None (default): the installed transformers'
      ``save_pretrained`` default (:func:`~..formats.names.default_max_shard_size`).
    - ``checkpoints``: ``"every"`` (each save, in ``on_save``) or ``"last"`` (only the run's last
      checkpoint, in ``on_train_end``).
    - ``existing``: ``"auto"`` (keep the Trainer's weights when they have the target dtype) or
      ``"replace"``.

    Every rank runs the callback (the Trainer calls callbacks on all ranks); the write is collective.
    A failure on any rank raises :class:`~..comm.WriteError` on every rank.
    """

    def __init__(self, *, dtype: Optional[str] = None, max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE,
                 checkpoints: str = "every", existing: str = "auto") -> None:
        if checkpoints not in ("every", "last"):
            raise ValueError(f"checkpoints={checkpoints!r}; use 'every' or 'last'")
        dtype_from_name(dtype)  # validate early
        self.dtype = dtype
        self.max_shard_size = max_shard_size
        self.checkpoints = checkpoints
        self.existing = existing
        self.last_checkpoint: Optional[str] = None
        self.reports: Dict[str, Dict[str, Any]] = {}  # checkpoint directory -> its report

    def _consolidate(self, directory: str, model: "Optional[torch.nn.Module]") -> Dict[str, Any]:
        if not _has_engine_checkpoint(directory):
            # Not a DeepSpeed run: the Trainer's own save_pretrained output is already loadable.
            return {"action": "kept", "files": existing_weights(directory)}
        from .peft import consolidate_adapter, is_peft_model

        if is_peft_model(model):  # the adapter directory PeftModel.save_pretrained writes, no model.safetensors
            report = self.reports[directory] = consolidate_adapter(directory, model, dtype=self.dtype)
            return report
        dtype = _default_dtype(self.dtype, model)
        report = _consolidate_engine_checkpoint(directory, model, dtype=dtype, max_shard_size=self.max_shard_size,
                                                existing=self.existing)
        self.reports[directory] = report
        logger.info("hf_ckpt_integrations: %s HF weights in %s", report["action"], directory)
        return report

    def on_save(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                model: "Optional[torch.nn.Module]" = None, **kwargs: Any) -> "TrainerControl":
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        # Same path _save_checkpoint used (no hyperparameter search: run_dir == output_dir).
        directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.last_checkpoint = directory
        if self.checkpoints == "every":
            self._consolidate(directory, model)
        return control

    def on_train_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                     model: "Optional[torch.nn.Module]" = None, **kwargs: Any) -> "TrainerControl":
        if self.checkpoints == "last" and self.last_checkpoint and os.path.isdir(self.last_checkpoint):
            self._consolidate(self.last_checkpoint, model)
        return control

    def save_model(self, trainer: "Trainer", output_dir: Optional[str] = None) -> Dict[str, Any]:
        """:func:`save_model` with this callback's options."""
        return save_model(trainer, output_dir, dtype=self.dtype, max_shard_size=self.max_shard_size,
                          existing=self.existing)
