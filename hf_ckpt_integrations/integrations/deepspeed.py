"""DeepSpeed save-time helper: record ``universal_checkpoint_info`` for HF models split by hand.

DeepSpeed's AutoTP records how each parameter was split; a custom tensor-parallel ``mpu``
(Megatron / GPT-NeoX style, or an HF model split by hand) records nothing, and
``ds_to_universal`` then either refuses the checkpoint or, given an empty record, concatenates
replicated parameters such as layernorms (it cannot tell a replica from a slice).
:func:`save_checkpoint` derives the record
from the HF tp plan and the actual shapes on this rank and attaches it to the client state::

    from hf_ckpt_integrations.integrations.deepspeed import save_checkpoint
    save_checkpoint(engine, "ckpt", tag="global_step100")   # instead of engine.save_checkpoint(...)

Call it on every rank, as ``engine.save_checkpoint`` itself.
"""

import re
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from ..convert.tp_rules import hf_plans_for, rule_from_hf_plan

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from transformers import PretrainedConfig

__all__ = ["derive_universal_checkpoint_info", "universal_checkpoint_info", "save_checkpoint"]

# deepspeed/checkpoint/constants.py UNIVERSAL_CHECKPOINT_VERSION_VALUE in 0.19.8
_DEFAULT_UC_VERSION = 0.4


def _pattern(name: str) -> str:
    return "^" + re.escape(name) + "$"


def derive_universal_checkpoint_info(local_shapes: Mapping[str, Tuple[int, ...]],
                                     full_shapes: Mapping[str, Tuple[int, ...]], *,
                                     tp_plans: Optional[Dict[str, str]] = None, embeddings: Sequence[str] = (),
                                     vocab_size: Optional[int] = None, version: float = _DEFAULT_UC_VERSION) -> dict:
    """The ``universal_checkpoint_info`` dict for parameters of ``local_shapes`` (this rank's).

    A parameter whose local shape is its full shape is replicated. Otherwise its split dim comes
    from the HF tp plan, or else from the one dim whose local size is smaller than the full one;
    dim 1 is row parallel; dim 0 of a tensor whose rows are the vocabulary is a vocabulary
    parameter (``original_vocab_size`` lets ``ds_to_universal`` drop padding). Raises
    ``ValueError`` naming a parameter whose split cannot be told.
    """
    replicated, rows, vocab = [], [], []
    for name, local in local_shapes.items():
        full = full_shapes.get(name)
        if full is None:
            raise ValueError(f"{name}: not a parameter of the model the config describes")
        local, full = tuple(local), tuple(full)
        if local == full:
            replicated.append(_pattern(name))
            continue
        rule = rule_from_hf_plan(name, tp_plans or {}, embeddings) if tp_plans else None
        if rule is not None and not rule.replicated:
            dim = rule.dim
        else:
            dims = [d for d in range(len(full)) if len(local) == len(full) and local[d] < full[d]]
            if len(dims) != 1:
                raise ValueError(f"{name}: local shape {list(local)} vs full {list(full)}: cannot tell the split dim")
            dim = dims[0]
        if dim == 1:
            rows.append(_pattern(name))
        elif vocab_size is not None and full[0] == vocab_size:
            vocab.append(_pattern(name))
    info = {"universal_checkpoint_version": version, "tp_replicated_parameter_patterns": replicated,
            "parameter_with_row_parallelism_patterns": rows, "vocabulary_parameter_patterns": vocab}
    if vocab_size is not None:
        info["original_vocab_size"] = int(vocab_size)
    return info


def universal_checkpoint_info(model: "torch.nn.Module",
                              config_dir_or_config: "Union[str, PretrainedConfig, None]" = None) -> Dict[str, Any]:
    """Derive the record for a live (possibly ZeRO-3 partitioned) HF ``model`` on this rank."""
    import tempfile

    config = getattr(model, "config", None) if config_dir_or_config is None else config_dir_or_config
    assert config is not None, "the model has no config: pass config_dir_or_config"
    with tempfile.TemporaryDirectory() as d:
        if isinstance(config, str):
            d = config
        else:
            config.save_pretrained(d)
        plans, full, embeddings = hf_plans_for(d)
    local = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in model.named_parameters()}
    try:
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_VERSION_VALUE as version
    except ImportError:
        version = _DEFAULT_UC_VERSION
    return derive_universal_checkpoint_info(local, full, tp_plans=plans, embeddings=embeddings,
                                            vocab_size=getattr(config, "vocab_size", None) if not isinstance(config, str)
                                            else None, version=version)


def save_checkpoint(engine: "DeepSpeedEngine", save_dir: str, tag: Optional[str] = None,
                    client_state: Optional[Mapping[str, Any]] = None, **kwargs: Any) -> bool:
    """``engine.save_checkpoint`` with ``universal_checkpoint_info`` derived from ``engine.module``."""
    state = dict(client_state or {})
    state.setdefault("universal_checkpoint_info", universal_checkpoint_info(engine.module))
    return engine.save_checkpoint(save_dir, tag=tag, client_state=state, **kwargs)
