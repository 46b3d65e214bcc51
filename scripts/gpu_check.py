"""Every save-time path on real GPUs with NCCL: ``make gpu-check`` (not part of ``make test``).

Run on a machine with CUDA, DeepSpeed and transformers installed. ``make gpu-check`` launches this
script twice with ``torchrun``: one process (NCCL world 1), and one process per GPU when there are
two or more. Each run trains nothing: it builds a tiny Llama, wraps it in each engine, and saves it
through the package's save-time paths (what the Trainer callback, ``accelerator.save_model`` and the
PEFT hook run), then compares every written tensor with the engine's own full weights (gathered by
the engine itself). Paths:

- ``zero3`` / ``zero3-offload``: DeepSpeed ZeRO-3, partitions on the GPU / ``offload_param: cpu``
  (live reads: partitions sent point to point to the writing rank);
- ``zero2``: ZeRO-2 (live reads of each parameter in place);
- ``zero3-checkpoint``: ``engine.save_checkpoint`` then ``consolidate_checkpoint`` (the Trainer
  callback's path: planning on rank 0, the files read by every rank);
- ``peft-zero3``: a LoRA adapter under ZeRO-3 (``save_adapter_live``), when peft is installed;
- ``fsdp2`` / ``fsdp2-offload``: ``fully_shard`` without / with ``CPUOffloadPolicy`` (DTensor gathers);
- ``autotp-zero3``: DeepSpeed AutoTP over every rank under ZeRO-3 (the layers' own gathers, the
  other parameters' partitions broadcast); skipped at world 1.

Writes ``OUT/summary-world<N>.json`` (one entry per path: ``ok``, ``mismatch``, ``error`` or
``skipped``, with the peak GPU memory each rank allocated during the save) and exits 1 on any
mismatch or error. ``--backend gloo --device cpu`` runs the same on CPU (a smoke test of the script).

    torchrun --standalone --nproc_per_node=2 scripts/gpu_check.py OUT
"""

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1001, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def ds_config(stage: int, offload: bool = False) -> dict:
    zero = {"stage": stage}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"train_batch_size": dist.get_world_size(), "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": zero, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}


def compare(directory, reference) -> list:
    """Names whose written tensor differs from ``reference`` (rank 0 only; every rank gets the list)."""
    bad = []
    if dist.get_rank() == 0:
        from safetensors import safe_open

        written = {}
        for name in sorted(os.listdir(directory)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(directory, name), "pt") as f:
                    written.update({k: f.get_tensor(k) for k in f.keys()})
        for name, t in reference.items():
            got = written.get(name)
            if got is None or got.shape != t.shape or not torch.equal(got, t.to(got.dtype)):
                bad.append(name)
        if not written:
            bad.append("<nothing written>")
    box = [bad]
    dist.broadcast_object_list(box, src=0, group=_cpu_group())
    return box[0]


_GROUP = []


def _cpu_group():
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def zero_reference(engine, zero3):
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero3):
        return {n: t.detach().cpu().clone() for n, t in engine.module.state_dict().items()}


def deepspeed_engine(stage, offload=False):
    import deepspeed

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, offload))
    return engine


def live_save(module, out):
    from hf_ckpt_integrations.integrations._dist import write_distributed
    from hf_ckpt_integrations.sources.live import live_tensors, reads_are_collective

    plan = live_tensors(module)
    write_distributed(plan, out, max_shard_size=200_000, collective=reads_are_collective(module), what="gpu-check")


def path_zero(stage, offload):
    def run(out):
        engine = deepspeed_engine(stage, offload)
        live_save(engine.module, out)
        return compare(out, zero_reference(engine, stage == 3))
    return run


def path_zero3_checkpoint(out):
    from hf_ckpt_integrations.integrations._dist import consolidate_checkpoint

    engine = deepspeed_engine(3)
    ckpt = os.path.join(out, "ckpt")
    engine.save_checkpoint(ckpt, tag="global_step0")
    if dist.get_rank() == 0:
        engine.module.config.save_pretrained(ckpt)
    dist.barrier(group=_cpu_group())
    consolidate_checkpoint(ckpt, tag="global_step0", dtype="bf16", existing="replace")
    return compare(ckpt, {k: v.to(torch.bfloat16) for k, v in zero_reference(engine, True).items()})


def path_peft_zero3(out):
    import deepspeed
    from peft import LoraConfig, get_peft_model

    from hf_ckpt_integrations.integrations.peft import save_adapter_live

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config(3))
    save_adapter_live(engine.module, out)
    lora = [p for n, p in engine.module.named_parameters() if "lora_" in n]
    with deepspeed.zero.GatheredParameters(lora, modifier_rank=None):
        from peft import get_peft_model_state_dict

        reference = {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(engine.module).items()}
    return compare(out, reference)


def path_autotp_zero3(out: str) -> list:
    import deepspeed
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    world = dist.get_world_size()
    if world < 2:
        raise Skip("AutoTP needs two ranks or more")
    config = {**ds_config(3), "tensor_parallel": {"autotp_size": world}}
    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    live_save(engine.module, out)
    reference = {}  # DeepSpeed's own gather of each layer (ZeRO partitions first), as Accelerate's save does
    for mname, mod in engine.module.named_modules():
        own = list(mod.named_parameters(recurse=False))
        with deepspeed.zero.GatheredParameters([q for _, q in own], modifier_rank=None), \
                GatherReplacedLayerParams([q for _, q in own], mod, enabled=True):
            for n, q in own:
                reference[f"{mname}.{n}" if mname else n] = q.detach().cpu().clone()
    return compare(out, reference)


class Skip(Exception):
    """This path does not apply here."""


def path_fsdp2(offload):
    def run(out):
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if offload and DEVICE == "cpu":
            raise Skip("CPUOffloadPolicy needs an accelerator")

        model = tiny_llama().to(DEVICE)
        kwargs = {"offload_policy": CPUOffloadPolicy()} if offload else {}
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        reference = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
                     for n, t in model.state_dict().items()}
        live_save(model, out)
        return compare(out, reference)
    return run


PATHS = {
    "zero3": path_zero(3, False),
    "zero3-offload": path_zero(3, True),
    "zero2": path_zero(2, False),
    "zero3-checkpoint": path_zero3_checkpoint,
    "peft-zero3": path_peft_zero3,
    "fsdp2": path_fsdp2(False),
    "fsdp2-offload": path_fsdp2(True),
    "autotp-zero3": path_autotp_zero3,
}
DEVICE = "cuda"


def main():
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--backend", default="nccl")
    p.add_argument("--device", default="cuda")
    p.add_argument("--paths", default=",".join(PATHS))
    args = p.parse_args()
    DEVICE = args.device
    local = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(args.backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    summary = {}
    for name in args.paths.split(","):
        out = args.out / f"world{world}" / name
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=_cpu_group())
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            bad = PATHS[name](str(out))
            entry = {"result": "ok" if not bad else "mismatch", "mismatched": bad[:20]}
        except (ImportError, Skip) as e:
            entry = {"result": "skipped", "why": str(e)}
        except Exception as e:  # the summary says which path failed, on which rank
            entry = {"result": "error", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else 0
        entries = [None] * world
        dist.all_gather_object(entries, {**entry, "peak_gpu_bytes": peak}, group=_cpu_group())
        summary[name] = {"result": _worst([e["result"] for e in entries]), "ranks": entries}
        if rank == 0:
            print(f"gpu-check world {world}: {name}: {summary[name]['result']}", flush=True)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"summary-world{world}.json").write_text(json.dumps(summary, indent=1))
    failed = any(v["result"] in ("mismatch", "error") for v in summary.values())
    dist.barrier(group=_cpu_group())
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def _worst(results):
    for r in ("error", "mismatch", "skipped"):
        if r in results:
            return r
    return "ok"


if __name__ == "__main__":
    main()
