"""The storage-bloat audit of weight files (seed ``002``): storage bytes against tensor bytes.

``torch.save`` writes each tensor's whole storage, so a shard of views into a flat buffer is N
times too large. :func:`audit` measures it in files already written, reading headers and pickles
only (:mod:`..formats.torch_files`; no torch, nothing executed). The HF-directory source reports it in its
plan's notes; :mod:`..lean` cures it at save time.
"""

import os
import zipfile
from typing import Any, Dict, Iterable, List, Optional, Union

from ..formats.dtypes import SIZES
from ..formats.names import WEIGHT_FILES_RE
from ..formats.safetensors import read_header
from ..formats.torch_files import TensorRef, load as load_torch_file

__all__ = ["audit"]


def _audit_safetensors(path: str) -> Dict[str, Any]:
    header = read_header(path)  # validated: sizes are checked before anything is read
    tensor_bytes = sum(e.nbytes for e in header.tensors.values())
    return {"format": "safetensors", "tensors": len(header.tensors), "tensor_bytes": tensor_bytes,
            "storage_bytes": header.file_size - header.data_start}


def _audit_torch_zip(path: str) -> Dict[str, Any]:
    obj = load_torch_file(path)
    refs: List[TensorRef] = []

    def walk(o: Any) -> None:
        if isinstance(o, TensorRef):
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
    storages = {r.storage.key: r.storage.numel * SIZES[r.dtype] for r in refs}
    return {"format": "torch", "tensors": len(refs), "tensor_bytes": sum(views.values()),
            "storage_bytes": sum(storages.values())}


def audit(path: Union[str, "os.PathLike[str]"], files: Optional[Iterable[str]] = None) -> Dict[str, Any]:
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
        names = sorted(files) if files is not None else sorted(n for n in os.listdir(path) if WEIGHT_FILES_RE.match(n))
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
