"""Build one benchmark checkpoint: a Llama trained one step under DeepSpeed ZeRO on CPU.

Launched by ``export_bench.py`` as ``torchrun --standalone --nproc_per_node 2 make_ckpt.py OUT
--size S --stage 2|3 [--dcp]``. Writes:

- ``OUT/ckpt/``: ``engine.save_checkpoint`` output (``latest``, ``global_step1/``, and the
  ``zero_to_fp32.py`` DeepSpeed copies next to it);
- ``OUT/config/config.json``: the HF config;
- with ``--dcp``: ``OUT/dcp-fp32/`` and ``OUT/dcp-bf16/``, the same fp32 master weights saved by
  torch DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` from both ranks, each tensor a
  ``DTensor`` sharded on dim 0 (the input of ``consolidate_safetensors_files``), plus
  ``OUT/dcp-fqn.json``, the fqn -> output-file-index mapping (all 1: one output file).
"""
import argparse
import json
import os
from pathlib import Path

import torch

# hidden, layers, intermediate, heads, kv heads (vocab 32000 for all)
SIZES = {
    "40m": (512, 4, 1408, 8, 2),
    "156m": (1024, 8, 2816, 16, 4),
    "300m": (1536, 8, 4096, 16, 4),
}


def llama_config(size):
    from transformers import LlamaConfig

    hidden, layers, inter, heads, kv = SIZES[size]
    return LlamaConfig(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                       tie_word_embeddings=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--size", choices=sorted(SIZES), required=True)
    p.add_argument("--stage", type=int, choices=[2, 3], required=True)
    p.add_argument("--dcp", action="store_true", help="also save the masters with torch DCP's HF writer")
    args = p.parse_args()

    import deepspeed
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    config = llama_config(args.size)
    model = LlamaForCausalLM(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": True},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(str(args.out / "ckpt"), tag="global_step1")
    if rank == 0:
        config.save_pretrained(args.out / "config")

    if args.dcp:
        import torch.distributed.checkpoint as dcp
        from deepspeed.utils import safe_get_full_fp32_param
        from torch.distributed.checkpoint import HuggingFaceStorageWriter
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        full = {}
        for name, param in engine.module.named_parameters():
            full[name] = safe_get_full_fp32_param(param).detach().cpu().contiguous()  # collective
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            # src_data_rank=None: every rank holds the full tensor and keeps its own dim-0 chunk.
            sd = {n: distribute_tensor(t.to(dtype), mesh, [Shard(0)], src_data_rank=None) for n, t in full.items()}
            writer = HuggingFaceStorageWriter(str(args.out / f"dcp-{tag}"), save_distributed=True)
            dcp.save(sd, storage_writer=writer)
            del sd
        if rank == 0:
            (args.out / "dcp-fqn.json").write_text(json.dumps({n: 1 for n in full}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
