"""FSDP1 ``LOCAL_STATE_DICT`` saved per rank by Accelerate's ``save_fsdp_model``: flat parameters.

``torchrun --standalone --nproc_per_node 2 fsdp1_local.py OUT``.

A tiny Llama whose sizes are odd (hidden 63, vocabulary 1001: the root unit's flat parameter has an
odd element count, so the last rank's shard is padded) is wrapped by FSDP1 with the transformer
auto-wrap policy (one unit per decoder layer, the root holding the embeddings, the final norm and
the head), trained two AdamW steps, and saved twice in one run:

- ``OUT/flat``: ``use_orig_params=False``, fp32: the flat parameters alone;
- ``OUT/orig``: ``use_orig_params=True`` with a bf16 ``MixedPrecision``: the flat parameters with
  alignment padding between the parameters, and each parameter's sharded 1-D view beside them.

Each holds ``state/pytorch_model_fsdp_rank{R}.bin`` (``save_fsdp_model(plugin, ..., use_dcp=False)``
under ``LOCAL_STATE_DICT``) and ``reference.safetensors``, the engine's own ``FULL_STATE_DICT``
gathered in the same run; the config is in ``OUT/config``. The Accelerator is not prepared (FSDP1
on CPU through ``prepare`` is not supported by Accelerate 1.16); save_fsdp_model reads
``process_index`` only.
"""
import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import fsdp_train  # noqa: E402


def _config():
    return common.tiny_llama_config(hidden_size=63, head_dim=16, num_attention_heads=3, num_key_value_heads=1)


def _save(out: Path, use_orig_params: bool, mixed_precision):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(LlamaForCausalLM(_config()), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                 use_orig_params=use_orig_params, mixed_precision=mixed_precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp_train.train_two_steps(model, opt)
    fsdp_train.save_fsdp1_per_rank(model, out, "LOCAL_STATE_DICT")
    return model


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    args = p.parse_args()
    from accelerate.state import PartialState
    from torch.distributed.fsdp import MixedPrecision

    dist.init_process_group("gloo")
    PartialState(cpu=True)  # Accelerate's logger needs its state
    _save(args.out / "flat", False, None)
    model = _save(args.out / "orig", True, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    if dist.get_rank() == 0:
        model.module.config.save_pretrained(str(args.out / "config"))
    fsdp_train.finish()


if __name__ == "__main__":
    main()
