"""hf-ckpt against verl's own ``model_merger`` on a verl-style FSDP2 actor save (not part of ``make bench``).

verl is not a dependency; its merger runs from an unpacked wheel, nothing installed in the venv::

    .venv/bin/python -m pip download verl --no-deps -d /tmp/verl && unzip -q /tmp/verl/verl-*.whl -d /tmp/verl/src
    .venv/bin/python -m pip install --no-deps --target /tmp/verl/deps omegaconf antlr4-python3-runtime==4.9.3
    .venv/bin/python benchmarks/verl_merger_bench.py WORKDIR --verl /tmp/verl/src:/tmp/verl/deps

The save: a 134M-parameter Llama (hidden 768, 12 layers, vocabulary 32001: an odd vocabulary on
``Shard(1)`` by verl's placement function) wrapped by ``fully_shard`` as verl's ``apply_fsdp2``
wraps it on 2 ranks, each rank's ``model.state_dict()`` saved as ``FSDPCheckpointManager`` saves
it, the engine's own full state dict as the reference. verl imports ray, tensordict and others at
package import that its merger never calls: they are stubbed as empty modules (``--stub-runner``).
Each tool runs once in a fresh process; wall time and peak RSS (``ru_maxrss``, which counts the
file pages hf-ckpt maps) are printed with whether its output equals the reference (bitwise, or
bitwise to the reference cast to bf16).
"""
import argparse
import glob
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUBS = ("ray", "tensordict", "codetiming", "pylatexenc", "torchdata", "wandb", "datasets", "hydra", "dill",
         "pyarrow", "liger_kernel", "flash_attn", "vllm", "sglang", "math_verify")

GEN = r'''
import json, os, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from transformers import LlamaConfig, LlamaForCausalLM
out = Path(sys.argv[1])
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=["fsdp"])
cfg = LlamaConfig(vocab_size=32001, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg)
def fn(p):
    for i, s in enumerate(p.shape):
        if s % world == 0:
            return Shard(i)
    return Shard(0)
kw = {"mesh": mesh, "shard_placement_fn": fn, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}
for m in model.modules():
    if type(m).__name__ == "LlamaDecoderLayer" or isinstance(m, torch.nn.Embedding):
        fully_shard(m, **kw)
fully_shard(model, **kw)
local = out / "actor"
local.mkdir(parents=True, exist_ok=True)
torch.save(model.state_dict(), local / f"model_world_size_{world}_rank_{rank}.pt")
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
if rank == 0:
    model.config.architectures = ["LlamaForCausalLM"]
    model.config.save_pretrained(local / "huggingface")
    sys.path.insert(0, sys.argv[2])
    import fsdp_rank_files
    fsdp_rank_files._tokenizer().save_pretrained(local / "huggingface")
    (local / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in full.items()}, str(out / "reference.safetensors"))
dist.barrier()
os._exit(0)
'''

RUNNER = r'''
import importlib.abc, importlib.machinery, runpy, sys
from unittest import mock
STUBS = set(sys.argv[1].split(","))
class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in STUBS else None
    def create_module(self, spec):
        m = mock.MagicMock(name=spec.name)
        m.__path__, m.__spec__, m.__version__ = [], spec, "0.0"
        return m
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, Finder())
sys.argv = ["verl.model_merger"] + sys.argv[2:]
runpy.run_module("verl.model_merger", run_name="__main__")
'''


def _anon_kib(pid) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) for line in fh if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def timed(cmd, env=None):
    """``(seconds, peak RSS MiB, peak anonymous RSS MiB sampled every 10 ms, returncode, stderr tail)`` of
    ``cmd`` in a fresh process (RSS counts the file pages a process maps; anonymous memory does not)."""
    start = time.perf_counter()
    with open(os.devnull, "wb") as null, open(os.path.join(os.path.dirname(cmd[-1]), "stderr.log"), "w+b") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=null, stderr=err)
        anon = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            anon = max(anon, _anon_kib(proc.pid))
            time.sleep(0.01)
        secs = time.perf_counter() - start
        err.seek(0)
        tail = err.read().decode(errors="replace")[-400:]
    return secs, usage.ru_maxrss / 1024, anon / 1024, os.waitstatus_to_exitcode(status), tail


def verdict(out_dir, ref):
    import torch
    from safetensors.torch import load_file

    got = {}
    for f in glob.glob(os.path.join(out_dir, "*.safetensors")):
        got.update(load_file(f))
    if set(got) != set(ref):
        return f"wrong names ({len(set(got) ^ set(ref))} differ)"
    dtypes = sorted({str(v.dtype).replace("torch.", "") for v in got.values()})
    if all(torch.equal(got[k], ref[k]) for k in ref):
        return f"{'/'.join(dtypes)}, bitwise the engine's weights"
    if all(torch.equal(got[k], ref[k].bfloat16()) for k in ref):
        return f"{'/'.join(dtypes)}, bitwise the engine's weights cast to bf16"
    return f"{'/'.join(dtypes)}, differs from the engine's weights"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("work", type=Path)
    p.add_argument("--verl", required=True, help="PYTHONPATH holding verl (unpacked wheel) and omegaconf")
    args = p.parse_args()
    py = sys.executable
    work = args.work.resolve()
    if not (work / "save" / "reference.safetensors").exists():
        (work / "gen.py").parent.mkdir(parents=True, exist_ok=True)
        (work / "gen.py").write_text(GEN)
        subprocess.run([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(work / "gen.py"),
                        str(work / "save"), str(REPO / "tests" / "engines")], check=True, stdout=subprocess.DEVNULL)
    (work / "run_verl.py").write_text(RUNNER)
    from safetensors.torch import load_file

    ref = load_file(str(work / "save" / "reference.safetensors"))
    actor = str(work / "save" / "actor")
    runs = [
        ("verl model_merger (fsdp backend)", [py, str(work / "run_verl.py"), ",".join(STUBS), "merge", "--backend",
                                             "fsdp", "--local_dir", actor, "--target_dir"],
         {**os.environ, "PYTHONPATH": args.verl}),
        ("hf-ckpt export", [py, "-m", "hf_ckpt_integrations", "export", actor],
         {**os.environ, "PYTHONPATH": str(REPO)}),
        ("hf-ckpt export --dtype bf16", [py, "-m", "hf_ckpt_integrations", "export", "--dtype", "bf16", actor],
         {**os.environ, "PYTHONPATH": str(REPO)}),
    ]
    print("| tool | wall s | peak RSS MiB | peak anonymous MiB | output |\n|---|---|---|---|---|")
    for i, (name, cmd, env) in enumerate(runs):
        out = work / f"out{i}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        secs, rss, anon, rc, err = timed(cmd + [str(out)], env)
        shown = verdict(out, ref) if rc == 0 else "failed: " + (err.splitlines() or ["?"])[-1]
        print(f"| {name} | {secs:.2f} | {rss:.0f} | {anon:.0f} | {shown} |")


if __name__ == "__main__":
    main()
