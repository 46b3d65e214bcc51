"""DeepSpeed's own value types in its rank files, rebuilt as inert stand-ins: the allowlist its
pickles are read with (on top of torch's, :data:`~...formats.torch_files.TORCH_ALLOWED`).

A DeepSpeed optimizer file pickles its loss scaler (``LossScaler``/``DynamicLossScaler``), the ZeRO
stage as ``ZeroStageEnum``, and, from 0.10, ``param_slice_mappings`` of ``fragment_address``.
The client state a training loop saves beside them (GPT-NeoX's RNG states, Megatron-DeepSpeed's
``argparse.Namespace`` of args) is torch's list's: :data:`~...formats.unpickler.CLIENT_STATE`.
Nothing else is accepted.
"""

from typing import Any

from ...errors import CheckpointError, UnsafeCheckpointError, short_repr
from ...formats import torch_files
from ...formats.unpickler import Opaque, StandIn

__all__ = ["ALLOWED", "FragmentAddress", "load"]


class FragmentAddress(StandIn):
    """Stand-in for the dataclass ``deepspeed.utils.tensor_fragment.fragment_address``
    (pickled as an empty object, then its ``__dict__``)."""

    def __init__(self, numel: Any = None, start: Any = None):
        self.numel, self.start = numel, start

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise UnsafeCheckpointError("fragment_address with unexpected state")
        self.numel, self.start = state.get("numel"), state.get("start")

    def __repr__(self) -> str:
        return f"fragment_address(numel={self.numel}, start={self.start})"


def _zero_stage(value: Any) -> int:
    if type(value) is not int:
        raise CheckpointError(f"ZeroStageEnum of {short_repr(value)}, not an integer")
    return value


# module -> name -> stand-in: torch's list plus DeepSpeed's value types.
ALLOWED = {
    **torch_files.TORCH_ALLOWED,
    "deepspeed.runtime.fp16.loss_scaler": {"LossScaler": Opaque, "DynamicLossScaler": Opaque},
    "deepspeed.runtime.zero.config": {"ZeroStageEnum": _zero_stage},
    "deepspeed.utils.tensor_fragment": {"fragment_address": FragmentAddress},
}


def load(path: str) -> Any:
    """The object tree of a DeepSpeed rank file (or a universal checkpoint's), tensors as
    :class:`~...formats.torch_files.TensorRef` (see :func:`~...formats.torch_files.load`)."""
    return torch_files.load(path, allowed=ALLOWED)
