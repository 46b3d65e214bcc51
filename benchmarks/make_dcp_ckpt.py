"""Build the FSDP2 benchmark checkpoint of ``dcp_bench.py``: a Llama under ``fully_shard`` on CPU/gloo.

Launched as ``torchrun --standalone --nproc_per_node 2 make_dcp_ckpt.py OUT --size S``. The model is
``make_ckpt.llama_config(S)`` (the same Llamas as ``export_bench.py``), sharded with the test
engines' ``fsdp_train._fsdp2`` (``fully_shard`` per decoder layer and at the root), trained one
AdamW step, then its sharded model state dict (``get_model_state_dict``: one dim-0 ``DTensor``
shard per rank) is saved twice by ``torch.distributed.checkpoint.save``:

- ``OUT/dcp/``: the default ``FileSystemWriter`` (``.metadata`` + ``__0_0.distcp``, ``__1_0.distcp``),
  what Accelerate's ``save_state`` / the Trainer put in ``pytorch_model_fsdp_0/`` (the optimizer
  goes to a directory of its own there, so this one holds the model only);
- ``OUT/dcp-hf/``: ``HuggingFaceStorageWriter(save_distributed=True)`` (one
  ``shard-0000R-model-00001-of-00001.safetensors`` per rank), the input of torch's
  ``consolidate_safetensors_files``; ``OUT/dcp-fqn.json`` is its fqn -> output-file mapping;
- ``OUT/config/config.json``: the HF config.

The CPU facts (exit with ``os._exit`` after a barrier) are ``fsdp_train.finish``'s.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "engines"))
import fsdp_train  # noqa: E402  (the test engines' FSDP2 wrapping and CPU exit handling)
from make_ckpt import SIZES, llama_config  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--size", choices=sorted(SIZES), required=True)
    args = p.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter, HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import LlamaForCausalLM

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = llama_config(args.size)
    model = fsdp_train._fsdp2(LlamaForCausalLM(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    del opt
    sd = get_model_state_dict(model)
    dcp.save(sd, storage_writer=FileSystemWriter(str(args.out / "dcp")))
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(args.out / "dcp-hf"), save_distributed=True))
    if rank == 0:
        config.save_pretrained(args.out / "config")
        (args.out / "dcp-fqn.json").write_text(json.dumps({n: 1 for n in sd}))
    fsdp_train.finish()


if __name__ == "__main__":
    main()
