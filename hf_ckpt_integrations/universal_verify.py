"""``hf-ckpt verify DST --against SRC`` where DST is a universal checkpoint (:mod:`.universal_writer`
writes it): every state file re-read by the restricted unpickler and compared, bitwise, with the
source's state merged afresh by the same plan."""

import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .errors import CheckpointError
from .guards import StrPath
from .formats.torch_files import TensorRef
from .mapped_files import MappedFiles
from .universal_writer import ZERO_DIR, plan_universal

if TYPE_CHECKING:
    from .verify import VerifyReport

__all__ = ["verify_universal"]


def verify_universal(dst: StrPath, against: StrPath, *, tag: Optional[str] = None, config: Optional[str] = None,
                     tp_rules: Optional[Sequence[str]] = None, quiet: bool = True) -> "VerifyReport":
    """Compare the universal checkpoint ``dst`` with the DeepSpeed save ``against``, state by state:
    every ``zero/<param>/<state>.pt`` tensor bitwise the source's state merged afresh by the plan,
    every ``step.pt`` the stored step, no parameter or state missing or extra. ``dst``'s files are
    read by the same restricted unpickler as any source (never ``torch.load``). Returns a
    :class:`~.verify.VerifyReport` (``checked`` counts state files)."""
    from .assemble import torch_tensor
    from .sources.deepspeed.allowlist import load
    from .verify import VerifyReport

    dst = os.path.abspath(os.fspath(dst))
    plan, states, _ = plan_universal(against, tag=tag, config=config, tp_rules=tp_rules)
    report = VerifyReport()
    zero = os.path.join(dst, ZERO_DIR)
    if not os.path.isdir(zero):
        raise CheckpointError(f"{dst}: no zero/ directory; not a universal checkpoint")
    expected = {t.name for t in plan.tensors if t.kind != "buffer"}
    present = {n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))}
    report.differences += [f"{n}: missing from {zero}" for n in sorted(expected - present)]
    report.differences += [f"{n}: in {zero} but not a parameter of the source" for n in sorted(present - expected)]

    def stored(path: str) -> Any:  # what the state file holds, unpickled
        if not os.path.isfile(path):
            return None
        obj = load(path)
        return obj.get("param") if isinstance(obj, dict) else obj

    from .writer import progress_bar

    with MappedFiles() as files, progress_bar(len(plan.tensors), f"verifying {dst}", quiet, unit="tensor") as bar:
        for t in plan.tensors:
            bar.update()
            if t.kind == "buffer" or t.name not in present:
                continue
            folder = os.path.join(zero, t.name)
            trained = states.has_states(t)
            wanted = [("fp32", t)] + ([(n, states.state_plan(t, n)) for n in states.tensor_names] if trained else [])
            names = {n[:-3] for n in os.listdir(folder) if n.endswith(".pt")}
            want_names = {n for n, _ in wanted} | (set(states.scalar_names) if trained else set())
            for extra in sorted(names - want_names):
                report.differences.append(f"{t.name}/{extra}.pt: not a state the source holds")
            for name, tp in wanted:
                report.checked += 1
                ref = stored(os.path.join(folder, f"{name}.pt"))
                want = torch_tensor(tp, files)
                if name == "fp32":
                    want = want.float()
                if not isinstance(ref, TensorRef) or ref.shape != tuple(want.shape) or ref.dtype != "F32" or \
                        bytes(files.read(ref.path, *ref.byte_range())) != want.contiguous().view(-1).numpy().tobytes():
                    report.differences.append(f"{t.name}/{name}.pt: differs from the source's {name}")
            for name in states.scalar_names if trained else ():
                report.checked += 1
                got, want = stored(os.path.join(folder, f"{name}.pt")), states.scalar(t, name)
                same = (isinstance(got, TensorRef) and isinstance(want, TensorRef) and got.shape == want.shape and
                        bytes(files.read(got.path, *got.byte_range())) == bytes(files.read(want.path, *want.byte_range()))
                        ) or (not isinstance(want, TensorRef) and got == want)
                if not same:
                    report.differences.append(f"{t.name}/{name}.pt: differs from the source's {name}")
    return report

