"""What a DeepSpeed save records about itself, read for the plan and its messages: the ZeRO stage
and data-parallel size the model-states file records, the checkpoint described as its files
record it (every refusal names it), and the tied names written out where no HF config says
otherwise."""

from typing import Optional

from ...plan import ExportPlan

__all__ = ["recorded_stage", "recorded_dp", "describe", "write_aliases"]

def recorded_stage(model: dict) -> int:
    """The ZeRO stage the model-states file's ``ds_config`` records (0 when it records none)."""
    cfg = model.get("ds_config")
    zero = cfg.get("zero_optimization") if isinstance(cfg, dict) else None
    stage = zero.get("stage") if isinstance(zero, dict) else None
    return stage if type(stage) is int else 0


def recorded_dp(model: dict) -> Optional[int]:
    """The data-parallel size a model-states file records (``dp_world_size``), or None."""
    dp = model.get("dp_world_size")
    return dp if type(dp) is int else None


def describe(stage: int, optimizer: str, dp: Optional[int]) -> str:
    """The checkpoint as its files record it, for messages: ``"ZeRO stage 0 (torch optimizer), no
    optimizer partition files"``, ``"BF16_Optimizer, ZeRO stage 1, 2 data-parallel rank files"``."""
    if optimizer == "ZeRO":
        return f"ZeRO stage {stage}, {dp} data-parallel rank files"
    if dp is None:
        return f"ZeRO stage {stage} ({optimizer}), no optimizer partition files"
    return f"{optimizer}, ZeRO stage {stage}, {dp} data-parallel rank files"


def write_aliases(plan: ExportPlan) -> None:
    """Without an HF config there is no ``save_pretrained`` policy to follow: every name the module
    has is written (a tied name as a copy of its weight, as ``zero_to_fp32`` does), so that
    ``load_state_dict(strict=True)`` of a plain ``nn.Module`` loads the export."""
    from dataclasses import replace

    by_name = {t.name: t for t in plan.tensors}
    written = [a for a, target in plan.aliases.items() if target in by_name and a not in by_name]
    for alias in written:
        plan.tensors.append(replace(by_name[plan.aliases[alias]], name=alias))
    if written:
        plan.notes.append("no config.json: tied names written as copies, every name the module has: "
                          + ", ".join(f"{a} (= {plan.aliases[a]})" for a in written[:5]))
    plan.aliases = {}

