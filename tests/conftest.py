"""Test harness: real engines in real processes, built once and cached.

``engine_ckpt(name)`` launches ``tests/engines/<script>`` with ``torchrun --standalone`` on CPU
(DeepSpeed picks its CPU accelerator and gloo), or with ``accelerate launch --config_file`` for the
Accelerate cases, the first time a case is asked for, and keeps
the result under ``.test-cache/`` keyed by the package versions and the engine scripts, so a
rerun costs nothing. Each case directory holds the engine's checkpoint and the reference
weights the engine itself reported at save time.
"""

import fcntl
import hashlib
import importlib.metadata as md
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from procs import wait_or_stop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ENGINES = REPO / "tests" / "engines"
ACCELERATE_CONFIGS = ENGINES / "accelerate"  # real `accelerate launch` config files + their DeepSpeed JSON
ENGINE_TIMEOUT_S = 900

# `make test-fast` sets this: the selection `-m "not engine"` must launch no engine. A test that
# does (an engine run asked for without the marker) fails at the launch instead of making the
# fast suite slow without anyone noticing.
NO_ENGINE_ENV = "HFCKPT_NO_ENGINE"
# Fixtures that build or hold engine runs: a test using one (directly or through another fixture)
# is an engine test whatever its file says.
ENGINE_FIXTURES = {"engine_ckpt"}
_LAUNCHERS = ("torch.distributed.run", "torchrun", "accelerate.commands.launch", "accelerate launch",
              "NotebookClient")


def refuse_engine_launch(what) -> None:
    """Raise when an engine launch (``what``: a command or a description) happens under the fast selection."""
    if os.environ.get(NO_ENGINE_ENV):
        raise RuntimeError(f"engine launch under the fast suite ({NO_ENGINE_ENV} is set): {str(what)[:300]}; "
                           "mark the test `@pytest.mark.engine` (or use the engine_ckpt fixture)")


if os.environ.get(NO_ENGINE_ENV):
    class _NoEnginePopen(subprocess.Popen):
        """Every process a test starts is checked: a launcher in its command line is an engine run."""

        def __init__(self, args, *a, **kw):
            text = args if isinstance(args, (str, bytes)) else " ".join(map(str, args))
            if any(k in str(text) for k in _LAUNCHERS):
                refuse_engine_launch(text)
            super().__init__(args, *a, **kw)

    subprocess.Popen = _NoEnginePopen

# DeepSpeed JIT-builds its CPU shm op into ~/.cache/torch_extensions by default: one directory for
# every venv and every clone, each rebuilding it (their include paths differ) while the others may
# be loading it — seen: the .so missing mid-run while another clone's tests ran. Every process the
# tests start (engine runs, notebooks, the CLI) inherits this venv's own directory instead. The
# build command holds the venv path as spelled (a git worktree's `.venv` symlink to a shared venv
# differs from the venv's own path), so the directory is keyed by that spelling too: two spellings
# alternating on one directory rebuilt the op on every switch, each waiting on the other's lock.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(
    Path(sys.prefix).resolve() / "torch-extensions" / hashlib.sha256(sys.prefix.encode()).hexdigest()[:8]))

# The Hub-layout answers transformers gives are cached (sources/hub_layout.py); the tests keep theirs
# in a directory of this session, never the user's ~/.cache, so every run derives them afresh.
os.environ.setdefault("HF_CKPT_CACHE", tempfile.mkdtemp(prefix="hfckpt-layout-cache-"))

# ColossalAI tests run in .venv-cai only (`make test-cai`).
collect_ignore = [] if importlib.util.find_spec("colossalai") else ["cai"]

# name -> (script, nproc, args). Each is one real multi-process run under torchrun, except the
# Accelerate cases: ACCELERATE[name] is the config file `accelerate launch` gets (nproc comes from it).
ACCELERATE = {"acc-z1-bf16": "zero1_bf16.yaml", "acc-z3": "zero3.yaml", "acc-autotp-z2-bf16": "autotp_zero2_bf16.yaml",
              "acc-autotp-z3-bf16": "autotp_zero3_bf16.yaml"}
CASES = {
    **{f"z{s}-{d}": ("ds_train.py", 2, ["--stage", str(s), "--dtype", d]) for s in (1, 2, 3) for d in ("fp32", "bf16")},
    **{f"z{s}-frozen": ("ds_train.py", 2, ["--stage", str(s), "--variant", "frozen"]) for s in (1, 2, 3)},
    **{f"z{s}-tied": ("ds_train.py", 2, ["--stage", str(s), "--variant", "tied"]) for s in (2, 3)},
    "trainer-z3": ("trainer_train.py", 2, ["--stage", "3"]),
    # A plain Trainer checkpoint-N (no DeepSpeed): model.safetensors beside optimizer.pt & co.
    "trainer-plain": ("trainer_plain.py", 1, []),
    # ConsolidatedCheckpointCallback (tests/integrations/test_trainer_callback.py); "-resume" resumes from "cb-z3".
    "cb-z3": ("trainer_callback_run.py", 2, ["--stage", "3", "--save-total-limit", "2", "--max-shard-size", "300KB",
                                             "--final", "--fail-test", "--nccl-rules"]),
    "cb-z3-resume": ("trainer_callback_run.py", 2, ["--stage", "3", "--max-shard-size", "300KB",
                                                    "--resume-from", "cb-z3/run/checkpoint-4"]),
    # (Trainer refuses bf16=True on a CPU-only machine, so these train in fp32.)
    "cb-z2-last": ("trainer_callback_run.py", 2, ["--stage", "2", "--cb-dtype", "bf16", "--checkpoints", "last"]),
    "cb-z3-gather": ("trainer_callback_run.py", 2, ["--stage", "3", "--gather-on-save", "--final"]),
    # install_accelerate_hooks (tests/integrations/test_accelerate_hooks.py), launched by `accelerate launch`.
    **{name: ("accelerate_save.py", None, []) for name in ACCELERATE},
    # Seed 000: an mpu whose model-parallel axis holds replicas (sequence parallel).
    "replica-z2": ("ds_parallel_train.py", 2, ["--mode", "replica", "--stage", "2"]),
    "replica-z3": ("ds_parallel_train.py", 2, ["--mode", "replica", "--stage", "3"]),
    "replica-z2-dp2": ("ds_parallel_train.py", 4, ["--mode", "replica", "--stage", "2"]),
    # DeepSpeed AutoTP records universal_checkpoint_info (vocab 1001 split 501 + 500).
    "autotp-z1": ("ds_parallel_train.py", 2, ["--mode", "autotp", "--stage", "1"]),
    "autotp-z2": ("ds_parallel_train.py", 2, ["--mode", "autotp", "--stage", "2"]),
    # Seed 004: many data-parallel ranks; lexicographic file order differs from rank order.
    "z2-dp12": ("ds_train.py", 12, ["--stage", "2"]),
    "z3-dp12": ("ds_train.py", 12, ["--stage", "3"]),
    # DeepSpeed without ZeRO, its BF16_Optimizer, saves without frozen parameters, a plain nn.Module with
    # tied parameters and no HF config (tests/sources/deepspeed/test_deepspeed_configs.py).
    "z0-fp32": ("ds_configs_train.py", 2, ["--stage", "0"]),
    "z0-bf16": ("ds_configs_train.py", 2, ["--stage", "0", "--dtype", "bf16"]),
    "bf16opt-z1": ("ds_configs_train.py", 2, ["--stage", "1", "--dtype", "bf16", "--grad-accum", "fp32"]),
    "z2-exclude-frozen": ("ds_configs_train.py", 2, ["--stage", "2", "--frozen", "--exclude-frozen"]),
    **{f"z{s}-module-tied": ("ds_configs_train.py", 2, ["--stage", str(s), "--model", "module-tied"]) for s in (0, 2)},
    "replica-z0": ("ds_parallel_train.py", 2, ["--mode", "replica", "--stage", "0"]),
    "autotp-z0": ("ds_parallel_train.py", 2, ["--mode", "autotp", "--stage", "0"]),
    # Seed 001: a hand-split TP Llama under a custom mpu; nothing records the merge rules.
    "tp-z1": ("ds_tp_train.py", 2, ["--stage", "1"]),
    "tp-z2": ("ds_tp_train.py", 2, ["--stage", "2"]),
    # Seed 001 end to end: save (with/without the helper), ds_to_universal, resume at TP=1 / DP=1.
    "uc-tp-helper": ("ds_universal.py", 2, ["train", "--layout", "tp", "--info", "helper"]),
    "uc-tp-helper-resume": ("ds_universal.py", 1, ["resume", "--from", "uc-tp-helper"]),
    "uc-tp-naive": ("ds_universal.py", 2, ["train", "--layout", "tp", "--info", "naive"]),
    "uc-dp-helper": ("ds_universal.py", 2, ["train", "--layout", "dp", "--info", "helper"]),
    "uc-dp-helper-resume": ("ds_universal.py", 1, ["resume", "--from", "uc-dp-helper"]),
    # DeepSpeed PipelineModule saves in GPT-NeoX's layout (tests/sources/deepspeed/test_deepspeed_pipeline.py): 2 stages x TP 2
    # (parallel residual fp32, sequential bf16, fp32 without ZeRO) and 2 stages x DP 2, 4 ranks each.
    "pipe-tp2-fp32-par": ("ds_pipe_train.py", 4, ["--tp", "2", "--dtype", "fp32", "--residual", "parallel"]),
    "pipe-tp2-bf16-seq": ("ds_pipe_train.py", 4, ["--tp", "2", "--dtype", "bf16", "--residual", "sequential"]),
    "pipe-dp2-fp32-seq": ("ds_pipe_train.py", 4, ["--tp", "1", "--dtype", "fp32", "--residual", "sequential"]),
    "pipe-tp2-fp32-z0-par": ("ds_pipe_train.py", 4, ["--tp", "2", "--zero", "0", "--residual", "parallel"]),
    # Seed 001's shape resumed through hf-ckpt universal (tests/universal/test_pipeline_universal.py): 2 stages x TP 2
    # ZeRO-1 with the sequential residual (its function does not depend on the TP size) onto 1 rank.
    "pipe-tp2-fp32-seq": ("ds_pipe_train.py", 4, ["--tp", "2", "--dtype", "fp32", "--residual", "sequential"]),
    "ucw-pipe-tp2-seq-to1": ("ds_pipe_resume.py", 1, ["--from", "{case:pipe-tp2-fp32-seq}", "--pp", "1", "--tp", "1"]),
    # The Hub-layout family matrix (tests/convert/test_families.py): ZeRO-3 for every family, ZeRO-2 for an
    # MoE one, the Trainer callback and the live (Accelerate hook) save on an MoE one.
    **{f"fam-{f}-z3": ("family_train.py", 2, ["--family", f, "--stage", "3"])
       for f in ("llama", "gpt2", "t5", "bert", "mixtral", "qwen2_moe", "llava")},
    "fam-mixtral-z2": ("family_train.py", 2, ["--family", "mixtral", "--stage", "2"]),
    "fam-cb-qwen2_moe-z3": ("family_trainer_cb.py", 2, ["--family", "qwen2_moe", "--stage", "3"]),
    # bf16 ZeRO-2 Trainer + callback on a class that keeps its routers in fp32 (tests/convert/test_output_dtypes.py).
    "fam-cb-deepseek_v3-z2-bf16": ("family_trainer_cb.py", 2, ["--family", "deepseek_v3", "--stage", "2", "--bf16"]),
    # torch DCP under FSDP2 (tests/sources/dcp/test_dcp.py): plain fully_shard + dcp.save (vocab 1001 over 2 ranks),
    # Accelerate save_state, the Trainer's checkpoint-N.
    **{f"fsdp2-{m}": ("fsdp_train.py", 2, ["--mode", m]) for m in ("plain", "accelerate", "trainer")},
    # FSDP2 saved through torch's HuggingFaceStorageWriter (save_distributed: per-rank safetensors).
    "fsdp2-hf-writer": ("fsdp_hf_writer.py", 2, []),
    **{m: ("fsdp_train.py", 2, ["--mode", m]) for m in ("fsdp1", "fsdp1-flat")},  # FSDP1 SHARDED_STATE_DICT
    # Per-rank torch.save FSDP2 state dicts (tests/sources/fsdp/test_fsdp_rank_files.py): verl's checkpoint manager
    # (vocab 1001 on Shard(1)), and Accelerate's save_fsdp_model(use_dcp=False).
    "rank-verl": ("fsdp_rank_files.py", 2, ["--mode", "verl"]),
    "rank-accelerate": ("fsdp_rank_files.py", 2, ["--mode", "accelerate"]),
    "rank-accelerate-fsdp1": ("fsdp_rank_files.py", 2, ["--mode", "accelerate-fsdp1"]),  # ShardedTensor
    "rank-fsdp-tp": ("fsdp_rank_files.py", 4, ["--mode", "fsdp-tp"]),  # ("dp", "tp"): _StridedShard
    # FSDP1 LOCAL_STATE_DICT (tests/sources/fsdp/test_fsdp1_local.py): flat parameters, use_orig_params off and on.
    "rank-fsdp1-local": ("fsdp1_local.py", 2, []),
    # verl's LoRA actor: FSDP2 rank files of a PeftModel + lora_adapter/ (tests/sources/fsdp/test_verl_lora.py).
    "rank-verl-lora": ("verl_lora.py", 2, []),
    # DeepSpeed's "checkpoint_serialization": false: torch.save's legacy (non-zip) format.
    "z2-legacy": ("ds_legacy_save.py", 2, ["--stage", "2"]),
    # FSDP2 save-time: install_accelerate_hooks + save_model; the Trainer callback, then a resumed run.
    "fsdp2-accelerate-hooks": ("fsdp_savetime.py", 2, ["--mode", "accelerate-hooks"]),
    "fsdp2-trainer-cb": ("fsdp_savetime.py", 2, ["--mode", "trainer-cb"]),
    "fsdp2-trainer-cb-resume": ("fsdp_savetime.py", 2, ["--mode", "trainer-cb", "--resume-from",
                                                        "fsdp2-trainer-cb/run/checkpoint-2"]),
    # PEFT LoRA under the Trainer + callback + accelerator.save_model (tests/peft/test_peft.py).
    "peft-z3": ("peft_trainer_run.py", 2, ["--stage", "3", "--nccl-rules"]),
    "peft-z3-gather": ("peft_trainer_run.py", 2, ["--stage", "3", "--gather-on-save", "--adapter-name", "mine"]),
    "peft-z2": ("peft_trainer_run.py", 2, ["--stage", "2", "--modules-to-save", "--rslora"]),
    # ZeRO-2 round_robin_gradients (tests/sources/deepspeed/test_round_robin_layout.py): 2 and 3 ranks reorder the flat group.
    **{f"z2-round-robin-dp{n}": ("ds_round_robin.py", n, ["--dtype", "bf16"]) for n in (2, 3)},
    # DeepSpeed MoE, 4 experts x 2 layers over ep_size 2 on 4 ranks (tests/sources/deepspeed/test_moe_experts.py), in
    # DeepSpeed's two rank orders of expert groups (the default E + D, and D + E).
    "moe-z2-ep2": ("ds_moe_train.py", 4, ["--stage", "2", "--dtype", "bf16"]),
    "moe-z1-ep2-dxe": ("ds_moe_train.py", 4, ["--stage", "1", "--data-before-expert"]),
    # DeepSpeed AutoEP on a tiny Mixtral, 2 experts x 2 layers over autoep_size 2 on 2 ranks (tests/sources/deepspeed/test_autoep.py).
    "autoep-z1": ("ds_autoep_train.py", 2, ["--stage", "1"]),
    "autoep-z2-bf16": ("ds_autoep_train.py", 2, ["--stage", "2", "--dtype", "bf16"]),
    # Megatron-Core 0.16.1 GPTModel saves (tests/sources/megatron/test_megatron.py): one 4-rank launch writes every layout
    # (TP 2, PP 2, TP 2 x PP 2, DP 4, tied, Qwen2 q/k/v biases, GPT MHA/MQA, PP 2 x VPP 2; DP 4 and TP 2 also with the
    # distributed optimizer) in both formats (torch_dist and legacy mp_rank_*), ~60 s.
    "megatron": ("megatron_train.py", 4, []),

    # hf-ckpt universal, resumed under DeepSpeed's load_universal at another layout ("-to1": 1 rank...)
    # beside the same save resumed at its own layout ("-own"); "{case:X}" is case X's directory.
    **{f"ucw-{src}-{to}": ("ds_uc_resume.py", n, ["--from", f"{{case:{src}}}", "--load", load, *extra])
       for src, extra in (("replica-z2", ["--layout", "replica", "--stage", "2"]),
                          ("tp-z1", ["--layout", "tp", "--stage", "1", "--vocab", "1002",
                                     "--tp-rule", "model.embed_tokens.weight=0"]))
       for to, n, load in (("own", 2, "own"), ("to1", 1, "universal"))},
    **{f"ucw-replica-z3-{to}": ("ds_uc_resume.py", n, ["--from", "{case:replica-z3}", "--load", load, "--layout",
                                                        "replica", "--stage", "3"])
       for to, n, load in (("own", 2, "own"), ("to1", 1, "universal"))},
    # AutoTP (recorded universal_checkpoint_info, a 1001-row lm_head split 501 + 500) onto TP 1; its batches
    # are those of one data-parallel rank, as for a replica axis.
    "ucw-autotp-z1-to1": ("ds_uc_resume.py", 1, ["--from", "{case:autotp-z1}", "--load", "universal", "--layout",
                                                  "replica", "--stage", "1"]),
    # 12 data-parallel ranks onto 2 and 1 (its own layout, 12 processes, is too slow to rerun in CI).
    **{f"ucw-z2-dp12-to{n}": ("ds_uc_resume.py", n, ["--from", "{case:z2-dp12}", "--load", "universal", "--layout",
                                                     "plain", "--stage", "2", "--saved-dp", "12"]) for n in (1, 2)},
    # ZeRO-3 saved on 2 ranks onto 3 (every parameter cut anew, unevenly): both runs take the same 6 rows a
    # step (the saving run's 4 do not split in 3); bf16 ZeRO-2 and BF16_Optimizer (bf16, ZeRO-1, fp32
    # accumulation) onto 1 rank.
    **{f"ucw-{src}-{to}": ("ds_uc_resume.py", n, ["--from", f"{{case:{src}}}", "--load", load, "--layout", "plain",
                                                   "--saved-dp", "2", *extra])
       for src, m, extra in (("z3-fp32", 3, ["--stage", "3", "--rows", "6"]),
                             ("z2-bf16", 1, ["--stage", "2", "--dtype", "bf16"]),
                             ("bf16opt-z1", 1, ["--stage", "1", "--dtype", "bf16", "--grad-accum", "fp32"]))
       for to, n, load in (("own", 2, "own"), (f"to{m}", m, "universal"))},
    # DeepSpeed 0.14.4's replica-mpu ZeRO-2 save (a committed fixture, 2 replicas x 2 data-parallel ranks) onto
    # 1 and 2 ranks under the installed DeepSpeed (no 0.14.4 here to resume it at its own layout).
    **{f"ucw-ds0.14.4-replica-to{n}": ("ds_uc_resume.py", n, [
        "--from", str(REPO / "tests" / "fixtures" / "deepspeed" / "0.14.4" / "zero2-replica"), "--config",
        str(REPO / "tests" / "fixtures" / "deepspeed" / "0.14.4" / "zero2-replica"), "--load", "universal",
        "--layout", "plain", "--stage", "2", "--saved-dp", "2"]) for n in (1, 2)},
}
CASE_REF = re.compile(r"^\{case:([\w.-]+)\}$")  # an argument naming another case's directory


def _cache_key(script: str) -> str:
    """Package versions + the case's engine script + the shared module: editing one script
    rebuilds only the cases that run it."""
    h = hashlib.sha256()
    for pkg in ("torch", "deepspeed", "transformers", "accelerate", "safetensors"):
        try:
            h.update(f"{pkg}={md.version(pkg)};".encode())
        except md.PackageNotFoundError:
            h.update(f"{pkg}=none;".encode())
    paths = [ENGINES / script, ENGINES / "common.py"]
    if "import families" in (ENGINES / script).read_text():
        paths.append(ENGINES / "families.py")
    for shared in ("fsdp_train", "ds_train", "ds_pipe_train", "ds_uc_resume"):  # a script that runs another's code is keyed by it too
        if f"import {shared}" in (ENGINES / script).read_text():
            paths.append(ENGINES / f"{shared}.py")
    if script.startswith("megatron"):  # keyed here only, so adding it rebuilt no other case
        try:
            h.update(f"megatron-core={md.version('megatron-core')};".encode())
        except md.PackageNotFoundError:
            h.update(b"megatron-core=none;")
    if any(CASES[name][0] == script for name in ACCELERATE):
        paths += sorted(ACCELERATE_CONFIGS.iterdir())
    for refs in sorted({m.group(1) for s, _, a in CASES.values() if s == script for x in a
                        for m in [CASE_REF.match(str(x))] if m}):
        h.update(_cache_key(CASES[refs][0]).encode())  # a case built from another case's output
    if "nccl_rules" in (ENGINES / script).read_text():  # saves again under NCCL's rules (issue 35)
        paths.append(REPO / "tests" / "support" / "nccl_rules.py")
    if "hf_ckpt_integrations" in (ENGINES / script).read_text():
        # The run itself calls the package (save-time hooks): its code is part of the result.
        paths += sorted((REPO / "hf_ckpt_integrations").rglob("*.py"))
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    return Path(os.environ.get("HFCKPT_TEST_CACHE", REPO / ".test-cache")) / "engines"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(script, nproc, args, *, log, timeout=ENGINE_TIMEOUT_S, env=None, accelerate_config=None):
    """Run ``script`` under torchrun on CPU (or ``accelerate launch --config_file accelerate_config``,
    which itself runs torchrun); raise with the log tail when it fails."""
    refuse_engine_launch(f"{script} on {nproc} ranks")
    if accelerate_config:
        # A free port: accelerate launch would otherwise rendezvous on 29500, shared with any
        # other launch on this machine (torchrun --standalone picks its own).
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(accelerate_config),
               "--main_process_port", str(_free_port())]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(script), *map(str, args)]
    # The engine scripts that call the package must import this checkout's (the shared venv's editable
    # install points at one checkout only).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **(env or {})}
    with open(log, "w") as fh:  # a file, not a pipe: torchrun's workers may outlive it
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=REPO)
        if not wait_or_stop(proc, timeout):
            raise RuntimeError(f"{' '.join(cmd)} ran past {timeout} s; log {log}:\n"
                               f"{Path(log).read_text(errors='replace')[-4000:]}")
    if proc.returncode != 0:
        tail = Path(log).read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(cmd)} failed with {proc.returncode}; log {log}:\n{tail}")


_FAILED = {}  # name -> error: a case that failed is not run again in the same session


def build_case(name: str) -> Path:
    script, nproc, args = CASES[name]
    args = [str(build_case(m.group(1))) if m else a for a in args for m in [CASE_REF.match(str(a))]]
    out = cache_root() / _cache_key(script) / name  # cases of one script share a parent (see cb-z3-resume)
    refuse_engine_launch(f"engine case {name}")  # even a cached one: the fast suite needs no engine run
    if (out / "DONE").exists():
        return out
    # Two test runs sharing one cache (HFCKPT_TEST_CACHE; git worktrees) must not build one case in
    # the same .building directory at once: the second waits and takes the first one's result.
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build_case_locked(name, script, nproc, args, out)


def _build_case_locked(name, script, nproc, args, out) -> Path:
    if (out / "DONE").exists():
        return out
    if name in _FAILED:  # a silent retry by the next test would hide a flaky engine run
        raise RuntimeError(f"engine case {name} failed earlier in this session: {_FAILED[name]}")
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = ACCELERATE_CONFIGS / ACCELERATE[name] if name in ACCELERATE else None
    log = tmp.parent / f"{out.name}.log"
    try:
        torchrun(ENGINES / script, nproc, [tmp, *args], log=log, accelerate_config=config)
    except RuntimeError as e:
        kept = log.with_name(f"{out.name}.failed-{int(time.time())}.log")  # the next build overwrites log
        shutil.copy(log, kept)
        _FAILED[name] = f"{str(e).splitlines()[0]} (log kept: {kept})"
        raise
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@pytest.fixture(scope="session")
def engine_ckpt():
    """``engine_ckpt(name) -> Path`` of a cached engine run (see ``CASES``)."""
    return build_case


COMMITTED = REPO / "tests" / "fixtures" / "deepspeed"


@pytest.fixture
def committed_zero2(tmp_path):
    """A private copy (tests damage it) of a committed 2-rank ZeRO-2 checkpoint written by a real
    DeepSpeed (tests/fixtures/deepspeed/0.18.9/zero2): ``work/ckpt`` (tag ``global_step2``) beside
    ``work/config.json``; returns ``work``. The guards that only read a checkpoint run on it with
    no engine run."""
    work = tmp_path / "work"
    shutil.copytree(COMMITTED / "0.18.9" / "zero2", work)
    return work


# A private copy of the ZeRO-2 engine case, in two layouts (tests damage them).
@pytest.fixture
def z2(engine_ckpt, tmp_path):
    """A private copy of the ZeRO-2 case (tests may damage it)."""
    case = engine_ckpt("z2-fp32")
    src = tmp_path / "src"
    shutil.copytree(case / "ckpt", src)
    return src, case / "config"


@pytest.fixture
def z2_trainer(engine_ckpt, tmp_path):
    """A private copy of the ZeRO-2 case with its config.json beside it (a Trainer-like layout)."""
    case = engine_ckpt("z2-fp32")
    src = tmp_path / "work" / "src"
    shutil.copytree(case / "ckpt", src)
    shutil.copy(case / "config" / "config.json", src / "config.json")
    return src


@pytest.fixture(scope="module")
def tiny_llama_sd(tmp_path_factory):
    """``(config dir, {name: tensor})`` of a tiny tied Llama (tests/support/dcp_build.py), the tied
    ``lm_head.weight`` under its own name as FSDP state dicts hold it: the tests lay it out as the
    synthetic DCP sources they need (no engine)."""
    from dcp_build import tiny_llama

    root = tmp_path_factory.mktemp("tiny-llama")
    return root / "config", tiny_llama(root / "config")


SECRET = "BEGIN-PRIVATE-KEY-do-not-share-4f1c"


@pytest.fixture
def secret(tmp_path):
    p = tmp_path / "id_rsa"
    p.write_text(SECRET + "\n")
    return p


def pytest_collection_modifyitems(config, items):
    """A test that gets an engine run through a fixture is an engine test (marked here, so that
    ``-m "not engine"`` is the fast suite without each file having to remember the marker)."""
    for item in items:
        if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.engine)


def pytest_report_header(config):
    return f"engine checkpoint cache: {cache_root()}"

# The engine scripts' shared module (tiny configs, the probe input) is importable by tests too.
sys.path.insert(0, str(ENGINES))
sys.path.insert(0, str(Path(__file__).resolve().parent))
