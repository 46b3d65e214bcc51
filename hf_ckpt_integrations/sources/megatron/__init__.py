"""Megatron-Core checkpoints (Megatron-LM, NeMo 2, verl's and slime's Megatron backends) -> ExportPlan.

Both layouts Megatron-LM's ``training/checkpointing.py`` writes: ``torch_dist`` (a DCP directory per
iteration) and the legacy ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files, found from the save
directory (``latest_checkpointed_iteration.txt``) or an ``iter_NNNNNNN/`` directory given directly
(:mod:`.layout` reads both into global tensors; :mod:`.rules` maps them to HF names by box
selection). The HF ``config.json`` comes from the saved ``args`` when none is given
(:func:`hf_config`), and a given one is checked against them. Any TP/PP/DP layout; the optimizer's
state (distributed or not) is never read: the model's weights are in the model state.
"""

import atexit
import json
import os
import shutil
import tempfile
from typing import Any, Dict, List, Optional

from ...errors import CheckpointError, short_repr
from ...plan import ExportPlan
from . import layout, locations, rules

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "OPTIONS", "detect", "config_candidates", "plan", "hf_config"]

NAME = "megatron"
LOOKS_FOR = ("a Megatron-Core save (latest_checkpointed_iteration.txt + iter_NNNNNNN/, or an iter_NNNNNNN/ "
             "directory: torch_dist's .metadata/*.distcp/common.pt, or legacy mp_rank_*/model_optim_rng.pt; verl's "
             "actor/dist_ckpt/, NeMo 2's weights/ + context/, any dir with metadata.json beside .metadata)")
MEMORY_NAMES = False  # the plan holds HF names already (rules.py)
OPTIONS = ()


def detect(path: str, tag: Optional[str] = None) -> bool:
    return tag is None and (layout.iteration_dir(path) is not None or layout.latest_problem(path) is not None
                            or locations.dist_dir(path) is not None)


def _save_dir(path: str) -> Optional[str]:
    """The directory of Megatron's files: Megatron-LM's iteration directory, else verl's ``dist_ckpt/``,
    NeMo 2's ``weights/`` or any dist_checkpointing directory (:func:`locations.dist_dir`)."""
    it = layout.iteration_dir(path)
    if it is not None:
        return it
    found = locations.dist_dir(path)
    return found[0] if found is not None else None


_GENERATED: Dict[str, str] = {}  # checkpoint dir -> the directory holding the config.json derived from its args


def _cleanup() -> None:
    for d in _GENERATED.values():
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_cleanup)


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    """The save dir, the iteration dir, then a directory holding the config.json derived from the args
    (:func:`hf_config`; none when the args do not say enough, and the export then asks for --config)."""
    it = _save_dir(path)
    found = [p for p in (path, it, os.path.dirname(os.path.abspath(path))) if p is not None]
    if it is None:
        return found
    verl_hf = locations.verl_hf_dir(it) if layout.iteration_dir(path) is None else None
    if verl_hf is not None:  # verl's huggingface/ beside dist_ckpt/: its config.json and tokenizer first
        found = [verl_hf] + found
    key = os.path.abspath(it)
    if key not in _GENERATED:
        try:
            cfg = hf_config(layout.read_args(it))
        except CheckpointError:
            return found
        if cfg is None:
            return found
        d = tempfile.mkdtemp(prefix="hfckpt-megatron-config-")
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump(cfg, fh, indent=2, sort_keys=True)
            fh.write("\n")
        _GENERATED[key] = d
    return found + [_GENERATED[key]]


def _arg(args, *names, default=None):
    for n in names:
        v = args.get(n)
        if v is not None:
            return v
    return default


def family(args: Dict[str, Any]) -> str:
    if _arg(args, "num_experts"):
        return moe_family(args)
    if _is_gpt(args):
        return _gpt_family(args)
    if _arg(args, "normalization") != "RMSNorm" or not _arg(args, "swiglu", "gated_linear_unit") \
            or _arg(args, "position_embedding_type") != "rope":
        raise CheckpointError("a Megatron GPT save without RMSNorm + SwiGLU + RoPE (args.normalization="
                              f"{_arg(args, 'normalization')!r}, swiglu={_arg(args, 'swiglu')!r}, "
                              f"position_embedding_type={_arg(args, 'position_embedding_type')!r}): hf-ckpt maps "
                              "Llama-like models (RMSNorm + SwiGLU + RoPE) and GPT (LayerNorm + GELU + learned "
                              "positions + linear biases) so far")
    if _arg(args, "add_bias_linear"):
        raise CheckpointError("a Megatron save with linear biases (args.add_bias_linear): no HF Llama/Qwen2 class "
                              "holds them; not supported yet")
    return "qwen2" if _arg(args, "add_qkv_bias") else "llama"


def _moe_checks(args: Dict[str, Any], qwen: bool) -> None:
    if _arg(args, "normalization") != "RMSNorm" or not _arg(args, "swiglu", "gated_linear_unit") \
            or _arg(args, "position_embedding_type") != "rope":
        raise CheckpointError("a Megatron MoE save without RMSNorm + SwiGLU + RoPE (args.normalization="
                              f"{_arg(args, 'normalization')!r}, swiglu={_arg(args, 'swiglu')!r}, "
                              f"position_embedding_type={_arg(args, 'position_embedding_type')!r}): hf-ckpt maps "
                              "Mixtral- and Qwen2-MoE-like models")
    if _arg(args, "add_bias_linear") or _arg(args, "add_qkv_bias") and not qwen:
        raise CheckpointError("a Megatron MoE save with linear or q/k/v biases (args.add_bias_linear / add_qkv_bias): "
                              "HF Mixtral holds none (Qwen2-MoE: q/k/v biases only); not supported yet")


def moe_family(args: Dict[str, Any]) -> str:
    """The HF family of a Megatron MoE save (``args.num_experts`` set), every layer MoE, SequentialMLP
    experts, a softmax router: Mixtral without a shared expert (its top-k weights renormalised: Megatron's
    default, softmax over the top-k logits), Qwen2-MoE with one (gated by a sigmoid; ``norm_topk_prob`` is
    whether the weights are renormalised, i.e. not ``moe_router_pre_softmax``). Anything else is refused
    naming the argument."""
    qwen = bool(_arg(args, "moe_shared_expert_intermediate_size"))
    _moe_checks(args, qwen)
    if qwen and not _arg(args, "moe_shared_expert_gate"):
        raise CheckpointError("a Megatron MoE save with a shared expert but args.moe_shared_expert_gate off: HF "
                              "Qwen2-MoE gates its shared expert (an ungated one, DeepSeek's, is not supported yet)")
    refusals = (
        ("moe_layer_freq", lambda v: v not in (None, 1) and not (isinstance(v, list) and set(v) == {1}),
         "dense layers between the MoE ones: HF Mixtral has an MoE block in every layer"),
        ("moe_router_score_function", lambda v: v not in (None, "softmax"), "HF Mixtral's router is a softmax"),
        ("moe_router_pre_softmax", lambda v: bool(v) and not qwen and _arg(args, "moe_router_topk", default=2) > 1,
         "softmax before top-k leaves the weights unnormalised; HF Mixtral renormalises them"),
        ("moe_grouped_gemm", lambda v: bool(v), "grouped-GEMM experts (TE / grouped_gemm) are not tested here; "
         "save with SequentialMLP (moe_grouped_gemm off)"),
        ("moe_router_enable_expert_bias", lambda v: bool(v), "a router expert bias: HF Mixtral has none"),
        ("moe_router_topk_scaling_factor", lambda v: v not in (None, 1, 1.0), "HF Mixtral does not scale the top-k "
         "weights"),
    )
    for key, bad, why in refusals:
        value = args.get(key)
        if bad(value):
            raise CheckpointError(f"a Megatron MoE save with args.{key}={short_repr(value)}: {why}")
    etp = _arg(args, "expert_tensor_parallel_size")
    tp = _arg(args, "tensor_model_parallel_size", default=1)
    if etp is not None and etp != tp:
        raise CheckpointError(f"a Megatron MoE save with args.expert_tensor_parallel_size={etp} != "
                              f"tensor_model_parallel_size={tp}: hf-ckpt reads experts split like the dense layers "
                              "only so far")
    return "qwen2_moe" if qwen else "mixtral"


def _moe_dims(args: Dict[str, Any]) -> Dict[str, Any]:
    """The MoE fields of HF Mixtral's / Qwen2-MoE's config.json the args give."""
    topk = _arg(args, "moe_router_topk", default=2)
    expert_ffn = _arg(args, "moe_ffn_hidden_size", "ffn_hidden_size")
    shared = _arg(args, "moe_shared_expert_intermediate_size")
    if not shared:
        return {"num_local_experts": _arg(args, "num_experts"), "num_experts_per_tok": topk,
                "intermediate_size": expert_ffn}
    return {"num_experts": _arg(args, "num_experts"), "num_experts_per_tok": topk, "moe_intermediate_size": expert_ffn,
            "shared_expert_intermediate_size": shared,
            "norm_topk_prob": not _arg(args, "moe_router_pre_softmax", default=False)}
# ---------------------------------------------------------------- GPT (LayerNorm, biases, learned positions)
# HF class: GPTBigCode. Its c_attn (multi_query false) is viewed as [heads, 3 x head_dim]: per head
# [q_h, k_h, v_h], which is Megatron's linear_qkv with one query group per head, so the mapping is renames
# only (rules/gpt.json). GPT2 would need every Linear transposed (Conv1D) and a per-head q/k/v regroup.


def _is_gpt(args: Dict[str, Any]) -> bool:
    """A GPT-2-like save: LayerNorm, learned absolute positions, no gated MLP (Megatron-LM's defaults)."""
    return (_arg(args, "normalization", default="LayerNorm") == "LayerNorm"
            and _arg(args, "position_embedding_type", default="learned_absolute") == "learned_absolute"
            and not _arg(args, "swiglu", "gated_linear_unit"))


def _gpt_family(args: Dict[str, Any]) -> str:
    """"gpt" when GPTBigCode holds the model ``args`` describe; else refused naming the arg."""
    heads = _arg(args, "num_attention_heads")
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else heads
    hidden = _arg(args, "hidden_size")
    refuse = None
    if not _arg(args, "add_bias_linear", default=True):
        refuse = "args.add_bias_linear is False (GPTBigCode's Linear layers all have biases)"
    elif groups not in (heads, 1):
        refuse = (f"args.num_query_groups is {groups} with {heads} heads (GQA: GPTBigCode holds one query group per "
                  "head, multi_query false, or one for all, multi_query true)")
    elif isinstance(hidden, int) and isinstance(heads, int) and _arg(args, "kv_channels") not in (None, hidden // heads):
        refuse = f"args.kv_channels is {_arg(args, 'kv_channels')}, not hidden_size / heads = {hidden // heads}"
    elif _arg(args, "openai_gelu") or _arg(args, "squared_relu") or _arg(args, "quick_geglu"):
        refuse = "its activation is not Megatron's erf GELU (args.openai_gelu / squared_relu / quick_geglu)"
    elif _arg(args, "apply_residual_connection_post_layernorm"):
        refuse = "args.apply_residual_connection_post_layernorm is set (GPTBigCode adds the residual before the norm)"
    elif _arg(args, "qk_layernorm"):
        refuse = "args.qk_layernorm is set (GPTBigCode has no q/k norms)"
    if refuse:
        raise CheckpointError(f"a Megatron GPT save (LayerNorm, learned positions) whose {refuse}: hf-ckpt maps "
                              "GPT saves to GPTBigCode, which cannot hold it; not supported")
    return "gpt"


def _gpt_dims(args: Dict[str, Any]) -> Dict[str, Any]:
    """GPTBigCode's config keys (as config.json spells them) for ``args``."""
    return {"n_embd": _arg(args, "hidden_size"), "n_inner": _arg(args, "ffn_hidden_size"),
            "n_layer": _arg(args, "num_layers"), "n_head": _arg(args, "num_attention_heads"),
            "n_positions": _arg(args, "max_position_embeddings", "seq_length"), "multi_query": _multi_query(args),
            "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", default=False)}


def _multi_query(args: Dict[str, Any]) -> bool:
    """One query group for several heads (MQA): GPTBigCode's multi_query, whose c_attn is [q; k; v], Megatron's
    linear_qkv with one group."""
    heads = _arg(args, "num_attention_heads")
    return bool(_arg(args, "group_query_attention")) and _arg(args, "num_query_groups") == 1 and heads != 1


def _gpt_config(args: Dict[str, Any]) -> Optional[dict]:
    dims = _gpt_dims(args)
    if not all(isinstance(v, int) for k, v in dims.items() if k not in ("tie_word_embeddings", "multi_query")):
        return None
    vocab = args["vocab_size"]
    cfg = {"architectures": ["GPTBigCodeForCausalLM"], **dims, "vocab_size": vocab,
           "layer_norm_epsilon": float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
           "activation_function": "gelu",  # Megatron's F.gelu (erf); GPTBigCode's default is the tanh one
           # Megatron records no special tokens; GPTBigCode's defaults (50256) would lie outside a small vocabulary
           "bos_token_id": None if vocab <= 50256 else 50256, "eos_token_id": None if vocab <= 50256 else 50256}
    for key, arg in (("resid_pdrop", "hidden_dropout"), ("embd_pdrop", "hidden_dropout"),
                     ("attn_pdrop", "attention_dropout")):  # training-time only; the run's when recorded
        if isinstance(_arg(args, arg), (int, float)):
            cfg[key] = float(_arg(args, arg))
    try:
        from transformers import AutoConfig

        return AutoConfig.for_model("gpt_bigcode", **cfg).to_dict()
    except ImportError:
        return {"model_type": "gpt_bigcode", **cfg}


def _gpt_args_from_config(cfg: dict) -> Dict[str, Any]:
    """The Megatron arguments a GPTBigCode ``config.json`` stands for (a save without its args)."""
    heads, hidden = cfg.get("n_head"), cfg.get("n_embd")
    return {"num_layers": cfg.get("n_layer"), "hidden_size": hidden, "num_attention_heads": heads,
            "ffn_hidden_size": cfg.get("n_inner") or (4 * hidden if isinstance(hidden, int) else None),
            "group_query_attention": bool(cfg.get("multi_query", True)), "num_query_groups": 1,
            "kv_channels": hidden // heads if isinstance(hidden, int) and heads else None,
            "max_position_embeddings": cfg.get("n_positions"),
            "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", True),
            "normalization": "LayerNorm", "swiglu": False, "position_embedding_type": "learned_absolute",
            "add_bias_linear": True, "vocab_size": cfg.get("vocab_size")}


def _check_gpt_config(cfg: dict, args: Dict[str, Any], where: str) -> None:
    if cfg.get("model_type") != "gpt_bigcode":
        raise CheckpointError(f"{where}: model_type {cfg.get('model_type')!r}, but the Megatron save's args describe a "
                              "GPT model (LayerNorm, learned positions), exported as gpt_bigcode; pass --config the "
                              "config.json of the model that was trained")
    for key, want in _gpt_dims(args).items():
        have = cfg.get(key, {"multi_query": True, "tie_word_embeddings": True}.get(key))  # the class's defaults
        if key == "n_inner" and have is None and isinstance(cfg.get("n_embd"), int):
            have = 4 * cfg["n_embd"]
        if want is not None and have != want:
            raise CheckpointError(f"{where}: {key} is {have!r}, but the Megatron save's args give {want!r}; pass "
                                  "--config the config.json of the model that was trained")
    act = cfg.get("activation_function", "gelu_pytorch_tanh")
    if act != "gelu":
        raise CheckpointError(f"{where}: activation_function is {act!r}, but Megatron's GPT uses erf GELU ('gelu'); "
                              "the exported model would not give Megatron's logits: fix the config")


def _dims(args: Dict[str, Any]) -> Dict[str, Any]:
    heads = _arg(args, "num_attention_heads")
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else heads
    hidden = _arg(args, "hidden_size")
    return {"hidden_size": hidden, "intermediate_size": _arg(args, "ffn_hidden_size"),
            "num_hidden_layers": _arg(args, "num_layers"), "num_attention_heads": heads,
            "num_key_value_heads": groups, "head_dim": _arg(args, "kv_channels",
                                                            default=hidden // heads if hidden and heads else None),
            "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", default=False),
            **(_moe_dims(args) if _arg(args, "num_experts") else {})}


def hf_config(args: Dict[str, Any]) -> Optional[dict]:
    """The HF config.json of the model ``args`` (Megatron-LM's arguments) describe, or None when they
    do not say enough (no vocab_size: Megatron records only the padded size; pass --config)."""
    if not args or not isinstance(_arg(args, "vocab_size"), int):
        return None
    fam = family(args)
    if fam == "gpt":
        return _gpt_config(args)
    dims = _dims(args)
    if not all(isinstance(v, int) for k, v in dims.items() if k != "tie_word_embeddings"):
        return None
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM"}[fam]
    cfg = {"architectures": [arch], "model_type": fam, **dims, "vocab_size": args["vocab_size"],
           "max_position_embeddings": _arg(args, "max_position_embeddings", "seq_length"),
           "rms_norm_eps": float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
           "rope_theta": float(_arg(args, "rotary_base", default=10000)), "hidden_act": "silu",
           "attention_bias": bool(_arg(args, "add_qkv_bias", default=False))}
    if fam in ("qwen2", "mixtral", "qwen2_moe"):  # no attention_bias field (MoE fields from _dims)
        bias = cfg.pop("attention_bias")
        if fam == "qwen2_moe":  # every layer sparse; qkv_bias is Qwen2-MoE's name for it
            cfg.update(qkv_bias=bias, decoder_sparse_step=1, mlp_only_layers=[])
    try:  # what save_pretrained writes for this config (every default field), when transformers is there
        from transformers import AutoConfig

        return AutoConfig.for_model(fam, **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
    except ImportError:
        return cfg


def args_from_config(cfg: dict, where: str) -> Dict[str, Any]:
    """The Megatron arguments an HF Llama/Qwen2 ``config.json`` stands for (a save without its args)."""
    kind = cfg.get("model_type")
    if kind == "gpt_bigcode":
        return _gpt_args_from_config(cfg)
    if kind not in ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe"):
        raise CheckpointError(f"{where}: model_type {kind!r}; hf-ckpt maps Megatron saves to llama, mistral, qwen2, "
                              "mixtral, qwen2_moe or gpt_bigcode")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    return {"num_layers": cfg.get("num_hidden_layers"), "hidden_size": hidden,
            "ffn_hidden_size": cfg.get("intermediate_size"), "num_attention_heads": heads,
            "group_query_attention": True, "num_query_groups": cfg.get("num_key_value_heads", heads),
            "kv_channels": cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None),
            "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", True),
            "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
            "add_qkv_bias": kind == "qwen2" or bool(cfg.get("attention_bias")) or
            kind == "qwen2_moe" and bool(cfg.get("qkv_bias", True)), "vocab_size": cfg.get("vocab_size"),
            **(_moe_args(cfg) if kind in ("mixtral", "qwen2_moe") else {})}


def _moe_args(cfg: dict) -> Dict[str, Any]:
    """The Megatron MoE arguments an HF Mixtral config stands for."""
    if cfg.get("model_type") == "qwen2_moe":
        return {"num_experts": cfg.get("num_experts"), "moe_router_topk": cfg.get("num_experts_per_tok"),
                "moe_ffn_hidden_size": cfg.get("moe_intermediate_size"),
                "moe_shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size"),
                "moe_shared_expert_gate": True, "moe_router_pre_softmax": not cfg.get("norm_topk_prob", False)}
    return {"num_experts": cfg.get("num_local_experts"), "moe_router_topk": cfg.get("num_experts_per_tok"),
            "moe_ffn_hidden_size": cfg.get("intermediate_size")}


def _check_config(cfg: dict, args: Dict[str, Any], where: str) -> None:
    """A given config.json must describe the model the args do (a mismatch names both values)."""
    if _is_gpt(args):
        return _check_gpt_config(cfg, args, where)
    for key, want in _dims(args).items():
        if want is None or key not in cfg and key in ("head_dim", "tie_word_embeddings"):
            continue
        have = cfg.get(key)
        if key == "tie_word_embeddings" and have is None:
            have = True  # PretrainedConfig's default
        if have != want:
            raise CheckpointError(f"{where}: {key} is {have!r}, but the Megatron save's args give {want!r}; pass "
                                  "--config the config.json of the model that was trained")


def _optimizer_note(found: Dict[str, Any], distributed: bool) -> Optional[str]:
    """inspect's line on the optimizer state the save holds (never read: the weights are the model's)."""
    sharding, files = found.get("optimizer_sharding"), found.get("distrib_optim_files")
    if sharding or files or distributed:
        where = (f"torch_dist sharding {sharding}, {found.get('optimizer_tensors', 0)} optimizer. tensors" if sharding
                 else f"{files} distrib_optim.pt file(s)" if files else "args.use_distributed_optimizer")
        return f"distributed optimizer ({where}): its state is not read; the weights come from the model state"
    if found.get("optimizer_tensors"):
        return f"optimizer state ({found['optimizer_tensors']} optimizer. tensors): not read"
    return None


def plan(ctx) -> ExportPlan:
    it = _save_dir(ctx.path)
    if it is None:
        raise CheckpointError(layout.latest_problem(ctx.path) or f"{ctx.path}: no Megatron iteration directory")
    save = layout.read(it)
    other = locations.dist_dir(ctx.path) if layout.iteration_dir(ctx.path) is None else None
    kind = other[1] if other is not None else "megatron-lm"
    save = locations.strip_module_prefix(save)
    args = save.args
    cfg = ctx.config if ctx.config_dir is not None else None
    where = os.path.join(ctx.config_dir, "config.json") if ctx.config_dir else None
    if not args:  # Megatron-Core 0.17+ (no common.pt): the config says what the args would
        if cfg is None:
            if kind == "nemo2":
                raise CheckpointError(f"{it}: a NeMo 2 save holds no Megatron-LM args (its context/model.yaml is "
                                      "not read: it names Python classes); pass --config DIR holding the model's "
                                      "HF config.json")
            if kind == "verl":
                raise CheckpointError(f"{it}: a verl save holds no Megatron-LM args and no config.json in "
                                      f"{os.path.join(os.path.dirname(it), locations.VERL_HF)}; pass --config DIR "
                                      "holding the model's HF config.json")
            raise CheckpointError(f"{it}: no common.pt (Megatron-Core 0.17+ keeps the saved args inside the .distcp "
                                  "files); pass --config DIR holding the model's config.json")
        args = args_from_config(cfg, where)
    if cfg is not None:
        _check_config(cfg, args, where)
    fam = family(args)
    dims = _dims(args)
    vocab = (cfg or {}).get("vocab_size", _arg(args, "vocab_size"))
    if not isinstance(vocab, int):
        raise CheckpointError(f"{it}: the save records only the padded vocabulary size; pass --config DIR holding "
                              "the model's config.json (its vocab_size)")
    params = {"vocab_size": vocab, "num_query_groups": dims["num_key_value_heads"],
              "q_rows": dims["num_attention_heads"] // dims["num_key_value_heads"] * dims["head_dim"],
              "head_dim": dims["head_dim"], "ffn_hidden_size": dims["intermediate_size"]}
    if fam == "mixtral":
        params["moe_ffn_hidden_size"] = dims["intermediate_size"]
    if fam == "qwen2_moe":
        params.update(moe_ffn_hidden_size=dims["moe_intermediate_size"],
                      shared_ffn_hidden_size=dims["shared_expert_intermediate_size"])
    done = rules.apply(fam, save.tensors, params)
    tensors = done.tensors
    rows = {n: save.tensors[n].shape[0] for n in rules.VOCAB_TENSORS if n in save.tensors}
    padding = {c["into"][0]: (rows[c["source"]], vocab) for c in done.conversions
               if c["source"] in rows and rows[c["source"]] > vocab}
    if dims["tie_word_embeddings"] and "output_layer.weight" in save.tensors:
        raise CheckpointError(f"{it}: args say the embeddings are tied, yet output_layer.weight is saved")
    tp = _arg(args, "tensor_model_parallel_size", default=1)
    pp = _arg(args, "pipeline_model_parallel_size", default=1)
    detail = {"format": save.fmt, "iteration": save.iteration, "tp_size": tp, "pp_size": pp,
              "dp_size": _arg(args, "data_parallel_size"), "ep_size": _arg(args, "expert_model_parallel_size",
                                                                           default=1),
              "vpp_size": _arg(args, "virtual_pipeline_model_parallel_size", default=1),
              "family": fam, "distributed_optimizer": bool(_arg(args, "use_distributed_optimizer")
                                                           or save.layout.get("optimizer_sharding")
                                                           or save.layout.get("distrib_optim_files")),
              "padded_vocab_size": _arg(args, "padded_vocab_size"), "saved_by": kind, **save.layout,
              # inspect's "world" line: the model-parallel ranks are TP x PP (EP within them)
              "mp_size": tp * pp, "mp_axis": f"Megatron TP {tp} x PP {pp}"}
    notes = [f"Megatron-Core {save.fmt} save, iteration {save.iteration}: TP {tp} x PP {pp} (DP {detail['dp_size']}, "
             f"EP {detail['ep_size']}); {len(save.tensors)} global tensors -> {len(tensors)} HF tensors ({fam})"]
    opt_note = _optimizer_note(save.layout, detail["distributed_optimizer"])
    if opt_note:
        notes.append(opt_note)
    dtypes = {t.src_dtype for t in tensors}
    out = ExportPlan(engine=NAME, source=os.path.abspath(ctx.path), tag=None, tensors=tensors,
                     dtypes={"module": dtypes.pop()} if len(dtypes) == 1 else {}, config_dir=ctx.config_dir,
                     files=save.files, notes=notes, detail=detail)
    out.padding_removed = padding
    out.conversions = done.conversions
    return out
