"""The Python API: the same three operations as the CLI."""

from typing import Optional

from .guards import bad_metadata_as_input
from .sources import build_plan
from .verify import VerifyReport, verify_plan
from .writer import MAX_SHARD_SIZE, write_plan

__all__ = ["inspect_checkpoint", "export_checkpoint", "verify_checkpoint"]


def inspect_checkpoint(src, *, tag: Optional[str] = None, config: Optional[str] = None, tp_rules=None) -> dict:
    """Describe a checkpoint (engine, stage, world layout, dtypes, tensors, problems found).

    Reads metadata only. Raises :class:`~hf_ckpt_integrations.errors.CheckpointError` for a
    checkpoint that cannot be exported.
    """
    return build_plan(src, tag=tag, config=config, tp_rules=tp_rules).summary()


def export_checkpoint(src, dst, *, tag: Optional[str] = None, dtype: Optional[str] = None,
                      max_shard_size=MAX_SHARD_SIZE, config: Optional[str] = None, overwrite: bool = False,
                      quiet: bool = True, tp_rules=None, workers: int = 1, merge_adapters: bool = False,
                      base: Optional[str] = None) -> dict:
    """Export ``src`` (DeepSpeed save dir, tag dir or Trainer ``checkpoint-N``) to an HF directory ``dst``.

    ``dtype``: ``"fp32"`` (default when the checkpoint has fp32 masters), ``"bf16"`` or ``"fp16"``.
    ``tp_rules``: ``["PATTERN=0|1|replicated", ...]`` for model-parallel parameters nothing else
    describes. ``workers``: shards written at once from a thread pool. Returns the writer's report.
    Nothing is written when the checkpoint is refused.

    A checkpoint of a PEFT model exports the adapter directory ``PeftModel.save_pretrained`` writes
    (``adapter_config.json`` + ``adapter_model.safetensors``); with ``merge_adapters`` a LoRA
    adapter is merged into its base model instead (``base``: the base model's directory, default
    the adapter config's ``base_model_name_or_path`` when it is a local directory), written in the
    base's Hub layout (see :mod:`.peft_merge`).
    """
    from .errors import OptionError

    if base is not None and not merge_adapters:
        raise OptionError("--base is only used with --merge-adapters")
    plan = build_plan(src, tag=tag, dtype=dtype, config=config, tp_rules=tp_rules)
    if merge_adapters:
        from .peft_merge import write_merged

        return write_merged(plan, dst, base=base, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                            quiet=quiet)
    return write_plan(plan, dst, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, quiet=quiet,
                      workers=workers)


def verify_checkpoint(dst, against, *, tag: Optional[str] = None, config: Optional[str] = None,
                      tp_rules=None) -> VerifyReport:
    """Compare every tensor of the HF directory ``dst`` with the source ``against``, bitwise."""
    plan = build_plan(against, tag=tag, config=config, tp_rules=tp_rules)
    with bad_metadata_as_input(dst):  # a hand-edited index or header of dst is bad input, not a bug
        return verify_plan(plan, dst)
