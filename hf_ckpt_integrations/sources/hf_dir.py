"""An HF-format directory (safetensors or ``.bin``, sharded or not) -> :class:`~..plan.ExportPlan`.

What ColossalAI's own ``booster.save_model`` writes (``pytorch_model-00001.bin`` + index), what
``save_pretrained`` writes, and what this package exports. ``inspect`` reports the storage-bloat
audit of every weight file (seed 002: ``.bin`` files whose tensors are views of larger
storages); ``export`` rewrites the tensors as lean safetensors; ``verify`` compares against it.
"""

import json
import os
from typing import Dict, List, Optional

from .. import lean, safe_load
from ..errors import CheckpointError, LayoutError, one_line
from ..plan import ExportPlan, Piece, TensorPlan
from ..verify import read_hf_dir

__all__ = ["is_hf_dir", "build_plan"]

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")


def is_hf_dir(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, n)) for n in _INDEXES + _SINGLES)


def _index_files(index: str) -> List[str]:
    """The weight files an HF index names: ``{"weight_map": {tensor: file}}``, each file a plain
    name in the same directory (never a path that leads out of it)."""
    try:
        with open(index, encoding="utf-8") as fh:
            weight_map = json.load(fh)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: unreadable index ({one_line(str(e))[:200]}); save the model again") from e
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: 'weight_map' is not a mapping of tensor names to file names; save the "
                              "model again")
    files = sorted(set(weight_map.values()))
    bad = [f for f in files if not f or f in (".", "..") or "/" in f or "\\" in f or "\0" in f]
    if bad:
        raise CheckpointError(f"{index}: names weight file {one_line(bad[0][:64])!r}, which is not a file name "
                              "in this directory; save the model again")
    return files


def _weight_files(path: str) -> List[str]:
    """The weight files of the HF directory ``path`` (names): those its index names, or the single file."""
    for index, single in zip(_INDEXES, _SINGLES):
        if os.path.isfile(os.path.join(path, index)):
            return _index_files(os.path.join(path, index))
        if os.path.isfile(os.path.join(path, single)):
            return [single]
    return []


def build_plan(path: str, *, config_dir: Optional[str] = None) -> ExportPlan:
    path = os.path.abspath(path)
    tensors: Dict[str, TensorPlan] = {}
    weight_files = _weight_files(path)  # checks the index before anything reads through it
    if any(os.path.isfile(os.path.join(path, n)) for n in ("model.safetensors", "model.safetensors.index.json")):
        for name, (f, dtype, shape, offset, nbytes) in read_hf_dir(path).items():
            if dtype not in safe_load.DTYPE_SIZES:
                raise CheckpointError(f"{f}: tensor {one_line(name[:100])} has dtype {one_line(str(dtype)[:20])}, "
                                      f"which hf-ckpt does not export yet (it reads "
                                      f"{', '.join(safe_load.DTYPE_SIZES)}); load this directory with "
                                      "from_pretrained instead")
            tensors[name] = TensorPlan(name, shape, dtype, [[Piece(f, offset, nbytes // safe_load.DTYPE_SIZES[dtype],
                                                                   dtype)]], kind="module")
    else:
        for fname in weight_files:
            f = os.path.join(path, fname)
            state = safe_load.load(f)
            if not isinstance(state, dict):
                raise LayoutError(f"{f}: holds a {type(state).__name__}, not a state dict; save it with "
                                  "model.state_dict()")
            for name, ref in state.items():
                if not isinstance(ref, safe_load.TensorRef):
                    continue
                offset, _ = ref.byte_range()
                tensors[str(name)] = TensorPlan(str(name), ref.shape, ref.dtype,
                                                [[Piece(f, offset, ref.numel, ref.dtype)]], kind="module")
    if not tensors:
        raise CheckpointError(f"{path}: no tensors in its weight files; save the model again")
    report = lean.audit(path, files=weight_files)  # the weights only: never optimizer.pt & co. (Trainer)
    notes = [f"{name}: {r['storage_bytes']:,} storage bytes for {r['tensor_bytes']:,} tensor bytes "
             f"(x{r['ratio']})" + (" — bloated: views of larger storages (seed 002); export writes only "
                                   "each tensor's own bytes" if r["ratio"] > 1.01 else "")
             for name, r in report["files"].items()]
    dtypes = {t.src_dtype for t in tensors.values()}
    files = sorted({p.path for t in tensors.values() for part in t.parts for p in part})
    return ExportPlan(engine="hf-directory", source=path, tag=None, stage=None, dp_size=1, mp_size=1,
                      mp_axis="none", tensors=list(tensors.values()),
                      dtypes={"module": dtypes.pop()} if len(dtypes) == 1 else {},
                      config_dir=config_dir, files=files, notes=notes)
