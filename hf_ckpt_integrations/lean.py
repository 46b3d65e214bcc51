"""Lean state dicts (seed ``002``); the storage-bloat audit lives in :mod:`.sources.audit`.

``torch.save`` writes each tensor's whole *storage*. Under ZeRO-1/2 every parameter is a view
into one flat buffer per parameter group, so saving a shard of a few parameters writes the
whole buffer — a sharded save is N times too large. DeepSpeed's cure
(``clone_tensors_for_torch_save``) clones every tensor, doubling memory even for tensors that
already own their bytes. :func:`lean_state_dict` copies only what needs it; :func:`audit`
measures the problem in files already written.
"""

from typing import TYPE_CHECKING, Any, Dict, Mapping

from .sources.audit import audit  # re-exported: measures the bloat this module cures

if TYPE_CHECKING:
    import torch

__all__ = ["lean_state_dict", "is_lean", "audit"]


def is_lean(t: "torch.Tensor") -> bool:
    """True when ``t`` is contiguous and its storage holds exactly its own bytes."""
    nbytes = t.numel() * t.element_size()
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes


def lean_state_dict(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """A state dict in which every tensor's storage is exactly its bytes.

    - Tensors that are already lean are returned as they are (no copy).
    - A view (of a flat buffer, or a slice) is copied once into its own storage.
    - Tensors shared on purpose (tied weights: the same tensor, or the same view of the same
      storage under several names) stay shared: one copy, referenced by every name.
    - Non-tensor values are passed through.

    The result works with ``torch.save``, ``save_pretrained(state_dict=...)`` and
    ``safetensors.torch.save_file`` (which refuses shared tensors: drop the tied names first, as
    ``save_pretrained`` does). The input and the model are not modified. Extra memory is the
    size of the tensors that had to be copied.
    """
    import torch

    out = type(state_dict)() if isinstance(state_dict, dict) else {}
    copies: Dict[tuple, "torch.Tensor"] = {}
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor) or t.device.type == "meta" or is_lean(t):
            out[name] = t
            continue
        key = (t.untyped_storage().data_ptr(), t.device, t.dtype, t.storage_offset(), tuple(t.shape),
               tuple(t.stride()))
        if key not in copies:
            copies[key] = t.detach().clone(memory_format=torch.contiguous_format)
        out[name] = copies[key]
    return out
