"""`make demo`: train under DeepSpeed ZeRO-3 with the HF Trainer, then export, verify and reload.

The training run is the same engine script the test matrix uses (tests/engines/trainer_train.py):
a tiny Llama, 2 CPU processes, ZeRO-3 with ``stage3_gather_16bit_weights_on_model_save=false``,
so the Trainer's ``checkpoint-N/`` holds no loadable weights at all — only ZeRO partitions.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "engines"))


def sh(*cmd, **kw):
    return subprocess.run([str(c) for c in cmd], text=True, capture_output=True, cwd=REPO, **kw)


class Steps:
    """The demo's progress: a tqdm bar on a terminal; off one (a log, CI, `make demo | tee`), one plain
    line per step as it starts, so a minute of training never looks like a hang."""

    def __init__(self, total, *, tty=None, echo=print):
        self.total, self.n, self.echo = total, 0, echo
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.bar = tqdm(total=total, desc="demo", unit="step") if self.tty else None

    def start(self, label):
        if self.bar is not None:
            self.bar.set_postfix_str(label)
        else:
            self.echo(f"[{self.n + 1}/{self.total}] {label} ...")

    def done(self):
        self.n += 1
        if self.bar is not None:
            self.bar.update()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def dir_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def main():
    work = Path(os.environ.get("DEMO_DIR") or tempfile.mkdtemp(prefix="hf-ckpt-demo-"))
    ckpt = work / "run" / "checkpoint-4"
    out = work / "exported"
    steps = Steps(5, echo=lambda line: print(line, flush=True))
    started = time.perf_counter()

    steps.start("train a tiny Llama with the HF Trainer under DeepSpeed ZeRO-3 (2 CPU processes; ~1 min)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    r = sh(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           REPO / "tests/engines/trainer_train.py", work, "--stage", "3", env=env)
    if r.returncode:
        sys.exit(f"training failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    steps.done()
    print(f"\nTrainer wrote {ckpt} (no model.safetensors: {not (ckpt / 'model.safetensors').exists()})")

    hf_ckpt = [sys.executable, "-m", "hf_ckpt_integrations"]
    for label, args in [("inspect", ["inspect", ckpt]),
                        ("export", ["export", ckpt, out, "--overwrite"]),
                        ("verify", ["verify", out, "--against", ckpt])]:
        steps.start(f"hf-ckpt {label}")
        r = sh(*hf_ckpt, *args)
        print(f"\n$ hf-ckpt {' '.join(str(a) for a in args)}\n{r.stdout}{r.stderr}", end="")
        if r.returncode:
            sys.exit(f"hf-ckpt {label} failed with exit {r.returncode}")
        steps.done()

    steps.start("from_pretrained + generate")
    import torch
    from transformers import AutoModelForCausalLM

    from common import probe_input

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(input_ids=probe_input()).logits
    engine_logits = torch.load(work / "reference" / "checkpoint-4" / "logits.pt")
    diff = (logits - engine_logits).abs().max().item()
    generated = model.generate(probe_input()[:1, :4], max_new_tokens=6, do_sample=False)
    steps.done()
    steps.close()

    rows = [("DeepSpeed checkpoint (global_step4/)", f"{dir_bytes(ckpt / 'global_step4'):,} bytes"),
            ("exported HF directory", f"{dir_bytes(out):,} bytes"),
            ("max |logit difference| engine vs reloaded", f"{diff:.3g}"),
            ("greedy tokens from the reloaded model", " ".join(map(str, generated[0].tolist()))),
            ("wall time", f"{time.perf_counter() - started:.0f} s")]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    print(f"\n(files kept in {work})")
    if diff != 0.0:
        sys.exit("the reloaded model's logits differ from the engine's")


if __name__ == "__main__":
    main()
