"""The one table of what ``SRC`` may be: every input kind the sources read, as users name them.

``export --help`` and ``inspect --help`` print it (:func:`help_epilog`), the "does not exist" and
"no checkpoint found" errors point to it (:data:`SRC_HINT`), README.md holds :func:`markdown_table`
verbatim (tests/cli/test_cli_front_door.py checks it) and docs/hooks.py writes it into docs/inputs.md.
Which source module reads each kind: ``sources/registry.py`` (``SOURCES``, in detection order).
"""

from typing import NamedTuple, Tuple

__all__ = ["InputKind", "INPUTS", "SRC_HELP", "SRC_HINT", "markdown_table", "help_epilog"]


class InputKind(NamedTuple):
    kind: str  # what users call it
    looks_like: str  # what SRC holds (the files a source detects)
    written_by: str  # the engines and calls that write it
    page: str  # the docs page (under docs/) with its details and decisions


INPUTS: Tuple[InputKind, ...] = (
    InputKind("DeepSpeed save dir", "`latest` + `global_stepN/` tag dirs",
              "`engine.save_checkpoint` (DeepSpeed 0.10-0.19: ZeRO 0/1/2/3, BF16_Optimizer, MoE, TP/SP `mpu`)",
              "deepspeed-versions.md"),
    InputKind("DeepSpeed tag dir", "`global_stepN/` (`*_model_states.pt`, `*_optim_states.pt`)",
              "the same, one tag (`--tag` picks one in a save dir)", "deepspeed-layouts.md"),
    InputKind("Trainer checkpoint-N", "`checkpoint-N/` (DeepSpeed, FSDP or plain weights)",
              "transformers `Trainer` (pass one `checkpoint-N`, not `output_dir`)", "integrations/trainer.md"),
    InputKind("DeepSpeed pipeline save", "`layer_XX-model_states.pt` in the tag dir",
              "`PipelineModule` (GPT-NeoX, Megatron-DeepSpeed)", "pipeline.md"),
    InputKind("torch DCP", "`.metadata` + `*.distcp` (or `pytorch_model_fsdp_0/` holding them)",
              "FSDP1/FSDP2 `dcp.save`, Accelerate `save_state`, Trainer under FSDP, `HuggingFaceStorageWriter`",
              "fsdp.md"),
    InputKind("FSDP per-rank files", "`model_world_size_W_rank_R.pt`, `pytorch_model_fsdp_0_rankR.bin`",
              "verl / SkyRL (`global_step_N/`, `actor/`, `policy/`), Accelerate `save_fsdp_model(use_dcp=False)`, "
              "FSDP1 LOCAL_STATE_DICT", "fsdp-rank-files.md"),
    InputKind("Megatron-Core save", "`latest_checkpointed_iteration.txt` + `iter_NNNNNNN/` (`torch_dist` "
              "`.metadata` + `__R_N.distcp`, or legacy `mp_rank_TT[_PPP]/model_optim_rng.pt`)",
              "Megatron-LM / Megatron-Core 0.16 (`dist_checkpointing.save`, `save_checkpoint`), NeMo, verl/slime "
              "Megatron backends: Llama/Qwen2 and GPT (→ GPTBigCode) models, any TP/PP/VPP/DP, with or without the "
              "distributed optimizer", "megatron.md"),
    InputKind("DeepSpeed universal checkpoint", "`zero/<param>/fp32.pt`", "`ds_to_universal`, `hf-ckpt universal`",
              "universal.md"),
    InputKind("HF directory", "`model.safetensors[.index.json]` or `pytorch_model.bin[.index.json]`",
              "`save_pretrained`; ColossalAI `booster.save_model(..., shard=True)` with `install_colossalai_hooks`",
              "integrations/colossalai.md"),
    InputKind("PEFT checkpoint", "any of the above of a `PeftModel` (+ `adapter_config.json`)",
              "peft LoRA & co. (exports the adapter dir; `--merge-adapters` the merged model)", "peft.md"),
    InputKind("legacy torch.save files", "any torch file above in the pre-zip format",
              "DeepSpeed `checkpoint_serialization: false`, old `torch.save`", "deepspeed-versions.md"),
)

# The argparse help of a SRC argument and the end of the errors that say SRC is not one of these.
SRC_HELP = "a checkpoint directory (its kinds are listed below)"
SRC_HINT = "pass a checkpoint directory of a kind `hf-ckpt export --help` lists (docs: Supported inputs)"


def markdown_table(docs: str = "docs/") -> str:
    """The table as Markdown, its links relative to ``docs`` (README.md holds it verbatim; the docs
    site's page gets it from docs/hooks.py with ``docs=""``)."""
    rows = ["| SRC | what it holds | written by | details |", "| --- | --- | --- | --- |"]
    for k in INPUTS:
        rows.append(f"| {k.kind} | {k.looks_like} | {k.written_by} | [{k.page}]({docs}{k.page}) |")
    return "\n".join(rows) + "\n"


def help_epilog() -> str:
    """The table as plain text for ``--help`` (one entry per kind, backticks dropped)."""
    import textwrap

    lines = ["SRC may be (docs: Supported inputs):"]
    for k in INPUTS:
        text = f"{k.kind}: {k.looks_like}; written by {k.written_by}".replace("`", "")
        lines += textwrap.wrap(text, 78, initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False)
    return "\n".join(lines)
