"""The one dtype table: safetensors names (``F32``, ``BF16``...) and what each is called elsewhere.

A dtype is carried through the package by its safetensors name (what a safetensors header
records). This module maps it to its element size, to the names users pass (``fp32``, ``bf16``,
``fp16``), to torch's names (``torch.bfloat16``, the storage classes ``torch.save`` pickles), to
numpy, and to the value ``config.json`` records (``"bfloat16"``). torch is imported only by
:func:`to_torch`.
"""

from typing import TYPE_CHECKING, Optional

from ..errors import OptionError

if TYPE_CHECKING:
    import torch

__all__ = ["SIZES", "FLOATS", "MAX_NDIM", "TORCH_NAMES", "STORAGE_CLASSES", "USER_NAMES", "CONFIG_NAMES",
           "NUMPY_BITS",
           "itemsize", "is_float", "from_user", "to_user", "from_torch", "to_torch", "config_name",
           "training_dtype"]

# safetensors name -> bytes per element (safetensors' own ``Dtype::size``), for the dtypes read here.
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
FLOATS = frozenset({"F64", "F32", "F16", "BF16"})
# The most dimensions a tensor may have (torch's own limit): a shape read from any file is refused beyond it.
MAX_NDIM = 64
# safetensors name -> torch dtype name (``torch.<name>``; also the pickled ``torch.<name>`` global).
TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
# Storage classes a ``torch.save`` pickle names (legacy typed storages) -> safetensors name.
STORAGE_CLASSES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL", "UntypedStorage": "U8",
}
# What users pass (``--dtype``, ``dtype=``): the short name first (what :func:`to_user` gives back).
USER_NAMES = {"fp32": "F32", "float32": "F32", "float": "F32", "bf16": "BF16", "bfloat16": "BF16", "fp16": "F16",
              "float16": "F16", "half": "F16"}
# The value ``config.json`` records (``dtype`` / ``torch_dtype``), as ``save_pretrained`` writes it.
CONFIG_NAMES = {d: TORCH_NAMES[d] for d in ("F64", "F32", "F16", "BF16")}
# The unsigned integer type of the same width, which the torch-free casts do bit operations on.
NUMPY_BITS = {"F32": "uint32", "BF16": "uint16", "F16": "uint16"}

_FROM_TORCH = {v: k for k, v in TORCH_NAMES.items()}
_TO_USER: dict[Optional[str], str] = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}


def itemsize(dtype: str) -> int:
    """Bytes per element of the safetensors dtype ``dtype`` (KeyError for one not listed)."""
    return SIZES[dtype]


def is_float(dtype: str) -> bool:
    return dtype in FLOATS


def from_user(name: Optional[str]) -> Optional[str]:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or ``float32``, ``bfloat16``, ``half``...) as a safetensors
    name; None stays None. Raises :class:`~..errors.OptionError` for anything else."""
    if name is None:
        return None
    try:
        return USER_NAMES[name.lower()]
    except (KeyError, AttributeError):
        raise OptionError(f"unknown dtype {str(name)[:40]!r}; use one of fp32, bf16, fp16 (or torch's float32, "
                          "bfloat16, float16, half)") from None


def to_user(dtype: Optional[str]) -> Optional[str]:
    """The user name (``"bf16"``) of a safetensors floating dtype; None for any other."""
    return _TO_USER.get(dtype)


def from_torch(torch_dtype: "torch.dtype | str") -> str:
    """The safetensors name of a ``torch.dtype`` (or its ``str``: ``"torch.bfloat16"``). Raises
    ``ValueError`` for a dtype safetensors cannot store here (complex, float8...)."""
    name = str(torch_dtype).replace("torch.", "")
    try:
        return _FROM_TORCH[name]
    except KeyError:
        raise ValueError(f"tensor dtype {torch_dtype} has no safetensors name; convert it before saving") from None


def to_torch(dtype: str) -> "torch.dtype":
    """The ``torch.dtype`` of the safetensors name ``dtype`` (imports torch)."""
    import torch

    return getattr(torch, TORCH_NAMES[dtype])


def config_name(dtype: str) -> Optional[str]:
    """What ``config.json`` records for tensors of floating dtype ``dtype`` (``"bfloat16"``)."""
    return CONFIG_NAMES.get(dtype)


def training_dtype(model: "Optional[torch.nn.Module]") -> Optional[str]:
    """``"fp32"``/``"bf16"``/``"fp16"``: the one dtype of ``model``'s floating parameters (ZeRO-3
    keeps it on the partitioned parameters too); None when mixed, another dtype, or no model."""
    if model is None:
        return None
    seen = {str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()}
    return to_user(_FROM_TORCH.get(seen.pop())) if len(seen) == 1 else None
