"""FSDP2 saved through torch's ``HuggingFaceStorageWriter`` (DCP in safetensors files), on CPU/gloo.

``torchrun --standalone --nproc_per_node 2 fsdp_hf_writer.py OUT``: the ``fsdp_train.py`` plain run
(``fully_shard``, two AdamW steps), then ``dcp.save(model_state_dict,
storage_writer=HuggingFaceStorageWriter(OUT/hf, save_distributed=True))``: every rank writes its
shards to ``OUT/hf/sharded/shard-0000R-model-00001-of-00001.safetensors``, each tensor's offset
in the global tensor recorded in the file's ``DCP_SHARDING_INFO`` metadata (torch's
``consolidate_safetensors_files`` reads those). Reference as in ``fsdp_train.py``.
"""
import argparse
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_train  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    args = p.parse_args()
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dist.init_process_group("gloo")
    model = fsdp_train._fsdp2(fsdp_train._model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp_train.train_two_steps(model, opt)
    writer = HuggingFaceStorageWriter(str(args.out / "hf"), save_distributed=True)
    dcp.save(get_model_state_dict(model), storage_writer=writer)
    fsdp_train._reference(model, args.out)
    fsdp_train.finish()


if __name__ == "__main__":
    main()
