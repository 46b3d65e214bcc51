"""Compare an exported HF directory against its source, tensor by tensor, bitwise.

Both sides are re-read: the HF side through its safetensors headers (plain JSON) and byte
ranges, the source side through a fresh plan, cast to each file tensor's dtype.
"""

import json
import os
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .assemble import check_module_copy, iter_bytes
from .errors import CheckpointError
from .safe_load import DTYPE_SIZES, MappedFiles

__all__ = ["VerifyReport", "read_hf_dir", "verify_plan"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass
class VerifyReport:
    """``ok`` is true when every tensor matches; ``differences`` names each one that does not."""

    checked: int = 0
    differences: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences


def _read_header(path) -> Dict[str, Tuple[str, Tuple[int, ...], int, int]]:
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (too short); export it again")
            n = struct.unpack("<Q", raw)[0]
            size = os.fstat(fh.fileno()).st_size
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError(f"{path}: corrupt safetensors header; export it again")
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e}); export it again") from e
    out = {}
    base = 8 + n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if base + end > size:
            raise CheckpointError(f"{path}: truncated (tensor {name} runs past the end); export it again")
        out[name] = (info["dtype"], tuple(info["shape"]), base + start, end - start)
    return out


def read_hf_dir(path) -> Dict[str, Tuple[str, str, Tuple[int, ...], int, int]]:
    """name -> (file, dtype, shape, byte offset, nbytes) for every tensor of an HF directory."""
    path = os.fspath(path)
    index = os.path.join(path, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e}); export it again") from e
    elif os.path.isfile(os.path.join(path, SINGLE_NAME)):
        files = [SINGLE_NAME]
    else:
        raise CheckpointError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME}; pass the directory `hf-ckpt export` "
                              "wrote")
    out = {}
    for f in files:
        full = os.path.join(path, f)
        for name, (dtype, shape, off, nbytes) in _read_header(full).items():
            out[name] = (full, dtype, shape, off, nbytes)
    return out


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
