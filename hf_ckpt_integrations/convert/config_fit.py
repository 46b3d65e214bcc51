"""config.json against the checkpoint: the model it describes must hold exactly the checkpoint's tensors.

``from_pretrained`` builds the model config.json describes and loads the weights into it: a tensor
the model lacks is dropped, one the checkpoint lacks is initialised at random, a different shape
fails the load. An export whose config.json does not fit its weights is therefore silently wrong
(a 1-layer config over a 2-layer checkpoint loads a 1-layer model) or unloadable. The Hub-layout
pass (:mod:`.hub_layout`) already builds that model on the meta device; this module

- bounds that build before and while it runs (:func:`bounded_build`): a 700-byte config.json with
  ``num_hidden_layers: 100000`` would otherwise spin for minutes building meta layers;
- compares the built model's state dict, as ``save_pretrained`` writes it, with the checkpoint's
  tensors (:func:`check_fits`), and names the first difference.

Both raise :class:`~..errors.CheckpointError` (exit 2) naming config.json.
"""

import contextlib
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from ..errors import CheckpointError, LayoutError, one_line

if TYPE_CHECKING:
    import torch

__all__ = ["bounded_build", "check_fits", "count_fields"]

# Config fields that multiply the modules a model builds (one module per layer, per unfused expert).
_COUNT_FIELDS = frozenset({"num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers",
                           "num_encoder_layers", "encoder_layers", "decoder_layers", "num_local_experts",
                           "num_experts", "n_routed_experts", "n_experts", "moe_num_experts"})
# Parameter and module registrations one checkpoint tensor may stand for while the model is built
# (tied weights are registered under both names, containers and norms add modules), plus a floor
# for tiny checkpoints.
_PARAMS_PER_TENSOR, _MODULES_PER_TENSOR, _FLOOR = 4, 16, 256
_LAYER_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def count_fields(cfg: Any, prefix: str = "", depth: int = 0) -> Iterator[Tuple[str, int]]:
    """``(dotted key, int value)`` for every count-like field of ``cfg`` and of its nested configs
    (``text_config.num_hidden_layers``)."""
    if depth > 4 or not isinstance(cfg, dict):
        return
    for key, value in cfg.items():
        if isinstance(value, dict):
            yield from count_fields(value, f"{prefix}{key}.", depth + 1)
        elif isinstance(value, int) and not isinstance(value, bool) and key in _COUNT_FIELDS:
            yield f"{prefix}{key}", value


def _checkpoint_extent(shapes: Dict[str, Tuple[int, ...]]) -> int:
    """The most layers or experts the checkpoint can hold: its tensor count, one more than the largest
    index in its names, or the leading dim of a fused (3-D or more) tensor, whichever is largest."""
    extent = len(shapes)
    for name, shape in shapes.items():
        for m in _LAYER_INDEX.finditer(name):
            extent = max(extent, int(m.group(1)) + 1)
        if len(shape) >= 3:
            extent = max(extent, int(shape[0]))
    return extent


class _Budget:
    """Counts parameter and module registrations (torch's global registration hooks) and raises
    once the model being built outgrows ``limit``; the hook keeps raising, so a caller that
    swallows the first error cannot go on building."""

    def __init__(self, params: int, modules: int):
        self.params, self.modules = params, modules
        self.seen_params = self.seen_modules = 0
        self.tripped = False

    # torch's registration hooks: (module, name, the parameter or submodule registered)
    def param(self, module: Any, name: str, value: Any) -> None:
        self.seen_params += 1
        self._check()

    def module(self, module: Any, name: str, value: Any) -> None:
        self.seen_modules += 1
        self._check()

    def _check(self) -> None:
        if self.seen_params > self.params or self.seen_modules > self.modules:
            self.tripped = True
            raise _Outgrown()


class _Outgrown(Exception):
    pass


@contextlib.contextmanager
def bounded_build(config_dir: Union[str, "os.PathLike[str]"], shapes: Dict[str, Tuple[int, ...]],
                  cfg: Optional[dict] = None) -> Iterator[None]:
    """Around building the model of ``config_dir/config.json`` for a checkpoint with tensors ``shapes``:
    first refuse a count field (``num_hidden_layers``, ``num_experts`` …) larger than the checkpoint
    can hold (:func:`_checkpoint_extent`); then abort the build as soon as it registers more parameters
    or modules than the checkpoint's tensors can account for. CheckpointError naming config.json and
    the field in both cases (raised on exit even if the builder swallowed the abort)."""
    import torch.nn.modules.module as torch_module

    from ..guards import read_config

    path = os.path.join(os.fspath(config_dir), "config.json")
    cfg = read_config(config_dir) if cfg is None else cfg
    extent = _checkpoint_extent(shapes)
    for key, value in count_fields(cfg):
        if value > extent:
            raise CheckpointError(f"{path}: {key}={value} is more than the checkpoint holds (largest layer or expert "
                                  f"count it can have: {extent}); pass --config the config.json of the model that "
                                  "was trained")
    budget = _Budget(_PARAMS_PER_TENSOR * len(shapes) + _FLOOR, _MODULES_PER_TENSOR * len(shapes) + _FLOOR)
    handles = [torch_module.register_module_parameter_registration_hook(budget.param),
               torch_module.register_module_module_registration_hook(budget.module)]
    try:
        yield
    except BaseException:  # the builder may have swallowed the abort and raised something else
        if not budget.tripped:
            raise
    finally:
        for h in handles:
            h.remove()
    if budget.tripped:
        largest = sorted(count_fields(cfg), key=lambda kv: -kv[1])[:3]
        named = ", ".join(f"{k}={v}" for k, v in largest) or "its sizes"
        raise CheckpointError(f"{path}: describes a model with more than {budget.params:,} parameters or "
                              f"{budget.modules:,} modules, while the checkpoint holds {len(shapes):,} tensors "
                              f"(check {named}); pass --config the config.json of the model that was trained")


def _shape(s: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def check_fits(model: "torch.nn.Module", shapes: Dict[str, Tuple[int, ...]],
               config_dir: Union[str, "os.PathLike[str]"]) -> List[str]:
    """Refuse (LayoutError) when ``model`` (built from ``config_dir/config.json``) does not load exactly
    the checkpoint's tensors ``shapes`` (in-memory names, tied aliases already removed and renamed as
    ``save_pretrained`` keeps them): a tensor the model does not have, a model tensor the checkpoint
    lacks, or a different shape. Not counted, as ``save_pretrained``/``from_pretrained`` do not count
    them: tied names save_pretrained leaves out, ``_keys_to_ignore_on_save``, buffers (persistent ones
    are optional: the model initialises them), and the patterns of ``_keys_to_ignore_on_load_missing``
    / ``_keys_to_ignore_on_load_unexpected`` (plus the old ``rotary_emb.inv_freq`` / ``position_ids``
    buffers transformers itself ignores). When the only difference is model tensors the checkpoint
    lacks, each in a layer the checkpoint holds (a save with ``exclude_frozen_parameters=True``), their
    names are returned instead (the export front end refuses them unless told: ``--allow-missing``);
    otherwise []."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4.x: no such helper; the Hub-layout pass does not run there either
        return []
    path = os.path.join(os.fspath(config_dir), "config.json")
    state = dict(model.state_dict())
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    buffers = {n for n, _ in model.named_buffers()}
    optional = set(getattr(model, "_keys_to_ignore_on_save", None) or ()) | buffers
    missing_ok = _any_of(getattr(model, "_keys_to_ignore_on_load_missing", None))
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    unexpected |= {r"rotary_emb\.inv_freq", r"(^|\.)position_ids$"}
    unexpected_ok = _any_of(unexpected)
    problems = []
    for name, t in kept.items():
        if name in shapes:
            if tuple(shapes[name]) != tuple(t.shape):
                problems.append(f"{name} is {_shape(shapes[name])} in the checkpoint but {_shape(t.shape)} in the "
                                "model")
        elif name not in optional and not missing_ok(name):
            problems.append(f"the model has {name} {_shape(t.shape)}, which the checkpoint lacks")
    for name, s in shapes.items():
        if name not in kept and name not in optional and not unexpected_ok(name):
            why = "ties it to another weight" if name in state else "has no such tensor"
            problems.append(f"the checkpoint holds {name} {_shape(s)}, but the model {why}")
    missing = [name for name in kept if name not in shapes and name not in optional and not missing_ok(name)]
    if len(missing) == len(problems) and all(_layer_held(name, shapes) for name in missing):
        return missing
    if problems:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise LayoutError(f"{path}: its {model_type!r} model does not have exactly the checkpoint's tensors: "
                          f"{one_line(problems[0])}" + (f" ({len(problems)} differences)" if len(problems) > 1 else "")
                          + "; pass --config the config.json of the model that was trained")
    return []  # not reached: without problems nothing is missing, and that was returned above


def _layer_held(name: str, shapes: Iterable[str]) -> bool:
    """Whether the checkpoint holds some tensor of every numbered layer/expert in ``name``: a missing
    tensor of a layer the checkpoint holds is a left-out parameter; a whole missing layer is a config
    of another (larger) model."""
    for m in _LAYER_INDEX.finditer(name):
        prefix = name[:m.end()] + "."
        if not any(s.startswith(prefix) for s in shapes):
            return False
    return True


def _any_of(patterns: Optional[Iterable[Any]]) -> Callable[[str], bool]:
    patterns = [p for p in (patterns or ()) if isinstance(p, str)]
    if not patterns:
        return lambda name: False
    compiled = re.compile("|".join(f"({p})" for p in patterns))
    return lambda name: compiled.search(name) is not None
