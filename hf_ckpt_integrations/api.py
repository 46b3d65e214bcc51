"""The Python API: the same three operations as the CLI, which only parses options, calls these
and prints (so both front doors take the same options and raise the same errors)."""

import os
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence, Union

from . import sources
from .errors import CheckpointError, OptionError, option
from .formats.config import config_dir_of
from .formats.dtypes import from_user, to_user
from .guards import StrPath, bad_metadata_as_input
from .verify import VerifyReport, verify_plan
from .export import write_plan
from .writer import MAX_SHARD_SIZE, check_max_shard_size, check_workers

if TYPE_CHECKING:
    import torch

    from .plan import ExportPlan
    from .sources.protocol import Source

__all__ = ["inspect_checkpoint", "export_checkpoint", "verify_checkpoint", "dtype_name"]

# A dtype as callers name it: the package's short name, torch's name, or a torch.dtype.
DtypeArg = Union[str, "torch.dtype", None]


def dtype_name(dtype: DtypeArg) -> Optional[str]:
    """``dtype`` as the package's short name (``"bf16"``): also torch's names (``"bfloat16"``,
    ``"half"``, ``"float"``) and ``torch.dtype`` objects (``torch.bfloat16``); None stays None.
    :class:`~.errors.OptionError` for anything else, before any file is read."""
    if dtype is None:
        return None
    if type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch":  # no torch import needed
        dtype = str(dtype).removeprefix("torch.")
    return to_user(from_user(dtype))


def inspect_checkpoint(src: StrPath, *, tag: Optional[str] = None, config: Optional[StrPath] = None,
                       tp_rules: Optional[Sequence[str]] = None,
                       source_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Describe a checkpoint (engine, the source's own facts such as a ZeRO stage and world layout,
    dtypes, tensors, problems found).

    Reads metadata only. Raises :class:`~hf_ckpt_integrations.errors.CheckpointError` for a
    checkpoint that cannot be exported.
    """
    # keep_fp32_lists: which tensors a bf16/fp16 export keeps in fp32, and why (from the one config read)
    plan = sources.build_plan(src, tag=tag, config=config_dir_of(config), tp_rules=tp_rules,
                              source_options=source_options, keep_fp32_lists=True)
    return plan.summary()


def export_checkpoint(src: StrPath, dst: StrPath, *, tag: Optional[str] = None, dtype: DtypeArg = None,
                      max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE, config: Optional[StrPath] = None,
                      overwrite: bool = False, quiet: bool = True, tp_rules: Optional[Sequence[str]] = None,
                      workers: int = 1, merge_adapters: bool = False,
                      base: Optional[str] = None, source_options: Optional[Mapping[str, Any]] = None,
                      allow_missing: bool = False, weights_only: bool = False) -> Dict[str, Any]:
    """Export ``src`` (any source the registry reads: DeepSpeed save dir, tag dir, Trainer
    ``checkpoint-N``, universal checkpoint, HF directory) to an HF directory ``dst``.

    ``dtype``: ``"fp32"`` (default when the checkpoint has fp32 masters), ``"bf16"`` or ``"fp16"``
    (torch's names too: ``"bfloat16"``, ``"float16"``, ``"half"``, ``"float32"``, ``"float"``, or a
    ``torch.dtype`` such as ``torch.bfloat16``);
    the modules the model class keeps in fp32 stay fp32, as ``from_pretrained(dtype=...)`` keeps them
    (docs/dtypes.md). ``max_shard_size``: None (default) is the installed transformers'
    ``save_pretrained`` default, read from its signature (50GB on transformers 5, 5GB on 4.x); else
    ``"5GB"``, ``"500MB"``, ``"5GiB"`` or a byte count (``5_000_000`` or ``"5000000"``). ``config``:
    the model's ``config.json`` or the directory holding it (default: the one found next to the
    checkpoint). With none found the export is refused, since ``from_pretrained`` could not load
    it, unless ``weights_only`` (the weights alone; add a config.json before loading).
    ``tp_rules``: ``["PATTERN=0|1|replicated", ...]`` for model-parallel parameters nothing else
    describes. ``source_options``: ``{name: value}`` for the options sources declare (``OPTIONS`` in
    their modules; a list for an option given several times). ``workers``: shards written at once from a thread pool. Under ``torchrun`` (``WORLD_SIZE``
    > 1) every rank calls it and the ranks split the shards. Options are checked before the
    checkpoint is read. Returns the writer's report, with the plan's ``notes`` (e.g. no config.json
    found). Raises a :class:`~.errors.CheckpointError` subclass for every refusal (an
    :class:`~.errors.OptionError` for a bad option); nothing is written then.

    A checkpoint of a PEFT model exports the adapter directory ``PeftModel.save_pretrained`` writes
    (``adapter_config.json`` + ``adapter_model.safetensors``); with ``merge_adapters`` a LoRA
    adapter is merged into its base model instead (``base``: the base model's directory, default
    the adapter config's ``base_model_name_or_path`` when it is a local directory), written in the
    base's Hub layout (see :mod:`.peft_merge`).

    Tensors the checkpoint's own records or its config.json's model name but the checkpoint does
    not hold (``inspect``: ``missing_tensors``) refuse the export unless ``allow_missing``.
    """
    max_shard_size = check_max_shard_size(max_shard_size)  # before reading the checkpoint
    check_workers(workers)
    dtype = dtype_name(dtype)
    config = config_dir_of(config)
    if base is not None and not merge_adapters:
        raise OptionError(f"{option('base', 'DIR')} is only used with {option('merge_adapters')}")
    plan = sources.build_plan(src, tag=tag, dtype=dtype, config=config, tp_rules=tp_rules,
                              source_options=source_options)
    check_missing(plan, src, allow_missing)
    required = plan.detail.get("dtype_required")  # a source that holds only one dtype exactly
    if required and (required["dtype"] is None or from_user(dtype) != from_user(required["dtype"])):
        raise CheckpointError(required["reason"])
    if not merge_adapters:  # the checkpoint's own refusals first; a merge writes its base model's config
        check_config(plan, src, weights_only)
    from .parallel import world_from_env, write_plan_parallel

    if (merge_adapters or plan.adapter is not None) and world_from_env() > 1 and os.environ.get("RANK", "0") != "0":
        return {"destination": os.fspath(dst), "notes": list(plan.notes), "written_by": "rank 0"}  # one small job
    if merge_adapters:
        from .peft_merge import write_merged

        report = write_merged(plan, dst, base=base, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                              quiet=quiet)
    elif world_from_env() > 1 and plan.adapter is None:  # torchrun: the ranks split the shards
        report = write_plan_parallel(plan, dst, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                                     quiet=quiet)
    else:
        report = write_plan(plan, dst, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite, quiet=quiet,
                            workers=workers)
    return {**report, "notes": list(plan.notes)}


def verify_checkpoint(dst: StrPath, against: StrPath, *, tag: Optional[str] = None, config: Optional[StrPath] = None,
                      tp_rules: Optional[Sequence[str]] = None, source_options: Optional[Mapping[str, Any]] = None,
                      quiet: bool = True) -> VerifyReport:
    """Compare every tensor of the HF directory ``dst`` with the source ``against``, bitwise. The plan
    is derived afresh (no Hub-layout cache): verify never takes an answer from what export used.
    Not ``quiet``: a progress bar on stderr when it is a terminal."""
    from .sources.protocol import hook
    from .sources.registry import find_source, is_universal_dir

    source = find_source(os.fspath(against), tag)  # once: the universal check and the config both ask it
    if is_universal_dir(os.fspath(dst)) and hook(source, "UNIVERSAL"):
        from .universal_verify import verify_universal  # a universal checkpoint: every state, bitwise

        return verify_universal(dst, against, tag=tag, config=config_dir_of(config), tp_rules=tp_rules, quiet=quiet)
    config = config_dir_of(config) if config is not None else _export_config(source, dst, against, tag)
    plan = sources.build_plan(against, tag=tag, config=config, tp_rules=tp_rules, source_options=source_options,
                              layout_cache=False, source=source)
    with bad_metadata_as_input(dst):  # a hand-edited index or header of dst is bad input, not a bug
        return verify_plan(plan, dst, quiet=quiet)


def _export_config(source: "Source", dst: StrPath, against: StrPath, tag: Optional[str]) -> Optional[str]:
    """``dst`` when it is the export of a checkpoint whose plan needs the model's config
    (``source.needs_config``: a pipeline save's HF names, FSDP1 LOCAL_STATE_DICT's parameter shapes)
    and that keeps none beside it: the export wrote that config into ``dst``. None otherwise (the
    config beside the source, as export found it, decides)."""
    from .convert.passes import find_config_dir
    from .sources.protocol import hook

    if not os.path.isfile(os.path.join(os.fspath(dst), "config.json")):
        return None
    if not hook(source, "needs_config")(os.fspath(against), tag) or find_config_dir(source.config_candidates(os.fspath(against), tag)):
        return None
    return os.fspath(dst)


def check_missing(plan: "ExportPlan", src: StrPath, allow_missing: bool) -> None:
    """Refuse (:class:`~.errors.CheckpointError`) a plan some of whose model tensors the checkpoint
    does not hold (``plan.detail["missing_tensors"]``), naming them and the way on; with
    ``allow_missing`` the export goes on, with a note (``from_pretrained`` initialises them)."""
    missing = plan.detail.get("missing_tensors") or []
    if not missing:
        return
    names = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    if allow_missing:
        plan.notes.append(f"exported without {len(missing)} tensor(s) the checkpoint does not hold ({names}); "
                          "from_pretrained initialises them")
        return
    if plan.detail.get("exclude_frozen_parameters"):
        why, other = " (saved with exclude_frozen_parameters=True)", "export from a save that includes them"
    else:  # nothing says why: parameters left out of the save, or a config.json of another model
        why, other = "", f"pass {option('config', 'PATH')} the config.json of the model that was trained"
    raise CheckpointError(f"{src}: the model has {len(missing)} tensor(s) this checkpoint does not hold{why}: "
                          f"{names}; pass {option('allow_missing')} to export the tensors it holds (from_pretrained "
                          f"then initialises the others), or {other}")


NO_CONFIG_NOTE = "no config.json found next to the checkpoint"


def check_config(plan: "ExportPlan", src: StrPath, weights_only: bool) -> None:
    """Refuse (:class:`~.errors.CheckpointError`) the export of a plan with no config.json (none
    beside the checkpoint, none passed): ``from_pretrained`` cannot load such a directory. A PEFT
    adapter export needs none (``adapter_config.json`` is its config). ``weights_only``: the user
    asked for the weights alone; the export goes on without the warning."""
    if plan.config_dir is not None or plan.adapter is not None:
        return
    if weights_only:
        plan.notes[:] = [n for n in plan.notes if not n.startswith(NO_CONFIG_NOTE)]
        return
    raise CheckpointError(f"{src}: no config.json next to the checkpoint, so from_pretrained could not load the "
                          f"export; pass {option('config', 'PATH')} (the model's config.json or its directory), "
                          f"or {option('weights_only')} to write the weights alone")
