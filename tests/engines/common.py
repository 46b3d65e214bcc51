"""Shared pieces of the engine scripts launched by the tests (never imported by the package).

Each script runs under ``torchrun`` as a real multi-process job on CPU with gloo.
"""
import json
import os
import sys
from pathlib import Path

import torch

# Not a round number on purpose: exposes padding and alignment bugs (DeepSpeed pads ZeRO
# partitions to multiples of 2*world_size; AutoTP and ColossalAI pad vocabularies).
VOCAB_SIZE = 1001


def tiny_llama_config(*, tie_word_embeddings=False, vocab_size=VOCAB_SIZE, **overrides):
    from transformers import LlamaConfig

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def fixed_batch(step, *, batch=2, seq=16, vocab_size=VOCAB_SIZE, rank=0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return ids


def probe_input(vocab_size=VOCAB_SIZE):
    """The fixed input whose logits are recorded at save time and compared after export."""
    return torch.arange(0, 24).remainder(vocab_size).view(2, 12) * 37 % vocab_size


def write_json(path, obj):
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True))


class RandomTokens(torch.utils.data.Dataset):
    """``n`` fixed random sequences of ``seq`` tokens, each its own label (the Trainer runs' data)."""

    def __init__(self, n=64, seq=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB_SIZE, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def rank():
    return int(os.environ.get("RANK", "0"))


def finish():
    """End an engine run: a final barrier, then leave without interpreter teardown.

    On CPU, gloo/DeepSpeed/FSDP processes sometimes abort at interpreter exit ("terminate called
    without an active exception", SIGABRT) after all their work is done; torchrun then reports the
    run failed. Everything is written by the barrier, so the process ends there with status 0.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_cpu_deepspeed_state():
    """Make Accelerate/Trainer see the real world size when DeepSpeed runs on CPU.

    On a machine without a GPU, Accelerate 1.16 finds no default backend, so the state
    ``TrainingArguments`` builds is ``DistributedType.NO`` with ``num_processes == 1`` on every
    rank (both ranks then write the same files) although DeepSpeed's group has 2 ranks.
    Building the state first, for DeepSpeed and with gloo, fixes it; ``TrainingArguments`` must
    then be given ``accelerator_config={"use_configured_state": True}`` to keep it.
    """
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    from accelerate import PartialState

    state = PartialState(backend="gloo")
    assert state.num_processes == int(os.environ.get("WORLD_SIZE", "1")), state
    return state


def engine_weights(model, *, zero3):
    """The engine's own view of ``model``'s weights: ``(masters, module)``.

    ``masters``: fp32 master of every trained parameter (``safe_get_full_fp32_param``);
    ``module``: every parameter in the training dtype, gathered with ``GatheredParameters``
    under ZeRO-3. Collective: every rank calls it; every rank gets full CPU copies.
    """
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    named = list(model.named_parameters())
    masters = {}
    for name, param in named:
        full = safe_get_full_fp32_param(param)
        if full is not None:
            masters[name] = full.detach().cpu().clone().contiguous()
    with deepspeed.zero.GatheredParameters([q for _, q in named], enabled=zero3):
        module = {n: q.detach().cpu().clone().contiguous() for n, q in named}
    return masters, module
