"""Compare an exported HF directory against its source, tensor by tensor, bitwise.

Both sides are re-read: the HF side through its safetensors headers (plain JSON) and byte
ranges, the source side through a fresh plan, cast to each file tensor's dtype.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .assemble import check_module_copy, iter_bytes
from .formats.dtypes import SIZES as DTYPE_SIZES
from .formats.safetensors import read_hf_dir  # re-exported: what verify reads the export with
from .mapped_files import MappedFiles

__all__ = ["VerifyReport", "read_hf_dir", "verify_plan"]


@dataclass
class VerifyReport:
    """``ok`` is true when every tensor matches; ``differences`` names each one that does not."""

    checked: int = 0
    differences: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def verify_plan(plan, dst) -> VerifyReport:
    """Check that ``dst`` holds exactly the tensors of ``plan``, bitwise."""
    have = read_hf_dir(dst)
    report = VerifyReport()
    expected = {t.name: t for t in plan.tensors}
    for alias, target in plan.aliases.items():
        if alias in have and target in expected:
            expected[alias] = expected[target]
    for name in sorted(set(expected) - set(have)):
        report.differences.append(f"{name}: missing from {dst}")
    for name in sorted(set(have) - set(expected)):
        report.differences.append(f"{name}: in {dst} but not in the source")
    _check_source_crc(plan, report)
    with MappedFiles() as files:
        for name in [t for t in expected if t in have]:
            t = expected[name]
            path, dtype, shape, off, nbytes = have[name]
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


def _check_source_crc(plan, report) -> None:
    """CRC-32 of every zip entry of the source the plan reads (partitions, module weights), against
    the checksum the zip recorded when torch saved it: a flipped bit in a partition is a difference."""
    import zipfile

    from .formats.torch_files import check_crc

    ranges: Dict[str, List[Tuple[int, int]]] = {}
    for t in plan.tensors:
        parts = list(t.parts) + list(t.replicas) + (list(t.module_check[0]) + list(t.module_check[1])
                                                    if t.module_check else [])
        for p in (p for part in parts for p in part):
            ranges.setdefault(p.path, []).append((p.offset, p.numel * DTYPE_SIZES[p.dtype]))
    for path in sorted(ranges):
        if zipfile.is_zipfile(path):
            for entry in check_crc(path, ranges[path]):
                report.differences.append(f"{path}: entry {entry} fails its CRC-32 check (the checksum torch "
                                          "wrote with it): the source file is damaged, copy it again")
