"""Small torch DCP checkpoints built in-process (no process group, milliseconds): a tiny Llama's
config and weights, laid out as FileSystemWriter lays a sharded save's chunks (any N-D tiling),
for the tests of what ``export`` refuses and what ``verify`` proves on DCP sources."""

import io
import json
import pickle
from pathlib import Path

import torch

TINY_LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16,
                  intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, torch_dtype="float32")


def tiny_llama(config_dir, *, tied=True, seed=0):
    """Write a tiny Llama's config.json into ``config_dir``; return ``{name: tensor}`` as the model
    holds it in memory (the tied ``lm_head.weight`` under its own name, equal to the embedding, as
    FSDP state dicts hold it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dir = Path(config_dir)
    config_dir.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY_LLAMA, "tie_word_embeddings": tied}
    (config_dir / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def grid(shape, splits):
    """The chunks ``[(offsets, sizes)]`` of a regular tiling of ``shape``: ``splits[d]`` blocks along
    dim ``d`` (the last ones shorter), in row-major block order (a 2-D FSDP x TP mesh's shards)."""
    import itertools

    axes = []
    for n, k in zip(shape, list(splits) + [1] * (len(shape) - len(splits))):
        per = -(-n // k) if n else 0
        axes.append([(i * per, min(per, n - i * per)) for i in range(k) if i * per < n] or [(0, 0)])
    return [(tuple(o for o, _ in combo), tuple(s for _, s in combo)) for combo in itertools.product(*axes)]


def write_dcp(directory, tensors, *, nest="model", files=2, extra=None, stored=None):
    """A DCP checkpoint of ``tensors`` (``{name: full tensor}`` or ``{name: (full, chunks)}``, chunks
    ``[(offsets, sizes)]``, default one whole chunk), each chunk ``torch.save``'d into
    ``__<k % files>_0.distcp`` at its recorded offset, as FileSystemWriter writes them; nested under
    ``nest`` as Accelerate saves them (None: flat). ``extra``: ``{fqn: metadata}`` of further entries
    (None: bytes, as an optimizer's param_groups). ``stored``: ``stored(fqn, j, piece) -> tensor``
    saved instead of the tensor's chunk ``j`` (a damaged save). Returns ``directory``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    streams = [io.BytesIO() for _ in range(files)]
    sd_meta, storage, planner = {}, {}, {}
    k = 0
    for name, value in tensors.items():
        full, chunks = value if isinstance(value, tuple) else (value, [((0,) * value.dim(), tuple(value.shape))])
        fqn = f"{nest}.{name}" if nest else name
        planner[fqn] = (nest, name) if nest else (name,)
        metas = []
        for j, (offsets, sizes) in enumerate(chunks):
            piece = full
            for d, (o, s) in enumerate(zip(offsets, sizes)):
                piece = piece.narrow(d, o, s)
            stream = streams[k % files]
            start = stream.tell()
            piece = piece.clone().contiguous()
            torch.save(stored(fqn, j, piece) if stored else piece, stream)
            storage[MetadataIndex(fqn, torch.Size(offsets))] = _StorageInfo(f"__{k % files}_0.distcp", start,
                                                                            stream.tell() - start)
            metas.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
            k += 1
        sd_meta[fqn] = TensorStorageMetadata(TensorProperties(dtype=full.dtype), full.size(), metas)
    for fqn, value in (extra or {}).items():
        sd_meta[fqn] = BytesStorageMetadata() if value is None else value
        planner[fqn] = tuple(fqn.split("."))
    for rank, stream in enumerate(streams):
        (directory / f"__{rank}_0.distcp").write_bytes(stream.getvalue())
    md = Metadata(state_dict_metadata=sd_meta, planner_data=planner, storage_data=storage, version="1.0.0")
    with open(directory / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
    return directory


def read_metadata(directory):
    """The ``Metadata`` of ``directory/.metadata`` (torch's own classes: test-side only)."""
    with open(Path(directory) / ".metadata", "rb") as fh:
        return pickle.load(fh)


def write_metadata(directory, md):
    with open(Path(directory) / ".metadata", "wb") as fh:
        pickle.dump(md, fh)
