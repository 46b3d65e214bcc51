"""DeepSpeed runs with a model-parallel axis: a replica `mpu` (sequence parallel, seed 000) or
DeepSpeed AutoTP (``tensor_parallel.autotp_size``), recording references like ds_train.py.

``torchrun --nproc_per_node N ds_parallel_train.py OUT --mode replica|autotp --mp 2 --stage S``
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


class GridMPU:
    """A Megatron-style ``mpu``: consecutive ranks form a model-parallel group, strided ranks a
    data-parallel group. Used with ``replica=True`` it is the seed-000 setup: the "model-parallel"
    axis really carries sequence-parallel replicas, each holding the full model."""

    def __init__(self, mp):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.mp, self.dp = mp, world // mp
        self.mp_group = self.dp_group = None
        for start in range(0, world, mp):  # every rank creates every group, in the same order
            ranks = list(range(start, start + mp))
            g = dist.new_group(ranks)
            if rank in ranks:
                self.mp_group = g
        for first in range(mp):
            ranks = list(range(first, world, mp))
            g = dist.new_group(ranks)
            if rank in ranks:
                self.dp_group, self.dp_ranks = g, ranks
        self.mp_rank, self.dp_rank = rank % mp, rank // mp

    def get_model_parallel_rank(self):
        return self.mp_rank

    def get_model_parallel_world_size(self):
        return self.mp

    def get_model_parallel_group(self):
        return self.mp_group

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_group_ranks(self):
        return self.dp_ranks

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=["replica", "autotp"], required=True)
    p.add_argument("--mp", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    import deepspeed
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = common.tiny_llama_config()
    model = LlamaForCausalLM(config)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    mpu = None
    if args.mode == "autotp":
        ds_config["tensor_parallel"] = {"autotp_size": args.mp}
        data_rank = rank // args.mp
    else:
        mpu = GridMPU(args.mp)
        data_rank = mpu.get_data_parallel_rank()  # replicas see the same batch, as in sequence parallel
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu)

    for step in range(args.steps):
        ids = common.fixed_batch(step, rank=data_rank)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}")

    masters, _ = common.engine_weights(engine.module, zero3=args.stage == 3)
    shapes = {n: list(t.shape) for n, t in masters.items()}
    if args.mode == "autotp":
        # Each rank holds TP slices: gather every replaced layer with DeepSpeed's own helper
        # (fp32 training: the module weights are the masters, bitwise).
        from deepspeed.module_inject.layers import GatherReplacedLayerParams

        masters = {}
        for mname, mod in engine.module.named_modules():
            own = [(n, q) for n, q in mod.named_parameters(recurse=False)]
            if not own:
                continue
            with GatherReplacedLayerParams([q for _, q in own], mod, enabled=True):
                for n, q in own:
                    masters[f"{mname}.{n}" if mname else n] = q.detach().cpu().float().clone().contiguous()
    if rank == 0:
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(masters, str(ref / "master.safetensors"))
        config.save_pretrained(args.out / "config")
        common.write_json(ref / "run.json", {"mode": args.mode, "mp": args.mp, "stage": args.stage,
                                            "world_size": dist.get_world_size(), "local_shapes": shapes})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
