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

from ...errors import CheckpointError
from ...plan import ExportPlan
from . import layout, rules

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "OPTIONS", "detect", "config_candidates", "plan", "hf_config"]

NAME = "megatron"
LOOKS_FOR = ("a Megatron-Core save (latest_checkpointed_iteration.txt + iter_NNNNNNN/, or an iter_NNNNNNN/ "
             "directory: torch_dist's .metadata/*.distcp/common.pt, or legacy mp_rank_*/model_optim_rng.pt)")
MEMORY_NAMES = False  # the plan holds HF names already (rules.py)
OPTIONS = ()


def detect(path: str, tag: Optional[str] = None) -> bool:
    return tag is None and (layout.iteration_dir(path) is not None or layout.latest_problem(path) is not None)


_GENERATED: Dict[str, str] = {}  # checkpoint dir -> the directory holding the config.json derived from its args


def _cleanup() -> None:
    for d in _GENERATED.values():
        shutil.rmtree(d, ignore_errors=True)


atexit.register(_cleanup)


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    """The save dir, the iteration dir, then a directory holding the config.json derived from the args
    (:func:`hf_config`; none when the args do not say enough, and the export then asks for --config)."""
    it = layout.iteration_dir(path)
    found = [p for p in (path, it, os.path.dirname(os.path.abspath(path))) if p is not None]
    if it is None:
        return found
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
        raise CheckpointError("a Megatron MoE save (args.num_experts is set): hf-ckpt maps dense GPT models "
                              "(Llama/Mistral, Qwen2) so far; MoE (Mixtral/Qwen-MoE) is not supported yet")
    if _arg(args, "normalization") != "RMSNorm" or not _arg(args, "swiglu", "gated_linear_unit") \
            or _arg(args, "position_embedding_type") != "rope":
        raise CheckpointError("a Megatron GPT save without RMSNorm + SwiGLU + RoPE (args.normalization="
                              f"{_arg(args, 'normalization')!r}, swiglu={_arg(args, 'swiglu')!r}, "
                              f"position_embedding_type={_arg(args, 'position_embedding_type')!r}): hf-ckpt maps "
                              "Llama-like models so far; GPT (LayerNorm, learned positions) is not supported yet")
    if _arg(args, "add_bias_linear"):
        raise CheckpointError("a Megatron save with linear biases (args.add_bias_linear): no HF Llama/Qwen2 class "
                              "holds them; not supported yet")
    return "qwen2" if _arg(args, "add_qkv_bias") else "llama"


def _dims(args: Dict[str, Any]) -> Dict[str, Any]:
    heads = _arg(args, "num_attention_heads")
    groups = _arg(args, "num_query_groups") if _arg(args, "group_query_attention") else heads
    hidden = _arg(args, "hidden_size")
    return {"hidden_size": hidden, "intermediate_size": _arg(args, "ffn_hidden_size"),
            "num_hidden_layers": _arg(args, "num_layers"), "num_attention_heads": heads,
            "num_key_value_heads": groups, "head_dim": _arg(args, "kv_channels",
                                                            default=hidden // heads if hidden and heads else None),
            "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", default=False)}


def hf_config(args: Dict[str, Any]) -> Optional[dict]:
    """The HF config.json of the model ``args`` (Megatron-LM's arguments) describe, or None when they
    do not say enough (no vocab_size: Megatron records only the padded size; pass --config)."""
    if not args or not isinstance(_arg(args, "vocab_size"), int):
        return None
    fam = family(args)
    dims = _dims(args)
    if not all(isinstance(v, int) for k, v in dims.items() if k != "tie_word_embeddings"):
        return None
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[fam]
    cfg = {"architectures": [arch], "model_type": fam, **dims, "vocab_size": args["vocab_size"],
           "max_position_embeddings": _arg(args, "max_position_embeddings", "seq_length"),
           "rms_norm_eps": float(_arg(args, "norm_epsilon", "layernorm_epsilon", default=1e-5)),
           "rope_theta": float(_arg(args, "rotary_base", default=10000)), "hidden_act": "silu",
           "attention_bias": bool(_arg(args, "add_qkv_bias", default=False))}
    if fam == "qwen2":
        cfg.pop("attention_bias")
    try:  # what save_pretrained writes for this config (every default field), when transformers is there
        from transformers import AutoConfig

        return AutoConfig.for_model(fam, **{k: v for k, v in cfg.items() if k != "model_type"}).to_dict()
    except ImportError:
        return cfg


def args_from_config(cfg: dict, where: str) -> Dict[str, Any]:
    """The Megatron arguments an HF Llama/Qwen2 ``config.json`` stands for (a save without its args)."""
    kind = cfg.get("model_type")
    if kind not in ("llama", "mistral", "qwen2"):
        raise CheckpointError(f"{where}: model_type {kind!r}; hf-ckpt maps Megatron saves to llama, mistral or qwen2")
    heads, hidden = cfg.get("num_attention_heads"), cfg.get("hidden_size")
    return {"num_layers": cfg.get("num_hidden_layers"), "hidden_size": hidden,
            "ffn_hidden_size": cfg.get("intermediate_size"), "num_attention_heads": heads,
            "group_query_attention": True, "num_query_groups": cfg.get("num_key_value_heads", heads),
            "kv_channels": cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None),
            "untie_embeddings_and_output_weights": not cfg.get("tie_word_embeddings", True),
            "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope",
            "add_qkv_bias": kind == "qwen2" or bool(cfg.get("attention_bias")), "vocab_size": cfg.get("vocab_size")}


def _check_config(cfg: dict, args: Dict[str, Any], where: str) -> None:
    """A given config.json must describe the model the args do (a mismatch names both values)."""
    for key, want in _dims(args).items():
        if want is None or key not in cfg and key in ("head_dim", "tie_word_embeddings"):
            continue
        have = cfg.get(key)
        if key == "tie_word_embeddings" and have is None:
            have = True  # PretrainedConfig's default
        if have != want:
            raise CheckpointError(f"{where}: {key} is {have!r}, but the Megatron save's args give {want!r}; pass "
                                  "--config the config.json of the model that was trained")


def plan(ctx) -> ExportPlan:
    it = layout.iteration_dir(ctx.path)
    if it is None:
        raise CheckpointError(layout.latest_problem(ctx.path) or f"{ctx.path}: no Megatron iteration directory")
    save = layout.read(it)
    args = save.args
    cfg = ctx.config if ctx.config_dir is not None else None
    where = os.path.join(ctx.config_dir, "config.json") if ctx.config_dir else None
    if not args:  # Megatron-Core 0.17+ (no common.pt): the config says what the args would
        if cfg is None:
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
              "family": fam, "distributed_optimizer": bool(_arg(args, "use_distributed_optimizer")),
              "padded_vocab_size": _arg(args, "padded_vocab_size"), **save.layout,
              # inspect's "world" line: the model-parallel ranks are TP x PP (EP within them)
              "mp_size": tp * pp, "mp_axis": f"Megatron TP {tp} x PP {pp}"}
    notes = [f"Megatron-Core {save.fmt} save, iteration {save.iteration}: TP {tp} x PP {pp} (DP {detail['dp_size']}, "
             f"EP {detail['ep_size']}); {len(save.tensors)} global tensors -> {len(tensors)} HF tensors ({fam})"]
    dtypes = {t.src_dtype for t in tensors}
    out = ExportPlan(engine=NAME, source=os.path.abspath(ctx.path), tag=None, tensors=tensors,
                     dtypes={"module": dtypes.pop()} if len(dtypes) == 1 else {}, config_dir=ctx.config_dir,
                     files=save.files, notes=notes, detail=detail)
    out.padding_removed = padding
    out.conversions = done.conversions
    return out
