"""The fields DeepSpeed records in its rank files, read with their types checked.

A file from elsewhere, or a corrupt one, is refused by name (the file and the field) rather
than failing deep inside the planning; pieces are byte ranges of the tensors the fields hold.
"""

import math
from typing import Any, Callable, Dict, Protocol, Sequence, Tuple

from ...errors import CheckpointError, LayoutError, short_repr
from ...formats.dtypes import MAX_NDIM
from ...formats.torch_files import TensorRef
from ...plan import Piece

__all__ = ["OptimFile", "require", "check_model_types", "check_optim_types", "meta_int", "recorded_shape", "numel",
           "tensor_pieces", "fragment_address"]


class OptimFile(Protocol):
    """What the ZeRO-1/2 and BF16_Optimizer planners read of one optimizer partition file: its
    ``path`` and its ``optimizer_state_dict`` (``osd``). :class:`~.rank_files.RankFile` is one; a pipeline
    save's reader has its own."""

    path: str

    @property
    def osd(self) -> Dict[str, Any]: ...


def require(obj: Any, key: str, path: str, what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise CheckpointError(f"{path}: not a DeepSpeed {what} file (no {key!r}); "
                              "pass the directory of an engine.save_checkpoint() call")
    return obj[key]



def _typed(value: Any, ok: Callable[[Any], bool], path: str, key: str) -> None:
    if not ok(value):
        raise LayoutError(f"{path}: recorded {key} has an unexpected type ({type(value).__name__}: "
                          f"{short_repr(value)}); the file is corrupt or not written by DeepSpeed: "
                          "copy it again from the training run")


def _str_dict(v: Any) -> bool:
    return isinstance(v, dict) and all(type(k) is str for k in v)


def check_model_types(model: dict, path: str) -> None:
    """The model-states fields this source reads have the types DeepSpeed writes (a file from
    elsewhere, or a corrupt one, is refused by name rather than failing deep inside)."""
    _typed(model.get("param_shapes") or [], lambda v: isinstance(v, list) and all(_str_dict(g) for g in v), path,
           "param_shapes")
    for key in ("module", "frozen_param_shapes", "frozen_param_fragments"):
        _typed(model.get(key) or {}, _str_dict, path, key)
    _typed(model.get("shared_params") or {}, lambda v: _str_dict(v) and all(type(x) is str for x in v.values()),
           path, "shared_params")
    _typed(model.get("buffer_names") or [], lambda v: isinstance(v, (list, tuple)) and
           all(type(x) is str for x in v), path, "buffer_names")


def check_optim_types(osd: dict, path: str) -> None:
    """The same for the optimizer-state fields this source reads."""
    for key in ("single_partition_of_fp32_groups", "fp32_flat_groups", "group_paddings", "param_slice_mappings"):
        if key in osd:
            _typed(osd[key], lambda v: isinstance(v, list), path, key)
    if "group_paddings" in osd:
        _typed(osd["group_paddings"], lambda v: all(type(x) is int for x in v), path, "group_paddings")
    if isinstance(osd.get("param_slice_mappings"), list):
        _typed(osd["param_slice_mappings"], lambda v: all(_str_dict(m) for m in v), path, "param_slice_mappings")


def meta_int(value: Any, path: str, key: str) -> int:
    """A recorded integer (``zero_stage``, ``partition_count``...), or LayoutError naming the file."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise LayoutError(f"{path}: recorded {key} is {short_repr(value)}, not an integer; the file is "
                      "corrupt or not written by DeepSpeed: copy it again from the training run")


def recorded_shape(value: Any, path: str, name: str) -> Tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) > MAX_NDIM or \
            not all(type(s) is int for s in value):
        raise LayoutError(f"{path}: recorded shape of {short_repr(name)} is not a shape "
                          f"({short_repr(value)}); the file is corrupt")
    shape = tuple(value)
    if any(s < 0 for s in shape):
        raise LayoutError(f"{path}: recorded shape of {name} is negative ({shape}); the file is corrupt")
    return shape


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def tensor_pieces(ref: TensorRef, start: int, count: int) -> Piece:
    if not isinstance(ref, TensorRef):
        raise LayoutError(f"expected a tensor, found {type(ref).__name__}; the file is corrupt")
    if start < 0 or count < 0 or start + count > ref.numel:
        raise LayoutError(f"{ref.path}: a recorded offset points past the end of a partition "
                          f"({start}+{count} > {ref.numel}); the file does not match the recorded shapes")
    offset, _ = ref.byte_range(start, count)
    return Piece(ref.path, offset, count, ref.dtype)


def fragment_address(value: Any, path: str) -> Tuple[int, int]:
    """A ``param_slice_mappings`` entry (``fragment_address``) as ``(numel, start)``, or LayoutError."""
    try:
        return int(value.numel), int(value.start)
    except (AttributeError, TypeError, ValueError):
        raise LayoutError(f"{path}: a param_slice_mappings entry is not a fragment address; the file is corrupt")
