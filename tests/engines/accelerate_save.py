"""Train a tiny Llama with Accelerate + DeepSpeed ZeRO, then save through ``install_accelerate_hooks``.

``accelerate launch --config_file tests/engines/accelerate/<name>.yaml accelerate_save.py OUT``: the
DeepSpeed setup (ZeRO stage, bf16, AutoTP) comes from that real config file, as a user's would.
Writes ``OUT/reference/{master,module}.safetensors`` (the engine's own weights), then through the
hooked ``accelerator.save_model``: ``OUT/hf/`` (safetensors, sharded at 300KB), ``OUT/bin/``
(``safe_serialization=False``, sharded); for ZeRO-1/2 also ``OUT/bloat/pytorch_model.bin`` (a plain
``torch.save`` of a few live tensors, to show what seed 002 looks like);
``OUT/state/`` from ``accelerator.save_state`` (with the HF copy); ``OUT/metrics/rank{r}.json``.
Under ZeRO-3 (with or without AutoTP) the hooked ``save_model`` runs again with NCCL's device rules
on (tests/support/nccl_rules.py: the training stays on gloo, the rules apply to the save only), with
the partitions on the (fake) device and offloaded to the CPU: ``OUT/nccl/{device,cpu}/`` and
``OUT/nccl/rank{r}.json``; the same bytes as ``OUT/hf/`` (tests/integrations/test_nccl_engine_paths.py).
"""
import argparse
import os
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
    args = p.parse_args()

    common.init_cpu_deepspeed_state()

    from accelerate import Accelerator
    from accelerate.utils import DummyOptim
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from hf_ckpt_integrations import install_accelerate_hooks

    accelerator = Accelerator()  # everything from the config file accelerate launch was given
    install_accelerate_hooks(accelerator, save_state_weights=True)
    rank = torch.distributed.get_rank()
    assert accelerator.num_processes == torch.distributed.get_world_size() == int(os.environ["WORLD_SIZE"])
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    stage = ds_config["zero_optimization"]["stage"]
    tp = ds_config.get("tensor_parallel", {}).get("autotp_size", 1)

    torch.manual_seed(0)
    model = LlamaForCausalLM(common.tiny_llama_config())
    optimizer = DummyOptim(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(2):
        ids = common.fixed_batch(step, rank=rank // tp)  # TP ranks of one replica see the same batch
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    module = accelerator.unwrap_model(model)
    ref = args.out / "reference"
    if tp == 1:
        masters, weights = common.engine_weights(module, zero3=stage == 3)
        if rank == 0:
            ref.mkdir(parents=True, exist_ok=True)
            save_file(masters, str(ref / "master.safetensors"))
            save_file(weights, str(ref / "module.safetensors"))
        del weights, masters
    torch.distributed.barrier()

    metrics = {"rss_before_save_mb": peak_mb(), "stage": stage, "autotp_size": tp}
    data_ptrs = {n: q.data_ptr() for n, q in module.named_parameters()}
    t = time.perf_counter()
    report = accelerator.save_model(model, args.out / "hf", max_shard_size="300KB")
    metrics["save_model_seconds"] = round(time.perf_counter() - t, 3)
    metrics["peak_rss_after_save_mb"] = peak_mb()
    metrics["written_here"] = report["written_here"]
    accelerator.save_model(model, args.out / "bin", max_shard_size="300KB", safe_serialization=False)
    # The saves leave every parameter's storage where ZeRO's optimizer writes (a view of its flat
    # buffer under ZeRO-1/2): training after a save goes on with the same tensors.
    metrics["data_ptr_changed_by_save"] = sorted(n for n, q in module.named_parameters()
                                                 if q.data_ptr() != data_ptrs[n])
    if tp > 1:
        # The engine's own view of the AutoTP weights: DeepSpeed's gather of each replaced layer
        # (only the module weights).
        # Under ZeRO-3 the ZeRO partitions first, as _zero3_consolidated_16bit_state_dict does.
        import deepspeed
        from deepspeed.module_inject.layers import GatherReplacedLayerParams

        weights = {}
        for mname, mod in module.named_modules():
            own = list(mod.named_parameters(recurse=False))
            with deepspeed.zero.GatheredParameters([q for _, q in own], enabled=stage == 3), \
                    GatherReplacedLayerParams([q for _, q in own], mod, enabled=True):
                for n, q in own:
                    weights[f"{mname}.{n}" if mname else n] = q.detach().cpu().clone().contiguous()
        if rank == 0:
            ref.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(ref / "module.safetensors"))
        del weights
    if stage != 3 and tp == 1 and rank == 0:
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
    if stage == 3:
        from tests.support import nccl_rules

        nccl_rules.engine_saves(lambda dst: accelerator.save_model(model, dst, max_shard_size="300KB"), module,
                                args.out / "nccl")
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
