"""Train a tiny Llama under FSDP2 on CPU/gloo and save per-rank ``torch.save`` state dicts.

``torchrun --standalone --nproc_per_node N fsdp_rank_files.py OUT --mode verl|accelerate``.

- ``verl``: what verl's FSDP2 worker and ``FSDPCheckpointManager.save_checkpoint`` do
  (verl/workers/fsdp_workers.py, verl/utils/fsdp_utils.py, verl/utils/checkpoint/
  fsdp_checkpoint_manager.py; verl is not installed here, its steps are copied): a device mesh
  ``("fsdp",)`` of all ranks (``("ddp", "fsdp")`` with ``--fsdp-size``: HSDP), ``fully_shard`` of
  every decoder layer and of the untied embedding, then of the root, with verl's
  ``shard_placement_fn`` (the first dim the FSDP size divides: the 1001-row vocabulary lands on
  ``Shard(1)``) and its bf16 ``MixedPrecisionPolicy``; two AdamW steps; then every rank writes
  ``OUT/ckpt/global_step_2/actor/model_world_size_{W}_rank_{R}.pt`` (``torch.save(model.state_dict())``)
  with its ``optim_``/``extra_state_`` twins, rank 0 ``huggingface/`` (config and tokenizer) and
  ``fsdp_config.json``, and the trainer ``latest_checkpointed_iteration.txt`` at ``OUT/ckpt``.
- ``accelerate``: an ``Accelerator`` with an FSDP2 plugin (SHARDED_STATE_DICT) and
  ``save_fsdp_model(plugin, accelerator, model, OUT/state, use_dcp=False)``:
  ``pytorch_model_fsdp_0_rank{R}.bin``.

Both write the engine's own full weights (``get_model_state_dict(full_state_dict=True)``) to
``OUT/reference.safetensors`` and the config to ``OUT/config`` (fsdp_train's ``_reference``).
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_train  # noqa: E402


def _tokenizer():
    """A small word-level tokenizer (no download): what verl saves beside the config."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(20)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def run_verl(out: Path, fsdp_size: int):
    from dataclasses import asdict, dataclass

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if fsdp_size <= 0 or fsdp_size >= world:  # verl's create_device_mesh
        mesh = init_device_mesh("cpu", mesh_shape=(world,), mesh_dim_names=["fsdp"])
    else:
        mesh = init_device_mesh("cpu", mesh_shape=(world // fsdp_size, fsdp_size), mesh_dim_names=["ddp", "fsdp"])
    model = fsdp_train._model()
    kwargs = {"mesh": mesh, "reshard_after_forward": True,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                cast_forward_inputs=True),
              "shard_placement_fn": fsdp_train.shard_placement_fn(mesh.shape[-1])}
    # verl's apply_fsdp2: decoder layers and (untied) embeddings, then the root
    for module in model.modules():
        if type(module).__name__ == "LlamaDecoderLayer" or (
                isinstance(module, torch.nn.Embedding) and not model.config.tie_word_embeddings):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp_train.train_two_steps(model, opt)

    # FSDPCheckpointManager.save_checkpoint (FSDP2: no state-dict context)
    root = out / "ckpt"
    local = root / "global_step_2" / "actor"
    local.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(model.state_dict(), local / f"model_world_size_{world}_rank_{rank}.pt")
    torch.save(opt.state_dict(), local / f"optim_world_size_{world}_rank_{rank}.pt")
    torch.save({"lr_scheduler": None, "rng": {"cpu": torch.get_rng_state()}},
               local / f"extra_state_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        @dataclass
        class FSDPConfig:
            FSDP_version: int
            world_size: int

        hf = local / "huggingface"
        hf.mkdir(exist_ok=True)
        model.config.save_pretrained(hf)
        _tokenizer().save_pretrained(hf)
        (local / "fsdp_config.json").write_text(json.dumps(asdict(FSDPConfig(2, world)), indent=4))
        (root / "latest_checkpointed_iteration.txt").write_text("2")
    dist.barrier()
    fsdp_train._reference(model, out)


def run_accelerate(out: Path):
    from accelerate import Accelerator
    from accelerate.utils import save_fsdp_model

    plugin = fsdp_train._plugin()
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    fsdp_train._force_fsdp(accelerator.state, plugin)
    model = fsdp_train._model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    fsdp_train.train_two_steps(model, opt)
    save_fsdp_model(plugin, accelerator, model, str(out / "state"), use_dcp=False)
    fsdp_train._reference(model, out)


def run_accelerate_fsdp1(out: Path):
    """FSDP1 (no device mesh) saved by Accelerate's own ``save_fsdp_model(use_dcp=False)`` under
    SHARDED_STATE_DICT: ShardedTensors. The Accelerator is not prepared (FSDP1 on CPU through
    ``prepare`` is not supported by Accelerate 1.16); save_fsdp_model reads ``process_index`` only."""
    from accelerate.state import PartialState
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    PartialState(cpu=True)  # Accelerate's logger needs its state
    model = FSDP(fsdp_train._model(), device_id=torch.device("cpu"), use_orig_params=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp_train.train_two_steps(model, opt)
    fsdp_train.save_fsdp1_per_rank(model, out, "SHARDED_STATE_DICT")
    if dist.get_rank() == 0:
        model.module.config.save_pretrained(str(out / "config"))


def run_fsdp_tp(out: Path):
    """A 2-D ("dp", "tp") mesh: tensor parallel inside each layer (torch's ColwiseParallel /
    RowwiseParallel), then ``fully_shard`` over "dp"; saved as verl saves (``model.state_dict()`` per
    rank): placements such as ``(_StridedShard(0), Shard(0))``, ``(Shard(0), Shard(1))`` and
    ``(Shard(0), Replicate())``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = fsdp_train._model()
    plan = {**{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
            "self_attn.o_proj": RowwiseParallel(),
            **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")}, "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp_train.train_two_steps(model, opt, data_rank=mesh.get_coordinate()[0])  # one batch per TP group
    local = out / "ckpt" / "global_step_2" / "actor"
    local.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(model.state_dict(), local / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        (local / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
        model.config.save_pretrained(local / "huggingface")
        (out / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    dist.barrier()
    fsdp_train._reference(model, out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=("verl", "accelerate", "accelerate-fsdp1", "fsdp-tp"), required=True)
    p.add_argument("--fsdp-size", type=int, default=-1)
    args = p.parse_args()
    if args.mode == "verl":
        run_verl(args.out, args.fsdp_size)
    else:
        {"accelerate": run_accelerate, "accelerate-fsdp1": run_accelerate_fsdp1, "fsdp-tp": run_fsdp_tp}[args.mode](args.out)
    fsdp_train.finish()


if __name__ == "__main__":
    main()
