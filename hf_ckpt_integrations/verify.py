"""Compare an exported HF directory against its source, tensor by tensor, bitwise.

Both sides are re-read: the HF side through its safetensors headers (plain JSON) and byte
ranges, the source side through a fresh plan, cast to each file tensor's dtype.
"""

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from .assemble import check_module_copy, iter_bytes
from .errors import short_repr
from .guards import StrPath, open_regular
from .formats.dtypes import SIZES as DTYPE_SIZES
from .formats.names import (ADAPTER_BIN_NAME, ADAPTER_SAFETENSORS_NAME, BIN_INDEX, BIN_NAME, CONFIG_NAME,
                            SAFETENSORS_INDEX, SAFETENSORS_NAME)
from .formats.safetensors import read_hf_dir  # re-exported: what verify reads the export with
from .mapped_files import MappedFiles

if TYPE_CHECKING:
    from .plan import ExportPlan

__all__ = ["VerifyReport", "read_hf_dir", "loaded_weights", "verify_plan"]


@dataclass
class VerifyReport:
    """``ok`` is true when every tensor matches; ``differences`` names each one that does not."""

    checked: int = 0
    differences: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def loaded_weights(dst: StrPath, *, adapter: bool = False) -> Tuple[Optional[str], List[str]]:
    """``(name, problems)``: the weight file of the HF directory ``dst`` that ``from_pretrained(dst)``
    loads (None: none there), following its precedence (transformers ``_get_resolved_checkpoint_files``:
    config.json's ``transformers_weights``, then ``model.safetensors``, ``model.safetensors.index.json``,
    ``pytorch_model.bin``, ``pytorch_model.bin.index.json``; a PEFT adapter directory:
    ``adapter_model.safetensors``, then ``adapter_model.bin``), and why ``dst`` is not what
    ``hf-ckpt export`` writes: several of those entry points at once (a stray ``model.safetensors``
    beside a sharded export is what loads, whatever the index says), or a file hf-ckpt never writes."""
    import json

    order = (ADAPTER_SAFETENSORS_NAME, ADAPTER_BIN_NAME) if adapter else (SAFETENSORS_NAME, SAFETENSORS_INDEX,
                                                                         BIN_NAME, BIN_INDEX)
    present = [n for n in order if os.path.isfile(os.path.join(dst, n))]
    chosen = present[0] if present else None
    problems: List[str] = []
    if not adapter:
        explicit = None
        try:
            if os.path.lexists(os.path.join(dst, CONFIG_NAME)):  # (a FIFO there is refused, never waited on)
                with open_regular(os.path.join(dst, CONFIG_NAME), root=dst, what=CONFIG_NAME) as fh:
                    cfg = json.loads(fh.read(2**20))
                explicit = cfg.get("transformers_weights") if isinstance(cfg, dict) else None
        except (OSError, ValueError, RecursionError):
            pass  # no readable config.json: from_pretrained reads none either, the default order holds
        if explicit is not None:
            ok = isinstance(explicit, str) and explicit.endswith((".safetensors", ".safetensors.index.json")) and \
                os.path.basename(explicit) == explicit and explicit not in (".", "..")
            if not ok or not os.path.isfile(os.path.join(dst, explicit)):
                problems.append(f"{os.path.join(dst, CONFIG_NAME)}: transformers_weights = {short_repr(explicit)} "
                                "names no safetensors file of this directory: from_pretrained fails to load it; "
                                "remove the key (hf-ckpt export never writes it) or export again")
                return None, problems
            chosen = explicit
    if len(present) > 1:
        problems.append(f"{dst}: holds {' and '.join(present)}; from_pretrained loads {chosen} and ignores the "
                        "others, while hf-ckpt export writes one of them only: remove the stray files (or export "
                        "again into a fresh directory)")
    if chosen is not None and not chosen.endswith((".safetensors", ".safetensors.index.json")):
        problems.append(f"{os.path.join(dst, chosen)}: from_pretrained loads this pickle file, which hf-ckpt export "
                        "never writes: export again into a fresh directory")
        return None, problems
    return chosen, problems


def verify_plan(plan: "ExportPlan", dst: StrPath, *, quiet: bool = True) -> VerifyReport:
    """Check that ``dst`` holds exactly the tensors of ``plan``, bitwise: the weights ``from_pretrained``
    (or, for an adapter, peft) would load from it (:func:`loaded_weights`), and nothing else beside them.
    Not ``quiet``: a byte progress bar on stderr when it is a terminal."""
    from .writer import progress_bar

    report = VerifyReport()
    weights, problems = loaded_weights(dst, adapter=plan.adapter is not None)
    report.differences.extend(problems)
    if weights is None and problems:
        return report
    have = read_hf_dir(dst, weights=weights)
    expected = {t.name: t for t in plan.tensors}
    for alias, target in plan.aliases.items():
        if alias in have and target in expected:
            expected[alias] = expected[target]
    for name in sorted(set(expected) - set(have)):
        report.differences.append(f"{name}: missing from {dst}")
    for name in sorted(set(have) - set(expected)):
        report.differences.append(f"{name}: in {dst} but not in the source")
    _check_source_crc(plan, report)
    names = [t for t in expected if t in have]
    with MappedFiles() as files, progress_bar(sum(have[n][4] for n in names), f"verifying {dst}", quiet) as bar:
        for name in names:
            t = expected[name]
            path, dtype, shape, off, nbytes = have[name]
            bar.update(nbytes)
            report.checked += 1
            if tuple(shape) != tuple(t.shape):
                report.differences.append(f"{name}: shape {list(shape)} != source {list(t.shape)}")
                continue
            if not check_module_copy(t, files):
                report.differences.append(f"{name}: the source's fp32 masters, cast to the module weights' "
                                          "dtype, differ from the module weights it also holds (a rank file "
                                          "out of place, or damaged)")
            if dtype not in DTYPE_SIZES:
                report.differences.append(f"{name}: unknown dtype {dtype}")
                continue
            got = files.read(path, off, nbytes)
            pos = 0
            for chunk in iter_bytes(t, dtype, files):
                if got[pos:pos + len(chunk)] != chunk:
                    report.differences.append(f"{name}: values differ from the source")
                    break
                pos += len(chunk)
            else:
                if pos != nbytes:
                    report.differences.append(f"{name}: {nbytes} bytes in {dst}, {pos} in the source")
    return report


def _check_source_crc(plan: "ExportPlan", report: VerifyReport) -> None:
    """CRC-32 of every archive the plan reads (partitions, module weights, DCP chunks), against the
    checksum torch recorded when it saved it (:func:`~.sources.registry.integrity_problems`): a
    flipped bit in a partition is a difference."""
    from .sources.registry import integrity_problems

    ranges: Dict[str, List[Tuple[int, int]]] = {}
    for t in plan.tensors:
        parts = list(t.parts) + list(t.replicas) + (list(t.module_check[0]) + list(t.module_check[1])
                                                    if t.module_check else []) + \
            [list(c.pieces) for _, chunks in t.tied_copies for c in chunks]
        for p in (p for part in parts for p in part):
            got = ranges.setdefault(p.path, [])
            n = p.numel * DTYPE_SIZES[p.dtype]
            if got and got[-1][0] + got[-1][1] == p.offset:  # adjacent (ZeRO-3: a rank's partitions in order)
                got[-1] = (got[-1][0], got[-1][1] + n)
            else:
                got.append((p.offset, n))
    problems = integrity_problems(ranges)
    for path in sorted(problems):
        report.differences.extend(problems[path])
