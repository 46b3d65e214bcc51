"""mbridge's Megatron -> HF export of a torch_dist save, on CPU (run by benchmarks/megatron_bench.py).

mbridge (PyPI ``mbridge``, ISEEKYAN/mbridge) has no checkpoint reader: it builds the Megatron-Core model
in memory (``bridge.get_model``), and ``bridge.save_weights(model, dir)`` exports that model's weights.
A torch_dist save is therefore loaded the way Megatron-LM's ``load_checkpoint`` loads it
(``dist_checkpointing.load`` of the model's sharded state dict, then ``load_state_dict``), and then
exported by mbridge. Usage (mbridge from a --target dir, never installed into .venv)::

    python benchmarks/peers/mbridge_export.py MBRIDGE_PATH CONFIG_DIR ITER_DIR OUT_DIR DIVISIBLE_BY

What had to change for it to run on a CPU-only machine (nothing else of mbridge's is touched):

- mbridge's LLaMA bridge hard-codes Transformer Engine's layer spec
  (``get_gpt_decoder_block_spec(config, use_transformer_engine=True)``); TE needs CUDA and does not
  install here, and megatron-core 0.16.1 fails with ``NameError: name 'TENorm' is not defined``. The
  subclass below builds the same model with Megatron-Core's local spec and adds the local spec's two
  norm names to mbridge's name tables (``input_layernorm``, ``pre_mlp_layernorm``; TE fuses them into
  ``linear_qkv``/``linear_fc1``). Megatron saves both specs under the same torch_dist names.
- mbridge's ``get_model`` calls ``model.cuda(torch.cuda.current_device())`` and its export moves each
  tensor ``.to(torch.cuda.current_device())``: stand-ins make both the CPU (the same stand-ins as
  tests/engines/megatron_train.py).
- transformers 5: mbridge's Llama bridge reads ``rope_scaling`` (an alias of ``rope_parameters`` there,
  ``{"rope_type": "default", "rope_theta": ...}`` for plain RoPE) as scaled RoPE and fails with
  ``KeyError: 'factor'``; a default-RoPE config is passed as unscaled. (PyPI mbridge 0.15.1 fails earlier:
  ``'LlamaConfig' object has no attribute 'rope_theta'``; GitHub main, used here, reads ``rope_parameters``.)
- ``perform_initialization=False`` (mbridge's ``set_extra_args``): the weights are loaded right after,
  so random init would only add time.
- ``bridge.safetensor_io`` is normally set by ``load_weights`` from an HF directory; here it is made
  from the config-only directory (no index: mbridge's single-file save path).
"""
import os
import sys

MBRIDGE, CONFIG_DIR, ITER_DIR, OUT, DIVISIBLE_BY = sys.argv[1:6]
sys.path.insert(0, MBRIDGE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.cuda.current_device = lambda: "cpu"  # stand-ins (see the docstring)
torch.cuda.synchronize = lambda *a, **k: None
torch.nn.Module.cuda = lambda self, device=None: self

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from mbridge.core.safetensor_io import SafeTensorIO  # noqa: E402
import mbridge.models.llama as mbridge_llama  # noqa: E402
from mbridge.models.llama import LLaMABridge  # noqa: E402

# transformers 5 keeps `rope_scaling` as an alias of `rope_parameters` ({"rope_type": "default", ...} for
# plain RoPE); mbridge reads any non-empty one as scaled RoPE and fails with KeyError: 'factor'.
_rope_scaling = mbridge_llama.get_hf_rope_scaling
mbridge_llama.get_hf_rope_scaling = lambda c: None if (_rope_scaling(c) or {}).get("rope_type") == "default" \
    else _rope_scaling(c)


class LocalSpecLLaMABridge(LLaMABridge):
    _OTHER_MAPPING = {**LLaMABridge._OTHER_MAPPING,
                      "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    _MLP_MAPPING = {**LLaMABridge._MLP_MAPPING,
                    "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]}

    def _get_transformer_layer_spec(self, vp_stage=None):
        self.has_vp_stage = False
        return get_gpt_layer_local_spec(normalization="RMSNorm")


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    hf_config = AutoConfig.from_pretrained(CONFIG_DIR)
    bridge = LocalSpecLLaMABridge(hf_config, dtype=torch.bfloat16, make_vocab_size_divisible_by=int(DIVISIBLE_BY))
    bridge.set_extra_args(perform_initialization=False, masked_softmax_fusion=False, sequence_parallel=False)
    models = bridge.get_model(bf16=True, wrap_with_ddp=False)
    inner = models[0].module if hasattr(models[0], "module") else models[0]
    state = dist_checkpointing.load({"model": inner.sharded_state_dict()}, ITER_DIR)
    inner.load_state_dict(state["model"], strict=True)
    bridge.safetensor_io = SafeTensorIO(CONFIG_DIR)
    bridge.save_weights(models, OUT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
