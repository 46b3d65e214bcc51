"""Tiny models of each family the Hub-layout matrix trains (``family_train.py``,
``family_trainer_cb.py``): hidden 32, 2 layers, a vocabulary that is not a round number.

``build(family)`` -> ``(model, batch(step, rank) -> forward kwargs)``, seeded, on CPU in fp32.
"""
import torch

VOCAB = 101
FAMILIES = ("llama", "gpt2", "t5", "bert", "mixtral", "qwen2_moe", "llava")
MOE = ("mixtral", "qwen2_moe")


def config(family):
    import transformers as tf

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    if family == "llama":
        return tf.LlamaConfig(**small)
    if family == "gpt2":  # Conv1D weights, lm_head tied to wte
        return tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                             bos_token_id=0, eos_token_id=0)
    if family == "t5":  # encoder-decoder, shared embedding tied three ways
        return tf.T5Config(d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, vocab_size=VOCAB,
                           decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    if family == "bert":  # MLM head: decoder tied to the word embeddings, its bias to cls.predictions.bias
        return tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             vocab_size=VOCAB, max_position_embeddings=64)
    if family == "mixtral":  # experts fused in memory by transformers 5 (gate_up_proj [E, 2I, H])
        return tf.MixtralConfig(**{**small, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2)
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(**small, moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                 num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    if family == "llava":  # the text model nested as text_config
        text = tf.LlamaConfig(**small)
        vision = tf.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=16, patch_size=8, projection_dim=16)
        return tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=VOCAB - 1)
    raise ValueError(family)


def model_class(family):
    import transformers as tf

    return {"llama": tf.LlamaForCausalLM, "gpt2": tf.GPT2LMHeadModel, "t5": tf.T5ForConditionalGeneration,
            "bert": tf.BertForMaskedLM, "mixtral": tf.MixtralForCausalLM, "qwen2_moe": tf.Qwen2MoeForCausalLM,
            "llava": tf.LlavaForConditionalGeneration}[family]


def build(family):
    torch.manual_seed(0)
    cfg = config(family)
    cls = model_class(family)
    cfg.architectures = [cls.__name__]  # as save_pretrained records it
    return cls(cfg)


def batch(family, step, rank, *, size=2, seq=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(2, VOCAB - 1, (size, seq), generator=g)  # no image token, no pad/eos
    if family == "t5":
        return {"input_ids": ids, "labels": ids.flip(1)}
    return {"input_ids": ids, "labels": ids}


def reference_save(family, masters, directory):
    """``save_pretrained`` of a plain model holding the engine's fp32 masters: the layout to match."""
    model = build(family)
    missing, unexpected = model.load_state_dict(masters, strict=False)
    tied = {n for n in missing if n not in dict(model.named_parameters())}
    assert not unexpected and not set(missing) - tied, (missing, unexpected)
    model.save_pretrained(directory)
