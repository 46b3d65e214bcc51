"""FSDP2 save time with the package's hooks, on CPU/gloo (the runs of ``fsdp_train.py`` plus a hook).

``torchrun --standalone --nproc_per_node 2 fsdp_savetime.py OUT --mode accelerate-hooks|trainer-cb``.

- ``accelerate-hooks``: ``install_accelerate_hooks(accelerator)`` right after ``Accelerator(...)``,
  two steps, then ``accelerator.save_model(model, OUT/saved, max_shard_size="300KB")``; that save
  runs again with NCCL's device rules on (tests/support/nccl_rules.py), the shards on a fake-device
  mesh, on the device and in CPU memory (``CPUOffloadPolicy``): ``OUT/nccl/{device,cpu}/``.
- ``trainer-cb``: the Trainer under FSDP2 with ``ConsolidatedCheckpointCallback`` (saves at steps
  2 and 4); ``--resume-from CASE/run/checkpoint-N`` (relative to the case's parent) resumes
  another case's run from that checkpoint first.

References as in ``fsdp_train.py`` (``OUT/reference.safetensors`` at the end of the run).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_train  # noqa: E402


def _with_nccl_saves(accelerator, out):
    """``accelerator.save_model`` that, after its own save, saves again under NCCL's rules."""
    hooked = accelerator.save_model

    def save_model(model, save_directory, **kwargs):
        from tests.support import nccl_rules

        report = hooked(model, save_directory, **kwargs)
        nccl_rules.engine_saves(lambda dst: hooked(model, str(dst), **kwargs), accelerator.unwrap_model(model), out)
        return report

    accelerator.save_model = save_model
    return accelerator


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=("accelerate-hooks", "trainer-cb"), required=True)
    p.add_argument("--resume-from", type=Path)
    args = p.parse_args()
    from hf_ckpt_integrations import ConsolidatedCheckpointCallback, install_accelerate_hooks

    if args.mode == "accelerate-hooks":
        fsdp_train.run_accelerate(args.out, hooks=lambda accelerator: _with_nccl_saves(
            install_accelerate_hooks(accelerator), args.out / "nccl"))
    else:
        resume = args.out.parent / args.resume_from if args.resume_from else None
        fsdp_train.run_trainer(args.out, callback=ConsolidatedCheckpointCallback(max_shard_size="300KB"),
                               resume_from=resume)
    fsdp_train.finish()


if __name__ == "__main__":
    main()
