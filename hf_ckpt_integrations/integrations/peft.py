"""Save time for a PEFT model: the adapter directory ``PeftModel.save_pretrained`` writes, correct
under ZeRO-3 (gather flag on or off) and ZeRO-1/2, never a full or partial ``model.safetensors``.

- :func:`consolidate_adapter` (the Trainer callback): the adapter is read from the DeepSpeed
  checkpoint the Trainer has just written into ``checkpoint-N/`` (exactly the state a resume
  loads; for a PEFT model the Trainer leaves the frozen base out of it), renamed as peft names it
  (:mod:`..sources.peft`), and written by rank 0; nothing is gathered.
- :func:`save_adapter_live` (``accelerator.save_model``): only the adapter's parameters are read
  from the live engine (under ZeRO-3 their partitions are broadcast one at a time, see
  :mod:`..sources.live`); the frozen base is never gathered.

Both write ``adapter_config.json`` from the live model's ``peft_config`` as peft does
(``inference_mode`` true) and refuse an empty adapter (no tensor, or a zero-size one: the known
ZeRO-3 bug's output). Collective: every rank calls them.
"""

import copy
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..dtype_rule import request
from ..formats.dtypes import to_user
from ..sources.peft import (adapter_names_in, adapter_out_dir, check_not_empty, is_peft_model,
                            save_name)
from ..comm import default_comm
from ..errors import LayoutError
from ..guards import StrPath
from ..plan import ExportPlan
from ._dist import SAVE_CONSEQUENCE, consolidate, write_distributed

if TYPE_CHECKING:
    import torch

__all__ = ["is_peft_model", "consolidate_adapter", "save_adapter_live", "adapter_dtype"]

_TORCH_TO_NAME = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


def adapter_dtype(model: "torch.nn.Module") -> Optional[str]:
    """The dtype of the trainable (adapter) parameters, what ``save_pretrained`` writes them in
    (peft keeps adapters in fp32 over a bf16 base by default)."""
    seen = {str(p.dtype) for p in model.parameters() if p.requires_grad and p.is_floating_point()}
    return _TORCH_TO_NAME.get(seen.pop()) if len(seen) == 1 else None


def _trained_adapters(model: "torch.nn.Module") -> List[str]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    found = adapter_names_in(names)
    return found or [getattr(model, "active_adapter", "default")]


def _write_config(model: "torch.nn.Module", adapter: str, out_dir: str) -> None:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it."""
    cfg = copy.deepcopy(model.peft_config[adapter])
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = model.base_model.__dict__.get("name_or_path", None)
    cfg.inference_mode = True
    cfg.save_pretrained(out_dir)


def _config_on_rank0(model: "torch.nn.Module", adapter: str, out_dir: str, what: str) -> None:
    def write_it() -> None:
        os.makedirs(out_dir, exist_ok=True)
        _write_config(model, adapter, out_dir)

    default_comm().on_rank0(write_it, f"{what}: writing adapter_config.json", SAVE_CONSEQUENCE)


def consolidate_adapter(checkpoint_dir: StrPath, model: "torch.nn.Module", *,
                        dtype: Optional[str] = None) -> Dict[str, Any]:
    """Write each trained adapter of ``model`` into ``checkpoint_dir`` (a subdirectory for an
    adapter not named ``default``, as peft does) from the DeepSpeed checkpoint there. Collective."""
    checkpoint_dir = os.path.abspath(os.fspath(checkpoint_dir))
    dtype = to_user(request(dtype, training=adapter_dtype(model)))  # default: the adapter's own dtype
    reports: Dict[str, Dict[str, Any]] = {}
    for adapter in _trained_adapters(model):
        out_dir = adapter_out_dir(checkpoint_dir, adapter)
        what = f"saving adapter {adapter!r} into {out_dir}"
        _config_on_rank0(model, adapter, out_dir, what)

        def holds_adapter(plan: ExportPlan, adapter: str = adapter) -> None:
            if plan.adapter is None or plan.adapter["name"] != adapter:
                raise LayoutError(f"{checkpoint_dir}: the DeepSpeed checkpoint holds no tensors of adapter {adapter!r}")

        report = consolidate(checkpoint_dir, out_dir, what=what, dtype=dtype, config=out_dir,
                             check=holds_adapter, replace_existing=False, fmt="adapter", copy_config=False)
        assert report is not None  # None only when a keep() says so: none passed
        reports[adapter] = report
    return {"action": "written", "adapters": reports,
            "files": sorted({f for r in reports.values() for f in r["files"]} | {"adapter_config.json"})}


def save_adapter_live(module: "torch.nn.Module", save_directory: StrPath, *,
                      dtype: Optional[str] = None) -> Dict[str, Any]:
    """``PeftModel.save_pretrained(save_directory)`` for a live (DeepSpeed) PEFT ``module``,
    reading only the adapter parameters. Collective."""
    from ..sources.live import live_tensors, reads_are_collective

    dtype = to_user(request(dtype, training=adapter_dtype(module)))  # default: the adapter's own dtype
    reports: Dict[str, Dict[str, Any]] = {}
    for adapter in _trained_adapters(module):
        out_dir = adapter_out_dir(os.path.abspath(os.fspath(save_directory)), adapter)
        what = f"saving adapter {adapter!r} into {out_dir}"
        plan: Optional[ExportPlan] = None
        error: Optional[Exception] = None
        try:
            plan = live_tensors(module, dtype=dtype, select=lambda n, a=adapter: save_name(n, a))
            check_not_empty(plan.tensors, out_dir)
        except Exception as e:
            error = e
        default_comm().all_ok(error, f"{what}: planning", SAVE_CONSEQUENCE)
        assert plan is not None  # planned on every rank, or all_ok raised
        _config_on_rank0(module, adapter, out_dir, what)
        reports[adapter] = write_distributed(plan, out_dir, collective=reads_are_collective(module),
                                             replace_existing=False, what=what, fmt="adapter")
    return {"action": "written", "adapters": reports}
