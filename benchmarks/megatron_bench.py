"""hf-ckpt export of a Megatron-Core torch_dist save against slime's and mbridge's converters (issue 37).

Not part of ``make test`` (``make bench-megatron``). Steps:

1. The save, built once (cached under ``.bench-cache/megatron/``): megatron-core 0.16.1's own
   ``dist_checkpointing.save`` of a real ``GPTModel`` built on CPU (2 ranks, gloo, TP 2, bf16, the local
   layer spec: RMSNorm, SwiGLU, RoPE, GQA; Megatron-LM's ``generate_state_dict`` form: the model's
   sharded state dict beside ``args``, an ``argparse.Namespace``, in ``common.pt``), plus the legacy
   ``mp_rank_TT/model_optim_rng.pt`` layout of the same weights (hf-ckpt only: neither peer reads it).
   The stand-ins are tests/engines/megatron_train.py's (CPU ``current_device``, no-op ``synchronize``).
2. Each tool runs ``--rounds`` times, alternately, each run a fresh process with its output removed first:
   ``hf-ckpt export`` (torch_dist: config.json derived from the saved args, and with ``--config``; legacy), slime's ``tools/convert_torch_dist_to_hf.py`` (vendored
   under ``benchmarks/peers/slime``; see its README for what was cut) and mbridge
   (``benchmarks/peers/mbridge_export.py``, mbridge from a ``--target`` directory, never installed into
   .venv). Wall time (median, min-max) and peak RSS (the child's own ``ru_maxrss``, max over rounds).
3. "Bytes right", once, outside the timing: every peer output tensor against ours, bitwise, by name.

Usage::

    .venv/bin/python -m pip install --no-deps --target /tmp/mbridge mbridge==0.15.1
    .venv/bin/python benchmarks/megatron_bench.py --mbridge /tmp/mbridge [--rounds 3] [--layers 16]
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable
CACHE = REPO / ".bench-cache" / "megatron"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore",
       "OMP_NUM_THREADS": "1"}
# The model: a Llama-like GPTModel (GQA 16 heads / 4 groups), bf16.
VOCAB, DIVISIBLE_BY, TP, HIDDEN, FFN, HEADS, GROUPS = 32001, 128, 2, 1024, 2816, 16, 4


def padded_vocab() -> int:
    multiple = DIVISIBLE_BY * TP
    return -(-VOCAB // multiple) * multiple


# ---------------------------------------------------------------- the save (run under torchrun, 2 ranks)
def gen(out: Path, layers: int) -> None:
    import argparse as ap

    sys.path.insert(0, str(REPO / "tests" / "engines"))
    import megatron_train  # noqa: F401  (its CPU stand-ins: torch.cuda.current_device/synchronize)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS, normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True, tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=1, sequence_parallel=False, init_method_std=0.02, pipeline_dtype=torch.bfloat16)
    torch.manual_seed(1234)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=padded_vocab(), max_sequence_length=4096, pre_process=True, post_process=True,
                     parallel_output=True, share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=10000)
    # Stand-in for training: the norms leave their init (all ones) and every weight moves; the same seed
    # on both TP ranks keeps the replicated tensors (norms) equal, as training keeps them.
    torch.manual_seed(99)
    with torch.no_grad():
        for prm in model.parameters():
            prm.add_(torch.randn_like(prm, dtype=torch.float32).to(prm.dtype) * 0.01)
    # What Megatron-LM's arguments.py holds (the fields converters read; q_lora_rank is Megatron-LM's MLA flag).
    args = ap.Namespace(
        num_layers=layers, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        group_query_attention=True, num_query_groups=GROUPS, kv_channels=HIDDEN // HEADS, max_position_embeddings=4096,
        seq_length=4096, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
        normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=True, padded_vocab_size=padded_vocab(), vocab_size=VOCAB,
        make_vocab_size_divisible_by=DIVISIBLE_BY, tensor_model_parallel_size=TP, pipeline_model_parallel_size=1,
        expert_model_parallel_size=1, data_parallel_size=1, num_experts=None, q_lora_rank=None,
        params_dtype=torch.bfloat16, fp16=False, bf16=True, ckpt_format="torch_dist", use_distributed_optimizer=False,
        iteration=1, tokenizer_type="NullTokenizer")
    td, legacy = out / "torch_dist", out / "legacy"
    it = "iter_0000001"
    if dist.get_rank() == 0:
        (td / it).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": 1}
    dist_checkpointing.save(sd, str(td / it), sharded_strategy=("torch_dist", 1))
    rank = parallel_state.get_tensor_model_parallel_rank()
    d = legacy / it / f"mp_rank_{rank:02d}"
    d.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1,
                "model": model.state_dict_for_save_checkpoint()}, d / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        for root in (td, legacy):
            (root / "latest_checkpointed_iteration.txt").write_text("1")
        from transformers import LlamaConfig

        LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
                    num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                    architectures=["LlamaForCausalLM"], torch_dtype="bfloat16").save_pretrained(out / "config")
        (out / "done").write_text(json.dumps({"layers": layers}))
    dist.barrier()
    dist.destroy_process_group()


def build(layers: int) -> Path:
    out = CACHE / f"llama-{layers}l-v2"
    if (out / "done").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"building the save in {out} (2 ranks) ...", flush=True)
    subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__, "_gen",
                    str(out), str(layers)], check=True, env={**ENV, "PYTHONPATH": str(REPO)})
    return out


# ---------------------------------------------------------------- running and checking
def _anon_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) * 1024 for line in fh if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def run_child(cmd, env) -> tuple:
    """(wall seconds, peak RSS bytes of the child itself (``ru_maxrss``: counts the file pages it maps),
    peak anonymous RSS bytes (``RssAnon`` sampled every 10 ms), rc, output tail) of ``cmd`` in a fresh process."""
    started = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
        anon = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            anon = max(anon, _anon_bytes(proc.pid))
            time.sleep(0.01)
        wall = time.perf_counter() - started
        log.seek(0)
        tail = log.read().decode(errors="replace")[-1500:]
    return wall, usage.ru_maxrss * 1024, anon, os.waitstatus_to_exitcode(status), tail


def load_dir(d: Path) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                out[k] = fh.get_tensor(k)
    return out


def bytes_right(ours: dict, d: Path) -> str:
    import torch

    got = load_dir(d)
    if not got:
        return "no output"
    missing, extra = sorted(set(ours) - set(got)), sorted(set(got) - set(ours))
    same = [k for k in ours if k in got and got[k].dtype == ours[k].dtype and got[k].shape == ours[k].shape
            and torch.equal(got[k].view(torch.uint8) if got[k].numel() else got[k],
                            ours[k].view(torch.uint8) if ours[k].numel() else ours[k])]
    bad = sorted(k for k in ours if k in got and k not in same)
    cast = [k for k in bad if got[k].shape == ours[k].shape and torch.equal(got[k], ours[k].to(got[k].dtype))]
    bad = [k for k in bad if k not in cast]
    text = f"{len(same)}/{len(ours)} tensors bitwise ours"
    if cast:
        kinds = sorted({f"{ours[k].dtype}->{got[k].dtype}".replace("torch.", "") for k in cast})
        text += f", {len(cast)} equal to ours cast {', '.join(kinds)} (torch's rounding)"
    if missing or extra or bad:
        text += f"; missing {missing[:3]}, extra {extra[:3]}, differ {[(k, str(got[k].dtype), list(got[k].shape)) for k in bad[:3]]}"
    return text


def machine() -> str:
    import importlib.metadata as md

    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    vers = ", ".join(f"{p} {md.version(p)}" for p in ("torch", "megatron-core", "transformers", "safetensors"))
    return f"{os.cpu_count()} CPU cores ({cpu}), {mem / 2**30:.0f} GiB RAM, no GPU; Python {platform.python_version()}, {vers}"


def main(argv=None) -> None:
    if (argv or sys.argv[1:])[:1] == ["_gen"]:
        a = (argv or sys.argv[1:])
        return gen(Path(a[1]), int(a[2]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mbridge", help="a directory holding mbridge (pip install --no-deps --target DIR mbridge)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--only", default="", help="comma-separated tool keys (ours,ours-config,ours-legacy,slime,mbridge)")
    args = p.parse_args(argv)
    save = build(args.layers)
    td, legacy, cfg = save / "torch_dist", save / "legacy", save / "config"
    it = td / "iter_0000001"
    size = sum(f.stat().st_size for f in it.iterdir() if f.is_file())
    outs = CACHE / "out"
    ours_env = {**ENV, "PYTHONPATH": str(REPO)}
    tools = {
        "ours": ("hf-ckpt export (torch_dist)", lambda o: [PY, "-m", "hf_ckpt_integrations", "export", str(td), str(o)],
                 ours_env),
        "ours-config": ("hf-ckpt export --config (torch_dist)",
                        lambda o: [PY, "-m", "hf_ckpt_integrations", "export", str(td), str(o), "--config", str(cfg)],
                        ours_env),
        "ours-legacy": ("hf-ckpt export (legacy files)",
                        lambda o: [PY, "-m", "hf_ckpt_integrations", "export", str(legacy), str(o)], ours_env),
        "slime": ("slime tools/convert_torch_dist_to_hf.py",
                  lambda o: [PY, str(HERE / "peers" / "slime" / "tools" / "convert_torch_dist_to_hf.py"),
                             "--input-dir", str(it), "--output-dir", str(o), "--origin-hf-dir", str(cfg),
                             "--vocab-size", str(VOCAB)],
                  {**ENV, "PYTHONPATH": str(HERE / "peers" / "slime")}),
    }
    if args.mbridge:
        tools["mbridge"] = ("mbridge (load + save_weights)",
                            lambda o: [PY, str(HERE / "peers" / "mbridge_export.py"), args.mbridge, str(cfg), str(it),
                                       str(o), str(DIVISIBLE_BY * TP)], ENV)
    if args.only:
        tools = {k: v for k, v in tools.items() if k in args.only.split(",")}
    walls = {k: [] for k in tools}
    rss = {k: [] for k in tools}
    anon = {k: [] for k in tools}
    fails = {}
    for r in range(args.rounds):
        for key, (label, cmd, env) in tools.items():
            if key in fails:
                continue
            o = outs / key
            shutil.rmtree(o, ignore_errors=True)
            subprocess.run(["sync"], check=False)
            wall, peak, peak_anon, rc, tail = run_child(cmd(o), env)
            if rc != 0:
                fails[key] = f"exit {rc}: " + " / ".join(tail.strip().splitlines()[-3:])
                print(f"{label}: FAILED {fails[key]}", flush=True)
                continue
            walls[key].append(wall)
            rss[key].append(peak)
            anon[key].append(peak_anon)
            print(f"round {r + 1} {label}: {wall:.2f} s, peak RSS {peak / 2**20:.0f} MiB, anonymous "
                  f"{peak_anon / 2**20:.0f} MiB", flush=True)
    ours = load_dir(outs / "ours") if "ours" in tools and "ours" not in fails else {}
    print(f"\nsave: {it} ({size / 1e6:.0f} MB in the iteration directory; {args.layers} layers, TP {TP}, bf16)")
    print(f"machine: {machine()}\n")
    print("| tool | median wall s (min-max) | peak RSS MiB | peak anonymous MiB | bytes right |\n|---|---|---|---|---|")
    for key, (label, _, _) in tools.items():
        if key in fails:
            print(f"| {label} | failed | - | - | {fails[key][:300]} |")
            continue
        w = walls[key]
        right = "(the reference)" if key == "ours" else bytes_right(ours, outs / key) if ours else "?"
        print(f"| {label} | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) | {max(rss[key]) / 2**20:.0f} | "
              f"{max(anon[key]) / 2**20:.0f} | {right} |")


if __name__ == "__main__":
    main()
