"""Train a tiny Llama with Accelerate + DeepSpeed ZeRO, then save through ``install_accelerate_hooks``.

``torchrun --standalone --nproc_per_node 2 accelerate_save.py OUT --stage S [--bf16] [--gather-on-save]``.
Writes ``OUT/reference/{master,module}.safetensors`` (the engine's own weights), then through the
hooked ``accelerator.save_model``: ``OUT/hf/`` (safetensors, sharded at 300KB), ``OUT/bin/``
(``safe_serialization=False``, sharded); for ZeRO-1/2 also ``OUT/bloat/pytorch_model.bin`` (a plain
``torch.save`` of a few live tensors, to show what seed 002 looks like);
``OUT/state/`` from ``accelerator.save_state`` (with the HF copy); ``OUT/metrics/rank{r}.json``.
"""
import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--gather-on-save", action="store_true")
    args = p.parse_args()

    common.init_cpu_deepspeed_state()

    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from hf_ckpt_integrations import install_accelerate_hooks

    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage,
                              "stage3_gather_16bit_weights_on_model_save": args.gather_on_save},
        "bf16": {"enabled": args.bf16},
        "steps_per_print": 10**9,
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config),
                              mixed_precision="bf16" if args.bf16 else "no")
    install_accelerate_hooks(accelerator, save_state_weights=True)
    rank = torch.distributed.get_rank()
    assert accelerator.num_processes == torch.distributed.get_world_size() == 2

    torch.manual_seed(0)
    model = LlamaForCausalLM(common.tiny_llama_config())
    optimizer = DummyOptim(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(2):
        ids = common.fixed_batch(step, rank=rank)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    module = accelerator.unwrap_model(model)
    masters, weights = common.engine_weights(module, zero3=args.stage == 3)
    ref = args.out / "reference"
    if rank == 0:
        ref.mkdir(parents=True, exist_ok=True)
        save_file(masters, str(ref / "master.safetensors"))
        save_file(weights, str(ref / "module.safetensors"))
    del weights, masters
    torch.distributed.barrier()

    metrics = {"rss_before_save_mb": peak_mb()}
    t = time.perf_counter()
    report = accelerator.save_model(model, args.out / "hf", max_shard_size="300KB")
    metrics["save_model_seconds"] = round(time.perf_counter() - t, 3)
    metrics["peak_rss_after_save_mb"] = peak_mb()
    metrics["written_here"] = report["written_here"]
    accelerator.save_model(model, args.out / "bin", max_shard_size="300KB", safe_serialization=False)
    if args.stage != 3 and rank == 0:
        # What a plain torch.save of one shard of ZeRO-1/2's flat-buffer views does (seed 002):
        # two small tensors, but each drags its whole flat buffer into the file.
        (args.out / "bloat").mkdir(parents=True, exist_ok=True)
        shard = {k: v for k, v in module.state_dict().items() if k.endswith("layernorm.weight")}
        torch.save(shard, args.out / "bloat" / "pytorch_model.bin")
        metrics["bloat_tensor_bytes"] = sum(v.numel() * v.element_size() for v in shard.values())
    accelerator.save_state(str(args.out / "state"))
    common_dir = args.out / "metrics"
    common_dir.mkdir(parents=True, exist_ok=True)
    common.write_json(common_dir / f"rank{rank}.json", metrics)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
