"""DeepSpeed engine configurations other than ZeRO-1/2/3 data parallel with every weight saved:
no ZeRO (stage 0), DeepSpeed's BF16_Optimizer, ``exclude_frozen_parameters=True`` saves, and a
plain ``nn.Module`` (no HF config) with tied parameters.

``torchrun --nproc_per_node N ds_configs_train.py OUT --stage S [--dtype fp32|bf16]
[--grad-accum fp32] [--model llama|module-tied] [--frozen] [--exclude-frozen]``

Writes ``OUT/ckpt`` (``engine.save_checkpoint``), ``OUT/config/config.json`` (Llama only) and
``OUT/reference/``: ``master.safetensors`` (the engine's full fp32 weights: ``safe_get_full_fp32_param``
where the optimizer holds fp32 masters, else the fp32 module weights themselves), ``state.safetensors``
(``module.state_dict()`` as the engine holds it, every name, tied ones included, cloned) and ``run.json``.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


class TiedModule(torch.nn.Module):
    """No HF config: an embedding, a block and a head tied to the embedding, plus a buffer."""

    def __init__(self, vocab=101, hidden=24):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.block = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor([0.5, 2.0]))

    def forward(self, input_ids, labels=None):
        h = self.norm(torch.relu(self.block(self.embed(input_ids)))) * self.scale[0]
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return loss


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--grad-accum", choices=["fp32"], default=None)
    p.add_argument("--model", choices=["llama", "module-tied"], default="llama")
    p.add_argument("--frozen", action="store_true")
    p.add_argument("--exclude-frozen", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    config = None
    if args.model == "llama":
        config = common.tiny_llama_config()
        model = LlamaForCausalLM(config)
        vocab = config.vocab_size
        if args.frozen:
            model.model.embed_tokens.weight.requires_grad_(False)
            model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    else:
        model = TiedModule()
        vocab = 101
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "bf16": {"enabled": args.dtype == "bf16"},
        "steps_per_print": 10**9,
    }
    if args.grad_accum:
        ds_config["data_types"] = {"grad_accum_dtype": args.grad_accum}
    params = [q for q in model.parameters() if q.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)

    for step in range(args.steps):
        ids = common.fixed_batch(step, rank=rank, vocab_size=vocab)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out if args.model != "llama" else out.loss)
        engine.step()
    engine.save_checkpoint(str(args.out / "ckpt"), tag=f"global_step{args.steps}",
                           exclude_frozen_parameters=args.exclude_frozen)

    named = list(engine.module.named_parameters())
    masters = {}
    for name, param in named:
        full = safe_get_full_fp32_param(param) if param.requires_grad else None
        if full is None and args.dtype == "fp32" and args.stage < 3:
            full = param  # no fp32 master beside the weight: the fp32 weight is the master
        if full is not None:
            masters[name] = full.detach().cpu().float().clone().contiguous()
    state = {n: t.detach().cpu().clone().contiguous() for n, t in engine.module.state_dict().items()}

    if rank == 0:
        ref = args.out / "reference"
        ref.mkdir(parents=True, exist_ok=True)
        save_file(masters, str(ref / "master.safetensors"))
        save_file(state, str(ref / "state.safetensors"))
        if config is not None:
            config.save_pretrained(args.out / "config")
        common.write_json(ref / "run.json", {
            "stage": args.stage, "dtype": args.dtype, "model": args.model, "steps": args.steps,
            "optimizer": type(engine.optimizer).__name__, "world_size": torch.distributed.get_world_size(),
            "frozen": [n for n, q in named if not q.requires_grad], "exclude_frozen": args.exclude_frozen})
    common.finish()  # barrier, then exit without teardown (CPU aborts at exit)


if __name__ == "__main__":
    main()
