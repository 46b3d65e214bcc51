"""Resume a DeepSpeed ``PipelineModule`` save (a ds_pipe_train.py case) through ``hf-ckpt universal`` at
another pipeline x tensor-parallel layout, under DeepSpeed's own ``load_universal``.

``torchrun --nproc_per_node PP*TP ds_pipe_resume.py OUT --from CASE_DIR --pp PP --tp TP``

Rank 0 writes ``OUT/uc/global_step2`` with ``hf_ckpt_integrations.write_universal_checkpoint`` (the
case's ``config/`` chooses the name map, i.e. the TP rules). Every rank then builds the same GPT-NeoX-style
layers as the saving run at PP x TP (ZeRO-1, fp32), with weights scrambled first so that everything must
come from the checkpoint, and loads it with ``"checkpoint": {"load_universal": true}``. It records (TP
rank 0 of every stage, one file per stage) in ``OUT/loaded-stage{S}.safetensors`` what the engine holds
right after loading — per parameter, under its module name, ``fp32/…``, ``exp_avg/…``, ``exp_avg_sq/…``
from DeepSpeed's ``safe_get_full_*``, concatenated over TP as ds_pipe_train.py split them — and in
``OUT/run.json`` the optimizer step and the losses of the next two steps on the batches the saving run
trained after its save.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import ds_pipe_train as pipe  # noqa: E402
import ds_uc_resume  # noqa: E402

SAVED_AT, STEPS = ds_uc_resume.SAVED_AT, ds_uc_resume.STEPS


def main():
    p = ds_uc_resume.resume_parser()
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()

    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology
    from safetensors.torch import save_file
    from transformers import GPTNeoXConfig

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see ds_pipe_train.py
    deepspeed.init_distributed(dist_backend="gloo")
    assert dist.get_world_size() == args.pp * args.tp, "one data-parallel replica: the saving run had dp 1"
    load_dir, tag = ds_uc_resume.write_universal(args, args.src / "ckpt", args.src / "config")

    topo = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=1) if args.tp > 1 else \
        PipeDataParallelTopology(num_pp=args.pp, num_dp=1)
    me = topo.get_coord(dist.get_rank())
    pipe.Grid.size, pipe.Grid.rank = args.tp, getattr(me, "model", 0)
    for ranks in (topo.get_axis_comm_lists("model") if args.tp > 1 else []):
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            pipe.Grid.group = g
    config = GPTNeoXConfig.from_pretrained(str(args.src / "config"))
    specs = [LayerSpec(pipe.EmbeddingPipe, config), pipe._pre_transformer_block,
             *(LayerSpec(pipe.ParallelTransformerLayerPipe, config, i) for i in range(pipe.LAYERS)),
             pipe._post_transformer_block, LayerSpec(pipe.NormPipe, config), LayerSpec(pipe.ParallelLinearPipe, config)]

    def loss_fn(logits, labels):
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))

    model = PipelineModule(layers=specs, loss_fn=loss_fn, topology=topo, partition_method="parameters")
    torch.manual_seed(1)
    with torch.no_grad():  # another init than the saving run's: everything must come from the checkpoint
        for param in model.parameters():
            param.normal_()
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                 "zero_optimization": {"stage": 1}, "steps_per_print": 10**9,
                 "checkpoint": {"load_universal": True}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[q for q in model.parameters()], config=ds_config)
    path, client = engine.load_checkpoint(load_dir, tag=tag)
    assert path is not None, "nothing loaded"

    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()
    loaded, steps = pipe.full_states(engine, pipe.hf_names(config))

    losses = []
    for step in range(SAVED_AT, SAVED_AT + STEPS):
        ids = common.fixed_batch(step, rank=0, vocab_size=config.vocab_size)
        losses.append(float(engine.train_batch(iter([(ids, ids)]))))
    if pipe.Grid.rank == 0:
        save_file(loaded, str(args.out / f"loaded-stage{me.pipe}.safetensors"))
        if me.pipe == 0:
            common.write_json(args.out / "run.json", {"pp": args.pp, "tp": args.tp, "steps": steps, "losses": losses,
                                                      "global_steps": engine.global_steps,
                                                      # what load_checkpoint hands back to GPT-NeoX's loop
                                                      "client_iteration": (client or {}).get("iteration"),
                                                      "client_keys": sorted(client or {})})
    common.finish()


if __name__ == "__main__":
    main()
