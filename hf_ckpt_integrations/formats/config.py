"""The one config writer: the ``config.json`` (and friends) beside exported weights.

Policy, the same for every path (offline export, torchrun export, save-time hooks):

1. **Where the files come from.** From a live model (save-time hooks) its ``config`` is written
   with ``config.save_pretrained`` — ``architectures`` set to the model's class name when it is a
   transformers ``PreTrainedModel`` — and its ``generation_config`` when the model
   ``can_generate()``, exactly as ``save_pretrained`` does. Without a model (offline), the
   :data:`~.names.CONFIG_FILES` that the config directory holds are copied (config, generation
   config, tokenizer files), regular files inside that directory only: a ``tokenizer.json``
   linked to a private key must not end up in an export users upload; each skipped file is
   reported.
2. **The dtype it records.** ``config.json`` then records the floating dtype of the tensors
   written (:func:`record_dtype`): the one dtype they share or, when they are mixed, the first
   floating tensor's (``save_pretrained`` records the model's first floating parameter dtype). The
   key is ``dtype`` on transformers 5 and ``torch_dtype`` before; a key the config already holds is
   kept. Nothing else in the file is changed.
"""

import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Iterable, List, Optional

from ..errors import OptionError, option
from ..guards import StrPath
from ..outfiles import replace_file
from . import dtypes as _dtypes
from .names import CONFIG_FILES, CONFIG_NAME

if TYPE_CHECKING:
    import torch

__all__ = ["config_dir_of", "write_config", "copy_config_files", "save_model_config", "record_dtype", "config_dtype_key",
           "transformers_major"]


def config_dir_of(config: Optional[StrPath]) -> Optional[str]:
    """``config`` (``--config``/``config=``: the model's ``config.json``, or the directory holding it)
    as the directory the sources read; None stays None. A file by another name is refused
    (:class:`~..errors.OptionError`): the tokenizer and generation files are looked for beside it."""
    if config is None:
        return None
    config = os.fspath(config)
    if os.path.isfile(config):
        if os.path.basename(config) != CONFIG_NAME:
            raise OptionError(f"{config}: {option('config', 'PATH')} takes a file named config.json or the "
                              "directory holding the model's config.json (its tokenizer files are read beside it)")
        return os.path.dirname(config) or "."
    return config


def transformers_major() -> Optional[int]:
    """The installed transformers' major version, from the package metadata (importing transformers
    imports torch: a few seconds and hundreds of MB for a question about a version); None without it."""
    import importlib.metadata as md

    try:
        return int(md.version("transformers").split(".")[0])
    except (md.PackageNotFoundError, ValueError):
        return None


def write_config(directory: StrPath, *, config_dir: Optional[str] = None, model: "Optional[torch.nn.Module]" = None,
                 tensor_dtypes: Iterable[str] = (),
                 skipped: Optional[List[str]] = None) -> List[str]:
    """Write the config files beside weights in ``directory`` (see the module doc for the policy):
    from ``model`` when given, else copied from ``config_dir``; then ``config.json`` records the
    floating dtype of ``tensor_dtypes`` (safetensors names, in write order). Returns the names
    written. Files skipped go to ``skipped`` (a warning when None)."""
    if model is not None:
        written = save_model_config(model, directory)
    else:
        written = copy_config_files(config_dir, directory, skipped)
    record_dtype(directory, tensor_dtypes)
    return written


def copy_config_files(config_dir: Optional[str], directory: StrPath, skipped: Optional[List[str]] = None) -> List[str]:
    """Copy the :data:`~.names.CONFIG_FILES` that ``config_dir`` holds into ``directory``; return their
    names. Only regular files inside ``config_dir`` are copied (a link inside it is followed); each
    file skipped is reported by a message appended to ``skipped`` (a warning when None)."""
    from ..guards import copyable_problem, open_regular

    copied: List[str] = []
    if not config_dir:
        return copied
    for name in CONFIG_FILES:
        p = os.path.join(config_dir, name)
        if not os.path.lexists(p):
            continue
        problem = copyable_problem(p, config_dir)
        if problem is not None:
            if skipped is None:
                warnings.warn(problem, stacklevel=3)
            else:
                skipped.append(problem)
            continue
        real, out = os.path.realpath(p), os.path.join(directory, name)
        if real != os.path.realpath(out):  # a save-time hook writes into the config dir itself
            with open_regular(real, root=config_dir, what=name) as fh:
                replace_file(out, source=fh)  # a link at ``out`` is replaced, not written through
            copied.append(name)
    return copied


def save_model_config(model: "torch.nn.Module", directory: StrPath) -> List[str]:
    """``model.config`` (and its generation config when the model can generate) written into
    ``directory`` as ``save_pretrained`` writes them; nothing for a model without a config."""
    import copy

    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return []
    config = copy.deepcopy(config)
    if _is_pretrained_model(model):
        config.architectures = [model_class_name(model)]  # as save_pretrained records it
    config.save_pretrained(directory)
    written = [CONFIG_NAME]
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if gen is not None and hasattr(gen, "save_pretrained") and callable(can_generate) and can_generate():
        gen.save_pretrained(directory)
        written.append("generation_config.json")
    return written


def model_class_name(model: object) -> str:
    """The model's own class name: FSDP2's ``fully_shard`` swaps in a subclass made in torch
    (``FSDPLlamaForCausalLM``); ``save_pretrained`` of the model records the class it wraps."""
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("torch."):
            return cls.__name__
    return type(model).__name__


def _is_pretrained_model(model: object) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def config_dtype_key(cfg: dict[str, Any]) -> str:
    """The key ``config.json`` records the dtype under: the one it already holds, else ``dtype`` on
    transformers 5 and ``torch_dtype`` before."""
    for k in ("dtype", "torch_dtype"):
        if k in cfg:
            return k
    return "dtype" if (transformers_major() or 0) >= 5 else "torch_dtype"


def record_dtype(directory: StrPath, tensor_dtypes: Iterable[str]) -> Optional[str]:
    """Record in ``directory/config.json`` the floating dtype of tensors of ``tensor_dtypes``
    (safetensors names, in order): the one they share, else the first. Returns the value written
    (``"bfloat16"``), None when there is no config.json or no floating tensor."""
    path = os.path.join(directory, CONFIG_NAME)
    floats = [d for d in tensor_dtypes if _dtypes.config_name(d)]
    if not floats or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        cfg = json.load(fh)
    key = config_dtype_key(cfg)
    value = _dtypes.config_name(floats[0])
    if cfg.get(key) == value:
        return value
    cfg[key] = value
    replace_file(path, (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return value
