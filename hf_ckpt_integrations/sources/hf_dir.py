"""An HF-format directory (safetensors or ``.bin``, sharded or not) -> :class:`~..plan.ExportPlan`.

What ColossalAI's own ``booster.save_model`` writes (``pytorch_model-00001.bin`` + index), what
``save_pretrained`` writes, and what this package exports. ``inspect`` reports the storage-bloat
audit of every weight file (``.bin`` files whose tensors are views of larger storages hold those
whole storages, N times the weights); ``export`` rewrites the tensors as lean safetensors; ``verify`` compares against it.
"""

import os
from typing import Dict, List, Optional

from ..errors import CheckpointError, LayoutError
from ..formats.dtypes import SIZES
from ..formats.names import has_weights, weight_names
from ..formats.safetensors import read_hf_dir
from ..formats.torch_files import TensorRef, load as load_torch_file
from ..plan import ExportPlan, Piece, TensorPlan
from .audit import audit
from .protocol import PlanContext

__all__ = ["NAME", "LOOKS_FOR", "MEMORY_NAMES", "OPTIONS", "YIELDS_TO", "detect", "config_candidates", "plan",
           "is_hf_dir"]

NAME = "hf-directory"
LOOKS_FOR = "an HF directory (model.safetensors[.index.json] or pytorch_model.bin[.index.json])"
MEMORY_NAMES = False  # already what save_pretrained wrote: no Hub-layout pass, tied names as stored
OPTIONS = ()
# A Trainer checkpoint-N can hold both HF weights and a DeepSpeed checkpoint: its fp32 masters come first.
YIELDS_TO = ("deepspeed",)


def is_hf_dir(path: str) -> bool:
    return has_weights(path)


def detect(path: str, tag: Optional[str] = None) -> bool:
    """HF weights in ``path`` and no tag asked for (the registry lets a DeepSpeed checkpoint in the
    same directory come first: :data:`YIELDS_TO`)."""
    return tag is None and has_weights(path)


def config_candidates(path: str, tag: Optional[str] = None) -> List[str]:
    return [os.path.abspath(path)]


def plan(ctx: PlanContext) -> ExportPlan:
    """Plan the export of the HF directory ``ctx.path`` (the tag and dtype do not apply)."""
    path = os.path.abspath(ctx.path)
    tensors: Dict[str, TensorPlan] = {}
    found = weight_names(path)  # checks the index before anything reads through it
    weight_files = found[2] if found else []
    if found and found[0] == "safetensors":
        # read_hf_dir validates every header: a dtype not in formats.dtypes (F8...) is refused there.
        for name, (f, dtype, shape, offset, nbytes) in read_hf_dir(path).items():
            tensors[name] = TensorPlan(name, shape, dtype, [[Piece(f, offset, nbytes // SIZES[dtype], dtype)]],
                                       kind="module")
    else:
        for fname in weight_files:
            f = os.path.join(path, fname)
            state = load_torch_file(f)
            if not isinstance(state, dict):
                raise LayoutError(f"{f}: holds a {type(state).__name__}, not a state dict; save it with "
                                  "model.state_dict()")
            for name, ref in state.items():
                if not isinstance(ref, TensorRef):
                    continue
                offset, _ = ref.byte_range()
                tensors[str(name)] = TensorPlan(str(name), ref.shape, ref.dtype,
                                                [[Piece(f, offset, ref.numel, ref.dtype)]], kind="module")
    if not tensors:
        raise CheckpointError(f"{path}: no tensors in its weight files; save the model again")
    report = audit(path, files=weight_files)  # the weights only: never optimizer.pt & co. (Trainer)
    notes = [f"{name}: {r['storage_bytes']:,} storage bytes for {r['tensor_bytes']:,} tensor bytes "
             f"(x{r['ratio']})" + (" — bloated: views of larger storages; export writes only "
                                   "each tensor's own bytes" if r["ratio"] > 1.01 else "")
             for name, r in report["files"].items()]
    dtypes = {t.src_dtype for t in tensors.values()}
    files = sorted({p.path for t in tensors.values() for part in t.parts for p in part})
    return ExportPlan(engine="hf-directory", source=path, tag=None, tensors=list(tensors.values()),
                      dtypes={"module": dtypes.pop()} if len(dtypes) == 1 else {},
                      config_dir=ctx.config_dir, files=files, notes=notes)
