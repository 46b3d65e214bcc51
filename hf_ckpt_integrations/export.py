"""The offline export: a plan written to an HF directory in one process.

Runs the one writer (:func:`~.orchestrator.write`) on the plan, with one rank and the
:class:`~.commit.SiblingSwap` strategy;
:func:`export_finisher` is the last step every export shares (also
:func:`~.parallel.write_plan_parallel`'s).
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from .guards import StrPath
from .orchestrator import write
from .formats.out_tensor import OutTensor
from .plan import ExportPlan
from .formats.config import write_config
from .writer import MAX_SHARD_SIZE, check_max_shard_size, check_workers, copy_adapter_config, decided, export_strategy

__all__ = ["write_plan", "export_finisher"]


def write_plan(plan: ExportPlan, dst: StrPath, *, dtype: Optional[str] = None,
               max_shard_size: Optional[Union[int, str]] = MAX_SHARD_SIZE,
               overwrite: bool = False, quiet: bool = False, workers: int = 1) -> Dict[str, Any]:
    """Write ``plan`` to ``dst`` in one process; return a report (files, bytes, seconds).

    Runs the one writer (:func:`~.orchestrator.write`) with one rank and the
    :class:`~.commit.SiblingSwap` strategy. ``workers`` > 1 writes that many shards at once from a
    thread pool (file copies and fsyncs release the GIL; the bytes are identical to one worker's).

    Raises :class:`DestinationError` when ``dst`` exists (without ``overwrite``), is or holds or lies
    inside the source, or cannot be written; :class:`~.errors.OptionError` for a bad option; on any
    failure nothing is left behind but what was at ``dst`` before. Config files that are not copied
    (:func:`~.formats.config.copy_config_files`) are listed in the report's ``warnings``.
    """
    max_shard_size = check_max_shard_size(max_shard_size)
    check_workers(workers)
    strategy = export_strategy(dst, plan, overwrite=overwrite)
    report = write(decided(plan, dtype), strategy, max_shard_size=max_shard_size, finish=export_finisher(plan),
                   fmt="adapter" if plan.adapter is not None else "safetensors",
                   workers=workers, quiet=quiet, what=f"exporting into {dst}")
    return _export_report(report)


def export_finisher(plan: ExportPlan) -> Callable[[str, Sequence[OutTensor]], Dict[str, Any]]:
    """The ``finish`` step of an export: the config and tokenizer files, with the dtype recorded."""
    def finish(staging: str, tensors: Sequence[OutTensor]) -> Dict[str, Any]:
        skipped: List[str] = []
        if plan.adapter is not None:  # a PEFT adapter directory: its adapter_config.json, no model config
            return {"config_files": copy_adapter_config(plan.adapter["config"], staging, skipped), "warnings": skipped}
        copied = write_config(staging, config_dir=plan.config_dir, skipped=skipped,
                              tensor_dtypes=[t.dtype for t in tensors])
        return {"config_files": copied, "warnings": skipped}
    return finish


def _export_report(report: Dict[str, Any]) -> Dict[str, Any]:
    keys = ("destination", "files", "shards", "tensor_bytes", "bytes_on_disk", "config_files", "warnings", "seconds")
    return {k: report[k] for k in keys}
