"""Tiny LoRA checkpoints without an engine: a base model directory (``save_pretrained``) and a source
directory holding a peft LoRA model's trainable parameters under their in-memory names (what an
engine checkpoint of a ``PeftModel`` holds) beside its ``adapter_config.json``; and peft's own
``merge_and_unload()`` of the same adapter as the reference.

Used by the adapter-config tests and the adapter-config fuzz (milliseconds per merge once
transformers is imported)."""

import json
from pathlib import Path


def tiny_config(family="llama"):
    if family == "gpt2":  # Conv1D layers: [in, out] weights, peft merges them transposed
        from transformers import GPT2Config

        return GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                          eos_token_id=0)
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                       tie_word_embeddings=False)


def build(root, *, family="llama", seed=0, **lora):
    """``(base_dir, src_dir, peft_model)`` under ``root``: the base in fp32, the adapter's in-memory
    parameters in ``src_dir/model.safetensors`` (B drawn at random so every update is non-zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    root = Path(root)
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(tiny_config(family))
    base_dir, src_dir = root / "base", root / "src"
    base.save_pretrained(base_dir)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"] if family == "llama" else ["c_attn"],
            **lora}
    model = get_peft_model(base, LoraConfig(**lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.2)
    src_dir.mkdir()
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad},
              str(src_dir / "model.safetensors"), metadata={"format": "pt"})
    model.peft_config["default"].save_pretrained(str(src_dir))
    return base_dir, src_dir, model


def reference_merge(model):
    """peft's ``merge_and_unload()`` state dict of ``model`` (a copy: ``model`` is left as it was)."""
    import copy

    return {n: t.clone() for n, t in copy.deepcopy(model).merge_and_unload().state_dict().items()}


def adapter_config(src_dir):
    return json.loads((Path(src_dir) / "adapter_config.json").read_text())


def write_adapter_config(src_dir, cfg, *, raw=None):
    """``cfg`` as ``src_dir/adapter_config.json`` (Python's json writes NaN/Infinity as peft's
    json.load reads them); ``raw`` text instead when given."""
    (Path(src_dir) / "adapter_config.json").write_text(raw if raw is not None else json.dumps(cfg))
