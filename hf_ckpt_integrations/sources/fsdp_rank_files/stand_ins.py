"""The classes a per-rank FSDP state dict pickles (DTensor, DeviceMesh, placements, FSDP1's
ShardedTensor), rebuilt as inert stand-ins: :data:`ALLOWED` is the source's allowlist for the
restricted unpickler. Nothing from a file is called; torch.distributed is never imported."""

from typing import Any, Callable, Dict, Iterable, Type

from ...errors import CheckpointError, UnsafeCheckpointError, short_repr
from ...formats import torch_files
from ...formats.unpickler import StandIn
from .. import dcp

# torch's layout and memory-format names, rebuilt as the DCP source's metadata rebuilds them
_layout = dcp.ALLOWED["torch.serialization"]["_get_layout"]
_mem_format = dcp.ALLOWED["torch.distributed._shard.sharded_tensor.metadata"]["MEM_FORMAT_ENCODING"]


# ---- the pickled classes, as inert stand-ins -------------------------------------------------

class _Obj(StandIn):
    """An allowlisted torch.distributed object: NEWOBJ arguments kept as ``args`` (``TensorMeta`` and
    ``ShardOrderEntry`` are named tuples built from them), BUILD state as ``state``. Nothing runs."""

    kind = "Obj"
    args: tuple
    state: Any

    def __new__(cls, *args: Any) -> "_Obj":
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def field(self, name: str, default: Any = None) -> Any:
        """Field ``name`` of the state: a dict, or a ``(dict, slots dict)`` pair as torch pickles slots."""
        for part in (self.state if type(self.state) is tuple else (self.state,)):
            if type(part) is dict and name in part:
                return part[name]
        return default

    def __repr__(self) -> str:
        return f"{self.kind}({short_repr(self.args)}, {short_repr(self.state)})"


def _obj_type(name: str) -> Type[_Obj]:
    return type(name, (_Obj,), {"kind": name})


class _DeviceMesh(_Obj):
    """A DeviceMesh keeps only the fields a reader takes (``_mesh`` in the source): its layout or mesh
    tensor, this rank's coordinate and rank, the dim names. torch 2.9+ also pickles maps of the whole
    world (``_flatten_rank_map``: one int per rank; ``_root_mesh`` and ``_flatten_mapping``: other meshes,
    each with its own), and every DTensor of a file shares the mesh: kept, the mesh of a 1,024-rank save
    was ~1,100 nodes, over the unpickler's SHARED_SMALL, so it was counted at each of a file's DTensors
    (45,395 of them: 50M nodes) and the file refused as crafted. Dropped at BUILD, they never count."""

    kind = "DeviceMesh"
    READ = frozenset(("_layout", "mesh", "_coordinate_on_dim", "_rank", "_mesh_dim_names", "mesh_dim_names"))

    def __setstate__(self, state: Any) -> None:
        keep = self.READ
        parts = [{k: v for k, v in part.items() if k in keep} if type(part) is dict else part
                 for part in (state if type(state) is tuple else (state,))]
        self.state = tuple(parts) if type(state) is tuple else parts[0]


TYPES = {n: _obj_type(n) for n in ("_MeshLayout", "_FlatLayout", "DTensorSpec", "TensorMeta",
                                    "ShardOrderEntry", "Shard", "_StridedShard", "Replicate", "Partial",
                                    # FSDP1 SHARDED_STATE_DICT without a device mesh: ShardedTensor's parts
                                    "LocalShard", "ShardMetadata", "ShardedTensorMetadata", "TensorProperties",
                                    "_remote_device", "ChunkShardingSpec", "ProcessGroupState")}
TYPES["DeviceMesh"] = _DeviceMesh


class _Marker:
    """A pickled class that is only ever an argument (``DTensor`` in its rebuild call): not callable."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


_DTENSOR = _Marker("DTensor")
_SHARDED = _Marker("ShardedTensor")


def _getattr(obj: Any, name: Any) -> Type[_Obj]:
    # ShardedTensor pickles its process-group record as getattr(ShardedTensor, "ProcessGroupState"):
    # that one attribute of that one marker, nothing else.
    if obj is _SHARDED and name == "ProcessGroupState":
        return TYPES["ProcessGroupState"]
    raise UnsafeCheckpointError(f"refused for safety: its pickle asks for getattr({short_repr(obj)}, "
                                f"{short_repr(name)}); the file was not executed")


class _WrapperArgs(StandIn):
    """What ``torch._utils._rebuild_wrapper_subclass(cls, dtype, size, stride, ...)`` was given: kept, not run."""

    def __init__(self, args: tuple):
        self.args = args


def _rebuild_wrapper_subclass(*args: Any) -> _WrapperArgs:
    return _WrapperArgs(args)


class DTensorRef(StandIn):
    """A DTensor of a rank file: global ``shape`` and ``dtype``, ``local`` (the rank's shard, a
    :class:`~..formats.torch_files.TensorRef`) and ``spec`` (the pickled ``DTensorSpec`` stand-in)."""

    def __init__(self, shape: Any, dtype: Any, local: Any, spec: Any):  # as unpickled: checked by the reader
        self.shape, self.dtype, self.local, self.spec = shape, dtype, local, spec


class ShardedRef(StandIn):
    """A ShardedTensor of a rank file: global ``shape`` and ``dtype`` and ``shards``, the rank's local
    shards (``LocalShard`` stand-ins: a tensor and its ``ShardMetadata`` offsets and sizes)."""

    def __init__(self, shape: Any, dtype: Any, shards: Any):  # as unpickled: checked by the reader
        self.shape, self.dtype, self.shards = shape, dtype, shards


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    # torch pickles a tensor subclass as (rebuild function, class, args, state): a DTensor through
    # _rebuild_wrapper_subclass with its local shard and spec in the (dict, slots) state; every
    # other tensor as torch_files reads it.
    if func is not _rebuild_wrapper_subclass:
        return torch_files.TORCH_ALLOWED["torch._tensor"]["_rebuild_from_type_v2"](func, new_type, args, state)
    if new_type not in (_DTENSOR, _SHARDED) or type(args) is not tuple or len(args) < 3:
        raise CheckpointError(f"a tensor subclass {short_repr(new_type)} rebuilt from {short_repr(args)}; "
                              "only DTensor and ShardedTensor are read")
    if new_type is _SHARDED:  # state: (local shards, ShardedTensorMetadata, pg state, sharding spec, rrefs)
        shards = state[0] if type(state) is tuple and state else None
        return ShardedRef(args[2], args[1], shards)
    holder = TYPES["DTensorSpec"]()  # reads the (dict, slots) state the same way as a spec's
    holder.state = state
    return DTensorRef(args[2], args[1], holder.field("_local_tensor"), holder.field("_spec"))


def _named(module_names: Iterable[str], cls_names: Iterable[str],
           value: Callable[[str], Any]) -> Dict[str, Dict[str, Any]]:
    return {m: {n: value(n) for n in cls_names} for m in module_names}


def _merge(*tables: Dict[str, Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    out: Dict[str, dict] = {}
    for table in tables:
        for module, names in table.items():
            out.setdefault(module, {}).update(names)
    return out


# module -> name -> stand-in. torch has moved these classes between releases (2.4's
# torch.distributed._tensor.* became torch.distributed.tensor.* in 2.5); every spelling is listed.
_TENSOR_PKGS = ("torch.distributed.tensor", "torch.distributed._tensor")
ALLOWED = _merge(
    torch_files.TORCH_ALLOWED,
    {"torch._tensor": {"_rebuild_from_type_v2": _rebuild_from_type_v2},
     "torch._utils": {"_rebuild_wrapper_subclass": _rebuild_wrapper_subclass},
     "torch.serialization": {"_get_layout": _layout}},
    _named([*_TENSOR_PKGS, *(f"{p}.api" for p in _TENSOR_PKGS), *(f"{p}._api" for p in _TENSOR_PKGS)],
           ["DTensor"], lambda n: _DTENSOR),
    _named([f"{p}.placement_types" for p in _TENSOR_PKGS], ["Shard", "_StridedShard", "Replicate", "Partial"],
           TYPES.get),
    _named([f"{p}._dtensor_spec" for p in _TENSOR_PKGS] + [f"{p}.placement_types" for p in _TENSOR_PKGS],
           ["DTensorSpec", "TensorMeta", "ShardOrderEntry"], TYPES.get),
    _named(["torch.distributed.device_mesh", "torch.distributed._tensor.device_mesh"], ["DeviceMesh"], TYPES.get),
    _named(["torch.distributed._mesh_layout"], ["_MeshLayout", "_FlatLayout"], TYPES.get),
    {"torch.distributed._shard.sharded_tensor.api": {"ShardedTensor": _SHARDED},
     "torch.distributed._shard.sharded_tensor.shard": {"Shard": TYPES["LocalShard"]},
     "torch.distributed._shard.metadata": {"ShardMetadata": TYPES["ShardMetadata"]},
     "torch.distributed._shard.sharded_tensor.metadata": {
         "ShardedTensorMetadata": TYPES["ShardedTensorMetadata"], "TensorProperties": TYPES["TensorProperties"],
         "MEM_FORMAT_ENCODING": _mem_format},
     "torch.distributed._shard.sharding_spec.chunk_sharding_spec": {"ChunkShardingSpec": TYPES["ChunkShardingSpec"]},
     "torch.distributed.remote_device": {"_remote_device": TYPES["_remote_device"]},
     "builtins": {"getattr": _getattr}},
)
