"""Train a tiny Llama under FSDP2 (``fully_shard``) on CPU/gloo and save it with torch DCP.

``torchrun --standalone --nproc_per_node N fsdp_train.py OUT --mode plain|accelerate|trainer``.

- ``plain``: ``fully_shard`` per decoder layer and at the root, two AdamW steps, then
  ``dcp.save({**model_state_dict, "optimizer": optim_state_dict}, OUT/dcp)`` (the torchtitan
  layout: model keys at the top level beside the optimizer's).
- ``accelerate``: an ``Accelerator`` with an FSDP2 plugin (SHARDED_STATE_DICT) and
  ``accelerator.save_state(OUT/state)``: ``pytorch_model_fsdp_0/`` (state dict nested under
  ``model``) and ``optimizer_0/``.
- ``trainer``: a ``Trainer`` under FSDP2 saving ``checkpoint-2`` and ``checkpoint-4``.

The save-time modes (the package's hooks) are in ``fsdp_savetime.py``, so these cached runs do not
depend on the package's code.

Every mode writes the reference the engine itself reports, at the last save:
``OUT/reference.safetensors`` (``get_model_state_dict(full_state_dict=True)``), the HF config in
``OUT/config`` and the logits of :func:`common.probe_input` in ``OUT/logits.pt``.

CPU facts (test support only, see docs/fsdp.md): Accelerate 1.16 keeps ``DistributedType.NO`` /
``MULTI_CPU`` on CPU even with an FSDP plugin, so :func:`_force_fsdp` sets ``distributed_type``
and ``fsdp_plugin`` on the state and on ``PartialState._shared_state`` before ``prepare``; the
Trainer needs the same from ``create_accelerator_and_postprocess``. FSDP processes sometimes abort
at interpreter exit on CPU: every mode ends with a barrier and ``os._exit(0)``.
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402




def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(common.tiny_llama_config())


def _reference(model, out: Path):
    """Collective: the engine's own full state dict, its config and probe logits, written by rank 0."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        logits = model(common.probe_input()).logits.detach().float()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "reference.safetensors"))
        model.config.save_pretrained(str(out / "config"))
        torch.save(logits, out / "logits.pt")


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def run_plain(out: Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dist.init_process_group("gloo")
    model = _fsdp2(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_two_steps(model, opt)
    state = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(model, opt)
    dcp.save(state, checkpoint_id=str(out / "dcp"))
    _reference(model, out)


def _force_fsdp(accelerator_state, plugin):
    """Test-support shim (never shipped): make Accelerate 1.16 run FSDP on CPU (see the docstring)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    for shared in (AcceleratorState._shared_state, PartialState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    accelerator_state.distributed_type = DistributedType.FSDP
    accelerator_state.fsdp_plugin = plugin


def _plugin():
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT",
                                          auto_wrap_policy="transformer_based_wrap",
                                          transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                          reshard_after_forward=True, cpu_ram_efficient_loading=False)


def run_accelerate(out: Path, hooks=None):
    from accelerate import Accelerator

    plugin = _plugin()
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=True)
    if hooks:
        hooks(accelerator)
    _force_fsdp(accelerator.state, plugin)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    for step in range(2):
        ids = common.fixed_batch(step, rank=accelerator.process_index)
        accelerator.backward(model(ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    if hooks:
        accelerator.save_model(model, str(out / "saved"), max_shard_size="300KB")
    else:
        accelerator.save_state(str(out / "state"))
    _reference(model, out)


def run_trainer(out: Path, callback=None, resume_from=None):
    from transformers import Trainer, TrainingArguments

    plugin = _plugin()

    class FsdpTrainer(Trainer):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            _force_fsdp(self.accelerator.state, plugin)
            self.is_fsdp_enabled = True

    dist.init_process_group("gloo")
    targs = TrainingArguments(
        output_dir=str(out / "run"), max_steps=4, save_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
        save_strategy="steps", use_cpu=True, save_only_model=False,
        fsdp="full_shard", fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                        "reshard_after_forward": True, "cpu_ram_efficient_loading": False})
    callbacks = [callback] if callback else []
    trainer = FsdpTrainer(model=_model(), args=targs, train_dataset=common.RandomTokens(n=16), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    _reference(trainer.model_wrapped, out)


def train_two_steps(model, opt, data_rank=None):
    """Two AdamW steps on this rank's fixed batches (another rank's with ``data_rank``)."""
    for step in range(2):
        ids = common.fixed_batch(step, rank=dist.get_rank() if data_rank is None else data_rank)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def fsdp1_full_state_dict(model):
    """FSDP1's own ``FULL_STATE_DICT`` on every rank: the reference (``rank0_only=True`` with
    ``offload_to_cpu=True`` segfaults in torch 2.13 on CPU)."""
    from torch.distributed.fsdp import FullStateDictConfig, FullyShardedDataParallel as FSDP, StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        return model.state_dict()


def save_fsdp1_per_rank(model, out: Path, state_dict_type: str):
    """FSDP1 saved by Accelerate's own ``save_fsdp_model(use_dcp=False)`` under ``state_dict_type``
    into ``out/state`` (per-rank files), and its full state dict beside as the reference. The
    Accelerator is not prepared (FSDP1 on CPU through ``prepare`` is not supported by Accelerate
    1.16); save_fsdp_model reads ``process_index`` only."""
    from types import SimpleNamespace

    from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model
    from safetensors.torch import save_file

    plugin = FullyShardedDataParallelPlugin(fsdp_version=1, state_dict_type=state_dict_type)
    accelerator = SimpleNamespace(process_index=dist.get_rank(), num_processes=dist.get_world_size())
    save_fsdp_model(plugin, accelerator, model, str(out / "state"), use_dcp=False)
    full = fsdp1_full_state_dict(model)
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "reference.safetensors"))


def shard_placement_fn(fsdp_size):
    """verl's get_shard_placement_fn: the first dim the FSDP size divides, else dim 0."""
    from torch.distributed.tensor import Shard

    def fn(param):
        for i, s in enumerate(param.shape):
            if s % fsdp_size == 0:
                return Shard(i)
        return Shard(0)
    return fn


def run_fsdp1(out: Path, *, use_orig_params: bool):
    """FSDP1 (``FullyShardedDataParallel``) on CPU, saved as Accelerate saves it under
    ``SHARDED_STATE_DICT``: ``{"model": state_dict}`` with ``dcp.save`` into
    ``pytorch_model_fsdp_0/``. The reference is FSDP1's own ``FULL_STATE_DICT`` on every rank
    (``rank0_only=True`` with ``offload_to_cpu=True`` segfaults in torch 2.13 on CPU)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

    dist.init_process_group("gloo")
    model = FSDP(_model(), device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_two_steps(model, opt)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(out / "state" / "pytorch_model_fsdp_0"))
    full = fsdp1_full_state_dict(model)
    with torch.no_grad():
        logits = model(common.probe_input()).logits.detach().float()
    if dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(out / "reference.safetensors"))
        model.module.config.save_pretrained(str(out / "config"))
        torch.save(logits, out / "logits.pt")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=("plain", "accelerate", "trainer", "fsdp1", "fsdp1-flat"), required=True)
    args = p.parse_args()
    {"plain": run_plain, "accelerate": run_accelerate, "trainer": run_trainer,
     "fsdp1": lambda out: run_fsdp1(out, use_orig_params=True),
     "fsdp1-flat": lambda out: run_fsdp1(out, use_orig_params=False)}[args.mode](args.out)
    finish()


def finish():
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # FSDP processes sometimes abort at interpreter exit on CPU


if __name__ == "__main__":
    main()
