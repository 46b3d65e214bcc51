"""Lean state dicts and a storage-bloat audit (seed ``002``).

``torch.save`` writes each tensor's whole *storage*. Under ZeRO-1/2 every parameter is a view
into one flat buffer per parameter group, so saving a shard of a few parameters writes the
whole buffer — a sharded save is N times too large. DeepSpeed's cure
(``clone_tensors_for_torch_save``) clones every tensor, doubling memory even for tensors that
already own their bytes. :func:`lean_state_dict` copies only what needs it; :func:`audit`
measures the problem in files already written.
"""

import os
import re
import zipfile
from typing import Dict, List

__all__ = ["lean_state_dict", "is_lean", "audit"]


def is_lean(t) -> bool:
    """True when ``t`` is contiguous and its storage holds exactly its own bytes."""
    nbytes = t.numel() * t.element_size()
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes


def lean_state_dict(state_dict):
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


def _audit_safetensors(path) -> dict:
    from .verify import _read_header  # one safetensors header parser (checks sizes before reading)

    spans = _read_header(path)
    tensor_bytes = sum(nbytes for _, _, _, nbytes in spans.values())
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
    data = os.path.getsize(path) - 8 - size
    return {"format": "safetensors", "tensors": len(spans), "tensor_bytes": tensor_bytes, "storage_bytes": data}


def _audit_torch_zip(path) -> dict:
    from . import safe_load

    obj = safe_load.load(path)
    refs: List[safe_load.TensorRef] = []

    def walk(o):
        if isinstance(o, safe_load.TensorRef):
            refs.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    # Unique views (tied names count once); storages as stored in the zip.
    views = {(r.storage.key, r.storage_offset, r.shape, r.stride): r.nbytes for r in refs}
    storages = {r.storage.key: r.storage.numel * safe_load.DTYPE_SIZES[r.dtype] for r in refs}
    return {"format": "torch", "tensors": len(refs), "tensor_bytes": sum(views.values()),
            "storage_bytes": sum(storages.values())}


_WEIGHT_FILE = re.compile(r"^(?:pytorch_model.*\.bin|model.*\.safetensors)$")


def audit(path, files=None) -> dict:
    """Storage bytes vs tensor bytes, per weight file of an HF directory (or one ``.bin``/
    ``.safetensors`` file). Reads headers and pickles only (no torch, nothing executed).

    In a directory only the weight files are read: ``files`` (names, e.g. those its index names),
    or by default ``pytorch_model*.bin`` and ``model*.safetensors`` — never the Trainer's own
    ``optimizer.pt``, ``rng_state.pth`` or ``training_args.bin`` beside them.

    Returns ``{"files": {name: {format, tensors, tensor_bytes, storage_bytes, ratio}},
    "tensor_bytes": n, "storage_bytes": n, "ratio": storage/tensor}``; a ratio above 1 is bloat.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        names = sorted(files) if files is not None else sorted(n for n in os.listdir(path) if _WEIGHT_FILE.match(n))
        files = [os.path.join(path, n) for n in names]
    else:
        files = [path]
    report = {}
    for f in files:
        if f.endswith(".safetensors"):
            r = _audit_safetensors(f)
        elif zipfile.is_zipfile(f):
            r = _audit_torch_zip(f)
        else:
            continue  # legacy (non-zip) torch files: not audited
        r["ratio"] = round(r["storage_bytes"] / r["tensor_bytes"], 4) if r["tensor_bytes"] else 1.0
        report[os.path.basename(f)] = r
    tensor = sum(r["tensor_bytes"] for r in report.values())
    storage = sum(r["storage_bytes"] for r in report.values())
    return {"files": report, "tensor_bytes": tensor, "storage_bytes": storage,
            "ratio": round(storage / tensor, 4) if tensor else 1.0}
