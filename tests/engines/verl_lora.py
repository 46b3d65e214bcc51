"""A LoRA actor saved as verl saves it: FSDP2 per-rank state dicts of a PeftModel, and ``lora_adapter/``.

``torchrun --standalone --nproc_per_node 2 verl_lora.py OUT``.

verl's fsdp worker (verl/workers/fsdp_workers.py, verl/utils/fsdp_utils.py,
verl/utils/checkpoint/fsdp_checkpoint_manager.py; verl is not installed here, its steps are
copied): ``enable_input_require_grads`` and ``get_peft_model`` with verl's LoRA config
(``task_type=CAUSAL_LM``, ``target_modules="all-linear"``, ``bias="none"``), ``apply_fsdp2`` on a
``("fsdp",)`` mesh (decoder layers and the untied embedding, then the root; verl's
``shard_placement_fn`` and bf16 ``MixedPrecisionPolicy``), two AdamW steps, then
``FSDPCheckpointManager.save_checkpoint``: every rank ``torch.save(model.state_dict())`` to
``OUT/ckpt/global_step_2/actor/model_world_size_{W}_rank_{R}.pt`` (base weights as
``…base_layer.weight`` beside ``…lora_A.default.weight``), rank 0 ``huggingface/`` (config and
tokenizer) and ``fsdp_config.json``, the trainer ``latest_checkpointed_iteration.txt``; and the
worker's LoRA step: ``actor/lora_adapter/adapter_config.json`` (``asdict`` of the peft config,
enums as values) and ``adapter_model.safetensors``.

References, from the engine's own gathered full state dict: ``OUT/reference_merged.safetensors``
(a plain PeftModel loaded with it, ``merge_and_unload()``), ``OUT/reference_adapter.safetensors``
(``get_peft_model_state_dict``), the base config in ``OUT/config``.
"""
import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import fsdp_train  # noqa: E402


def _lora_config():
    from peft import LoraConfig, TaskType

    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules="all-linear",
                      exclude_modules=None, bias="none")


def _peft_model():
    from peft import get_peft_model

    model = fsdp_train._model()
    model.enable_input_require_grads()
    return get_peft_model(model, _lora_config())


def main():
    from peft.utils.save_and_load import get_peft_model_state_dict
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    out = p.parse_args().out
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", mesh_shape=(world,), mesh_dim_names=["fsdp"])
    model = _peft_model()
    kwargs = {"mesh": mesh, "reshard_after_forward": True,
              "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                cast_forward_inputs=True),
              "shard_placement_fn": fsdp_train.shard_placement_fn(world)}
    wrap = model._no_split_modules if hasattr(model, "_no_split_modules") else ["LlamaDecoderLayer"]
    for module in model.modules():  # verl's apply_fsdp2
        if type(module).__name__ in wrap or (isinstance(module, torch.nn.Embedding)
                                              and not model.config.tie_word_embeddings):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-2)
    for step in range(2):
        ids = common.fixed_batch(step, rank=rank)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    root = out / "ckpt"
    local = root / "global_step_2" / "actor"
    local.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    torch.save(model.state_dict(), local / f"model_world_size_{world}_rank_{rank}.pt")
    if rank == 0:
        hf = local / "huggingface"
        hf.mkdir(exist_ok=True)
        model.config.save_pretrained(hf)
        (local / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}, indent=4))
        (root / "latest_checkpointed_iteration.txt").write_text("2")
    dist.barrier()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        adapter = get_peft_model_state_dict(model, state_dict=full)
        # the worker's save_checkpoint LoRA step
        lora = local / "lora_adapter"
        lora.mkdir(exist_ok=True)
        cfg = asdict(model.peft_config["default"])
        cfg["task_type"] = cfg["task_type"].value
        cfg["peft_type"] = cfg["peft_type"].value
        cfg["target_modules"] = list(cfg["target_modules"])
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(lora / "adapter_model.safetensors"))
        (lora / "adapter_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=4))
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(out / "reference_adapter.safetensors"))
        plain = _peft_model()
        plain.load_state_dict(full, strict=True)
        merged = plain.merge_and_unload().state_dict()
        save_file({k: v.contiguous() for k, v in merged.items()}, str(out / "reference_merged.safetensors"))
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "reference_full.safetensors"))
        plain.config.save_pretrained(str(out / "config"))
    fsdp_train.finish()


if __name__ == "__main__":
    main()
