"""NCCL's device rules on a CPU machine (test support only).

:func:`install` gives this process a fake accelerator and makes the default process group behave,
for the code under test, like an NCCL group:

- **a fake device**: torch's PrivateUse1 backend renamed ``hfdev`` (``torch.hfdev`` with
  ``current_device``/``set_device``/``device_count``), whose tensors (:class:`DeviceTensor`, a wrapper
  subclass) hold their data in CPU memory. ``torch.empty(..., device="hfdev:1")``, ``t.to("hfdev:1")``
  and every op on such tensors work; the bytes they hold are counted per process (:data:`STATS`:
  ``live``/``peak`` device bytes, ``d2h`` bytes copied to the host, ``h2d`` copied in);
- **backend ``fakenccl``** (``dist.get_backend`` of every group not created with ``backend="gloo"``):
  its device is ``hfdev`` (``Backend.backend_capability``). The tensor collectives and point-to-point
  calls of ``torch.distributed`` refuse, as NCCL does, a tensor that is not on this rank's device
  (``hfdev:LOCAL_RANK``): a CPU tensor (pinned or not), or another device's; then they run on the
  underlying gloo group with the CPU data;
- **point-to-point only batched** (``dist.batch_isend_irecv``): a bare ``send``/``recv``/``isend``/
  ``irecv`` on NCCL opens a 2-rank communicator per pair, so it is refused here;
- **object collectives** (``broadcast_object_list``, ``all_gather_object``) on a ``fakenccl`` group
  travel on the current device: refused when this rank never set its device (``torch.hfdev`` still
  at 0 on a rank whose ``LOCAL_RANK`` is not 0: every rank on device 0);
- ``.numpy()`` of a device tensor raises (as CUDA's does); host copies are counted, so a test can
  say which ranks read device memory to the host;
- **functional collectives** (``torch.distributed._functional_collectives``: what a DTensor's
  ``full_tensor()`` runs on its mesh) obey the same device rule, and each all-gather is counted
  (``STATS["gathers"]``);
- **the engine's own calls pass**: with ``RULES["package_only"]`` (the default) a call made from an
  engine's code (DeepSpeed, Accelerate, transformers, peft, torch) goes straight to gloo and sees the
  real backend — in a real engine run trained on CPU, the engine's tensors are CPU tensors; on a GPU
  they would be on the device by construction. The rules judge the package's calls and the tensors it
  hands over.

:func:`save_under_rules` switches the rules on for one save of a live engine module trained on
gloo/CPU, with its ZeRO-3 partitions and FSDP2 shards where a GPU run would have them.

:func:`fail_next_alloc` makes the next device allocation of at least ``nbytes`` raise
``torch.OutOfMemoryError`` (a rank running out of GPU memory while staging its part).
"""

import contextlib
import os
import sys
import weakref
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

DEVICE = "hfdev"
BACKEND = "fakenccl"
STATS = {"live": 0, "peak": 0, "d2h": 0, "h2d": 0, "allocs": 0, "gathers": 0}
_LIVE: dict = {}  # storage data_ptr -> [wrappers alive, nbytes]
_FAIL = {"nbytes": None}
_GLOO_GROUPS: list = []
_REAL: dict = {}
# ``on``: the rules apply (off: every call goes straight to torch); ``unbatched_ok``: bare
# point-to-point allowed (to look at the device rule alone).
# ``refuse``: off, nothing is refused (device tensors still travel, bytes are still counted: what a
# rank copies to the host can be measured on code that breaks the rules).
# ``package_only``: calls from an engine's own code (:data:`ENGINES`) pass untouched.
RULES = {"on": True, "unbatched_ok": False, "refuse": True, "package_only": True}
ENGINES = ("deepspeed", "accelerate", "transformers", "peft", "torch")


class _Module:
    """``torch.hfdev``."""

    current = 0
    count = 8

    @classmethod
    def current_device(cls):
        return cls.current

    @classmethod
    def set_device(cls, index):
        cls.current = torch.device(index).index if not isinstance(index, int) else index

    @classmethod
    def device_count(cls):
        return cls.count

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def is_initialized():
        return True

    @staticmethod
    def _is_in_bad_fork():
        return False

    @staticmethod
    def manual_seed_all(seed):
        pass

    @staticmethod
    def synchronize(device=None):
        pass


def _release(key):
    entry = _LIVE.get(key)
    if entry is None:
        return
    entry[0] -= 1
    if entry[0] == 0:
        STATS["live"] -= entry[1]
        del _LIVE[key]


class DeviceTensor(torch.Tensor):
    """A tensor on ``hfdev:i`` whose data is the CPU tensor ``elem``."""

    @staticmethod
    def __new__(cls, elem, index=0):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=torch.device(DEVICE, index), requires_grad=False)
        r.elem = elem
        try:
            key, nbytes = elem.untyped_storage().data_ptr(), elem.untyped_storage().nbytes()
        except RuntimeError:  # elem is itself a wrapper (torch's own, e.g. a collective's result)
            key, nbytes = ("wrapper", id(elem)), elem.numel() * elem.element_size()
        entry = _LIVE.get(key)
        if entry is None:
            entry = _LIVE[key] = [0, nbytes]
            STATS["live"] += nbytes
            STATS["peak"] = max(STATS["peak"], STATS["live"])
        entry[0] += 1
        weakref.finalize(r, _release, key)
        return r

    def __repr__(self):
        return f"DeviceTensor({self.elem!r}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        index = next((a.device.index for a in _flat(args) if isinstance(a, DeviceTensor)), 0)
        dev = kwargs.get("device")
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], DeviceTensor) and (
                dev is not None and torch.device(dev).type == "cpu"):
            STATS["d2h"] += args[0].elem.numel() * args[0].elem.element_size()
            return func(args[0].elem, **kwargs)
        if func is torch.ops.aten.copy_.default and not isinstance(args[1], DeviceTensor):
            STATS["h2d"] += args[1].numel() * args[1].element_size()
        if dev is not None and torch.device(dev).type == DEVICE:
            index = torch.device(dev).index or 0
            kwargs["device"] = "cpu"
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(lambda x: DeviceTensor(x, index) if isinstance(x, torch.Tensor)
                        and not isinstance(x, DeviceTensor) else x, out)

    def numpy(self, *a, **k):
        raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")


def _flat(args):
    out = []
    tree_map(out.append, args)
    return out


def _unwrap(x):
    return x.elem if isinstance(x, DeviceTensor) else x


def _alloc(size, dtype, device, stride=None):
    nbytes = (torch.Size(size).numel()) * (dtype or torch.get_default_dtype()).itemsize
    if _FAIL["nbytes"] is not None and nbytes >= _FAIL["nbytes"]:
        _FAIL["nbytes"] = None
        raise torch.OutOfMemoryError(f"{DEVICE} out of memory: tried to allocate {nbytes} bytes (injected)")
    STATS["allocs"] += 1
    elem = torch.empty(size, dtype=dtype) if stride is None else torch.empty_strided(size, stride, dtype=dtype)
    return DeviceTensor(elem, torch.device(device).index or 0 if device is not None else 0)


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return _alloc(size, dtype, device)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return _alloc(size, dtype, device, stride)


def _copy_from(src, dst, non_blocking=False):
    """A copy between the host and the device (``t.to("hfdev:i")``, ``cpu_tensor.copy_(device_tensor)``)."""
    nbytes = src.numel() * src.element_size()
    if isinstance(dst, DeviceTensor) and not isinstance(src, DeviceTensor):
        STATS["h2d"] += nbytes
    elif isinstance(src, DeviceTensor) and not isinstance(dst, DeviceTensor):
        STATS["d2h"] += nbytes
    _unwrap(dst).copy_(_unwrap(src))
    return dst


def fail_next_alloc(nbytes: int) -> None:
    """The next device allocation of at least ``nbytes`` raises ``torch.OutOfMemoryError``."""
    _FAIL["nbytes"] = nbytes


def reset_stats() -> None:
    """Counts from now on (``live``: the device bytes alive now)."""
    STATS.update(live=sum(e[1] for e in _LIVE.values()), d2h=0, h2d=0, allocs=0, gathers=0)
    STATS["peak"] = STATS["live"]


# --- the rules ---------------------------------------------------------------------------------------

class NcclRuleError(RuntimeError):
    """What NCCL would raise (or where it would hang) for this call."""


def _local_index() -> int:
    return int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))


def _is_nccl(group) -> bool:
    return RULES["on"] and not any(group is g for g in _GLOO_GROUPS)


def _engine_call(depth: int = 2) -> bool:
    """Whether the caller of the wrapped function (``depth`` frames up) is an engine's own code."""
    if not RULES["package_only"]:
        return False
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name.split(".")[0] in ENGINES


def _check(tensors, what, group):
    if not RULES["refuse"]:
        return
    if not _is_nccl(group):
        for t in tensors:
            if isinstance(t, DeviceTensor):
                raise NcclRuleError(f"{what}: a {DEVICE} tensor on a gloo group")
        return
    want = torch.device(DEVICE, _local_index())
    for t in tensors:
        if not isinstance(t, DeviceTensor):
            raise NcclRuleError(f"{what}: NCCL moves only device tensors; got a {t.device} tensor"
                                f"{' (pinned)' if t.is_pinned() else ''} of shape {tuple(t.shape)}")
        if t.device != want:
            raise NcclRuleError(f"{what}: tensor on {t.device}, but this rank's device is {want} "
                                "(NCCL: duplicate GPU / wrong communicator)")


def _tensor_call(name, tensor_args):
    real = _REAL[name]

    def call(*args, **kwargs):
        group = kwargs.get("group")
        if _engine_call():
            return real(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name in ("send", "recv", "isend", "irecv") and _is_nccl(group) and RULES["refuse"] \
                and not RULES["unbatched_ok"]:
            raise NcclRuleError(f"dist.{name}: unbatched point-to-point on NCCL (a 2-rank communicator per "
                                "pair); use dist.batch_isend_irecv")
        tensors = [a for i, a in enumerate(args) if i in tensor_args]
        tensors += [kwargs[k] for k in ("tensor", "output_tensor", "input_tensor") if k in kwargs]
        flat = []
        for t in tensors:
            flat.extend(t if isinstance(t, (list, tuple)) else [t])
        _check(flat, f"dist.{name}", group)
        return real(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))

    return call


def _batch(p2p_op_list):
    ops = []
    engine = _engine_call()
    for op in p2p_op_list:
        if not engine:
            _check([op.tensor], "dist.batch_isend_irecv", op.group)
        ops.append((op.op, _unwrap(op.tensor), op.peer, op.group, op.tag))
    # gloo: plain async point-to-point, in order
    return [fn(t, peer, group=group, tag=tag) for fn, t, peer, group, tag in ops]


class _P2POp(dist.P2POp):
    """``dist.P2POp`` given the wrapped ``dist.isend``/``dist.irecv``: holds the real ones."""

    def __new__(cls, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        return super().__new__(cls, _UNWRAPPED.get(op, op), tensor, peer, group, tag, group_peer)

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        super().__init__(_UNWRAPPED.get(op, op), tensor, peer, group, tag, group_peer)


_UNWRAPPED: dict = {}


def _object_call(name):
    real = _REAL[name]

    def call(*args, **kwargs):
        if not _engine_call() and _is_nccl(kwargs.get("group")) and RULES["refuse"] and kwargs.get("device") is None and \
                torch.hfdev.current_device() != _local_index():
            raise NcclRuleError(f"dist.{name} on NCCL without set_device: rank {dist.get_rank()} "
                                f"(LOCAL_RANK {_local_index()}) would use {DEVICE}:{torch.hfdev.current_device()}")
        return real(*args, **kwargs)

    return call


def _get_backend(group=None):
    return BACKEND if _is_nccl(group) and not _engine_call() else _REAL["get_backend"](group)


def _process_group(group):
    """The process group of a functional collective's ``group`` argument."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(group, tuple):
        return group[0].get_group(group[1])
    if isinstance(group, DeviceMesh):
        return group.get_group()
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    return group


def _functional_call(module, name, group_index):
    """``module.name`` (a functional collective: ``fn(tensor, ..., group, ...)``) checked like the others."""
    real = getattr(module, name)

    def call(*args, **kwargs):
        group = kwargs["group"] if "group" in kwargs else args[group_index]
        _check([args[0] if args else kwargs["self"]], f"funcol.{name}", _process_group(group))
        if "gather" in name:
            STATS["gathers"] += 1
        return real(*args, **kwargs)

    return call


def _new_group(*args, **kwargs):
    g = _REAL["new_group"](*args, **kwargs)
    if str(kwargs.get("backend", "")).lower() == "gloo":
        _GLOO_GROUPS.append(g)
    return g


_PATCHED: dict = {}
_DEVICE_SET_UP = []


def _setup_device():
    if _DEVICE_SET_UP:
        return
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=DEVICE, backend_module=_Module)
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _DEVICE_SET_UP.append(lib)


def install(world_size: int = 8) -> None:
    """Fake device + NCCL rules in this process (see module doc). Idempotent."""
    _setup_device()
    _Module.count = max(world_size, 1)
    if _PATCHED:
        return
    dist.Backend.backend_capability[BACKEND] = [DEVICE]
    for name in ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "send", "recv", "isend", "irecv", "broadcast_object_list", "all_gather_object", "new_group",
                 "get_backend", "batch_isend_irecv"):
        _REAL[name] = getattr(dist, name)
    _PATCHED.update({
        "broadcast": _tensor_call("broadcast", {0}), "all_reduce": _tensor_call("all_reduce", {0}),
        "all_gather": _tensor_call("all_gather", {0, 1}),
        "all_gather_into_tensor": _tensor_call("all_gather_into_tensor", {0, 1}),
        "reduce_scatter_tensor": _tensor_call("reduce_scatter_tensor", {0, 1}),
        "send": _tensor_call("send", {0}), "recv": _tensor_call("recv", {0}), "isend": _tensor_call("isend", {0}),
        "irecv": _tensor_call("irecv", {0}), "batch_isend_irecv": _batch,
        "broadcast_object_list": _object_call("broadcast_object_list"),
        "all_gather_object": _object_call("all_gather_object"),
        "new_group": _new_group, "get_backend": _get_backend})
    _UNWRAPPED.update({_PATCHED["isend"]: _REAL["isend"], _PATCHED["irecv"]: _REAL["irecv"]})
    _PATCHED["P2POp"] = _P2POp
    for name, fn in _PATCHED.items():
        setattr(dist, name, fn)
    import torch.distributed._functional_collectives as funcol

    for name, index in (("all_gather_single", 2), ("all_gather_tensor", 2), ("all_reduce", 2), ("broadcast", 2),
                        ("reduce_scatter_single", 3), ("reduce_scatter_tensor", 3)):
        setattr(funcol, name, _functional_call(funcol, name, index))


@contextlib.contextmanager
def save_under_rules(module: Any, where: str = "device") -> Iterator[dict]:
    """The rules on (and the counts reset) for one save of ``module``, a live engine module trained
    on gloo/CPU in a process where :func:`install` ran with ``RULES["on"]`` off; yields :data:`STATS`.

    Its tensors are put where a GPU run would have them, and put back on exit:

    - ZeRO-3 partitions (``param.ds_tensor``, except AutoTP layers', which DeepSpeed gathers itself):
      ``where="device"``: copied to this rank's device; ``"cpu"``: left in CPU memory, as
      ``offload_param: {device: cpu}`` leaves them;
    - FSDP2 DTensor parameters: the same shards on a mesh of the fake device over the same ranks
      (what ``fully_shard`` on CUDA builds), their local shards on this rank's device, or on the CPU
      for ``"cpu"`` (what ``CPUOffloadPolicy`` leaves: the shard on the host, the mesh on the device).
    """
    assert where in ("device", "cpu"), where
    index = _local_index()
    device = torch.device(DEVICE, index)
    torch.hfdev.set_device(index)  # as Accelerate and the Trainer do on a GPU
    swapped: list = []
    MOVED.clear()
    try:
        for prefix, owner in module.named_modules():
            for name, p in list(owner._parameters.items()):
                if p is None:
                    continue
                partitioned = hasattr(p, "ds_tensor") and getattr(p.ds_status, "name", "") == "NOT_AVAILABLE"
                if (partitioned and not getattr(p, "ds_is_replaced_module", False)) or hasattr(p, "placements"):
                    MOVED.append(f"{prefix}.{name}" if prefix else name)
                if hasattr(p, "ds_tensor") and not getattr(p, "ds_is_replaced_module", False) and where == "device" \
                        and getattr(p, "_nccl_saved", None) is None:
                    p._nccl_saved = p.ds_tensor
                    p.ds_tensor = p.ds_tensor.detach().to(device)
                    swapped.append(("ds", p, None))
                elif hasattr(p, "device_mesh") and hasattr(p, "placements"):
                    owner._parameters[name] = _on_fake_mesh(p, device if where == "device" else None)
                    swapped.append(("dt", owner, (name, p)))
        RULES.update(on=True, refuse=True, unbatched_ok=False)
        reset_stats()
        yield STATS
    finally:
        RULES["on"] = False
        for kind, holder, extra in reversed(swapped):
            if kind == "ds":
                holder.ds_tensor, holder._nccl_saved = holder._nccl_saved, None
            else:
                holder._parameters[extra[0]] = extra[1]


_MESHES: dict = {}
# The parameters (state_dict names) of the last save_under_rules whose reads move device memory:
# ZeRO-3 partitions the package sends, FSDP2 shards.
MOVED: list = []


def _on_fake_mesh(t: Any, device: Optional[torch.device]) -> Any:
    """DTensor ``t`` on a fake-device mesh of the same ranks; its local shard on ``device`` (None: as is)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    ranks = t.device_mesh.mesh.tolist()
    key = str(ranks)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(DEVICE, ranks)
    local = t.to_local().detach()
    if device is not None:
        local = local.to(device)
    spec = DTensorSpec(_MESHES[key], tuple(t.placements), TensorMeta(t.shape, t.stride(), t.dtype))
    return _from_local_no_grad(local, spec)


def engine_saves(save: Any, module: Any, out_dir: Any, variants: tuple = ("device", "cpu")) -> dict:
    """In an engine script (trained on gloo/CPU), after its own save: ``save(dst)`` again for each
    variant of :func:`save_under_rules` (``"device"``: partitions/shards on the device; ``"cpu"``:
    offloaded), into ``out_dir/<variant>/``. The harness is installed here, rules off until each
    save. Writes ``out_dir/rank<r>.json``: per variant ``outcome`` (``"ok"`` or ``"raised"`` with
    ``error``), ``written_here`` (the files this rank wrote, when ``save`` returns a writer report),
    and this rank's counts (``d2h``: bytes copied to the host; ``gathers``; ``peak``: device bytes).
    A variant that raises is recorded, not raised: the other variants and the run go on."""
    import json
    from pathlib import Path

    install(dist.get_world_size())
    RULES["on"] = False
    out_dir = Path(out_dir)
    report = {}
    for where in variants:
        entry: dict = {}
        try:
            with save_under_rules(module, where):
                got = save(out_dir / where)
            entry.update(outcome="ok", written_here=_written_here(got))
        except Exception as e:  # the test reads what each rank saw
            entry.update(outcome="raised", error=f"{type(e).__name__}: {e}"[:3000])
        entry.update(d2h=STATS["d2h"], gathers=STATS["gathers"], peak=STATS["peak"], moved=list(MOVED))
        report[where] = entry
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    return report


def _written_here(report: Any) -> list:
    """The files a writer report (or a PEFT save's report of reports) says this rank wrote."""
    if not isinstance(report, dict):
        return []
    if "written_here" in report:
        return list(report["written_here"])
    return sorted(f for r in report.get("adapters", {}).values() for f in _written_here(r))
