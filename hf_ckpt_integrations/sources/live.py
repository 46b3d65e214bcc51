"""A live model (plain, DDP, DeepSpeed ZeRO-1/2/3) -> the same plan offline sources build.

:func:`live_tensors` returns an :class:`~..plan.ExportPlan` whose tensors each have one
:class:`~..plan.LivePiece`, closed by the passes every plan gets (:func:`~.passes.finish_plan`:
the output dtype by the one rule, then ``check_plan``). Nothing is copied up front; the writer
calls ``read(lo, hi, writer, dtype)`` once it has assigned the tensor to rank ``writer``, and the
read yields the bytes, cast to the tensor's output dtype ``dtype`` one tensor at a time:

- ZeRO-1/2 and plain modules: the parameter (often a view into ZeRO's flat buffer)
  is read in place — its own bytes only, never the whole storage, never a clone of the state dict;
- ZeRO-3: the parameter is never gathered whole. Its flat bytes are the concatenation of the
  ranks' partitions (``param.ds_tensor``, the last one padded). Once the writer has assigned the
  shards (the read is given the writing rank), each owner sends its
  partition point to point to that rank alone, which writes it straight into the shard: the
  writing rank holds two partition-sized buffers (parameter size / world size), no other rank
  holds anything beyond its own partition, and each partition crosses the network once (a
  broadcast sends it to every rank). Without an assignment, and under AutoTP (whose ZeRO groups
  are not the writer's), each partition is broadcast from its owner instead. Persistent
  parameters (below ``stage3_param_persistence_threshold``) are whole on every rank and read in
  place; partitions kept off-CPU memory (NVMe) go through ``deepspeed.zero.GatheredParameters``.
  Sends and broadcasts pair up by order: every rank must walk the same tensors in the same order
  (the writer's shard order); ranks that do not write a tensor still call its read, which takes
  part and yields nothing (or bytes they drop). The next partition is received while the
  current one is written (two buffers at most). A chunk is valid until the next one is asked for
  (the buffers are reused);
- FSDP2 (``fully_shard``: parameters are DTensors): each tensor is gathered when its shard is
  written (``full_tensor()``, a collective on the tensor's mesh), one tensor at a time, and dropped
  after; a DTensor that is already whole (``Replicate`` placements) is read in place;
- DeepSpeed AutoTP (``tensor_parallel.autotp_size``): the parameter's layer gathers its slices
  with the layer's own ``gather_params`` (the inverse of the split it made, uneven vocab splits
  included), also a collective, and the parameter gets back its original ``.data`` afterwards —
  not DeepSpeed's re-split copy, which under ZeRO-1/2 would no longer be a view of the flat
  buffer the optimizer updates.

Names and order are the module's ``state_dict()`` (persistent buffers included), then converted
to what ``save_pretrained`` writes (:mod:`.hub_layout`): a tensor reached under two names (tied
weights) is written once, under the name ``save_pretrained`` keeps; a tensor transformers 5 fuses
in memory (MoE experts) is written as its Hub slices, each read as an element range of the
parameter (under ZeRO-3 only the partitions overlapping the range travel).

Devices (``docs/gpu.md``): every tensor a read puts into a collective is on the device the process
group moves (:class:`~..comm.Traffic`: the current GPU for NCCL, the CPU for gloo) — an offloaded
ZeRO-3 partition or a CPU-offloaded FSDP2 shard is copied there first, receive buffers are allocated
there — and the ranks agree before each collective read, so an error while staging on one rank (out
of GPU memory) is the same :class:`~..comm.WriteError` on every rank. Only the writing rank copies
bytes to the host; the others take part in the collective and keep nothing.
"""

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple

from ..dtype_rule import keep_fp32_of_model
from ..formats.dtypes import FLOATS, from_torch, to_torch
from ..plan import ExportPlan, LivePiece, TensorPlan
from ..convert.passes import finish_plan

if TYPE_CHECKING:
    import torch

    from ..comm import Traffic

# read(lo, hi, writer, dtype): the bytes of elements [lo, hi) in ``dtype`` on rank ``writer`` (LivePiece.read)
Read = Callable[[int, int, Optional[int], str], Iterator[memoryview]]

__all__ = ["live_tensors", "reads_are_collective", "own_bytes"]


def own_bytes(t: "torch.Tensor", cast: Optional["torch.dtype"]) -> memoryview:
    """``t``'s own bytes (a view of a larger storage yields only its elements), as a memoryview: the
    one host read of a live tensor, made only on the rank that writes it."""
    import torch

    t = t.detach()
    if cast is not None and t.is_floating_point() and t.dtype != cast:
        t = t.to(cast)
    t = t.contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _rank() -> int:
    """This process's global rank (0 without ``torch.distributed``)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _writes(writer: Optional[int]) -> bool:
    """Whether this rank yields a read's bytes: the writing rank only (every rank without an assignment)."""
    return writer is None or writer == _rank()


class _Reads:
    """What the reads of one plan share: the collective traffic (:class:`~..comm.Traffic`, made at
    the first collective read: the plan may be built before a write that never reads), and the one
    gathered tensor kept for the slices still to read from it (a fused MoE tensor is gathered once,
    not once per expert: at most one full tensor held)."""

    def __init__(self) -> None:
        self._traffic: Optional["Traffic"] = None
        self.left: Dict[str, int] = {}  # source name -> reads still to come
        self.held: Optional[Tuple[str, "torch.Tensor"]] = None  # (source name, gathered tensor)

    @property
    def traffic(self) -> "Traffic":
        if self._traffic is None:
            from ..comm import Traffic

            self._traffic = Traffic()
        return self._traffic

    def gathered(self, src: str, gather: Callable[[], "torch.Tensor"]) -> "torch.Tensor":
        """``gather()`` for source ``src``, once for all its reads (the holder drops it after the last)."""
        if self.held is None or self.held[0] != src:
            self.held = None  # free the previous one before gathering the next
            self.held = (src, gather())
        full = self.held[1]
        self.left[src] = self.left.get(src, 1) - 1
        if self.left[src] <= 0:
            self.held = None
        return full


def reads_are_collective(module: "torch.nn.Module") -> bool:
    """True when reading a parameter is a collective (ZeRO-3 partitions, AutoTP slices, FSDP2 DTensors)."""
    return any((hasattr(p, "ds_id") and hasattr(p, "ds_shape")) or getattr(p, "ds_is_replaced_module", False)
               or _is_dtensor(p) for p in module.state_dict(keep_vars=True).values() if p is not None)


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or (hasattr(t, "full_tensor") and hasattr(t, "placements"))


def _cast(dtype: str) -> Optional["torch.dtype"]:
    """The torch dtype a read casts floating tensors to (``dtype``: the tensor's output dtype)."""
    return to_torch(dtype) if dtype in FLOATS else None


def _dtensor_reader(src: str, t: "torch.Tensor", reads: _Reads) -> Read:
    def gather() -> "torch.Tensor":
        # A CPU-offloaded shard (FSDP2 CPUOffloadPolicy) goes to the mesh's device first, as torch DCP
        # does; an error there (out of memory) is agreed on before the all-gather.
        traffic = reads.traffic
        error, staged = None, t
        try:
            staged = _on_mesh_device(t)
        except Exception as e:  # every rank must hear of it before the collective
            error = e
        traffic.agree(error)
        return staged.full_tensor()  # collective on t's mesh: every rank walks the same tensors in order

    def read(lo: int, hi: int, writer: Optional[int], dtype: str) -> Iterator[memoryview]:
        full = reads.gathered(src, gather)
        if _writes(writer):
            yield own_bytes(_flat(full)[lo:hi], _cast(dtype))

    return read


def _on_mesh_device(t: "torch.Tensor") -> "torch.Tensor":
    """DTensor ``t`` with its local shard on its mesh's device (a copy when it is elsewhere)."""
    local = t.to_local()
    kind = t.device_mesh.device_type
    if local.device.type == kind:
        return t
    from ..comm import collective_device

    try:
        device = collective_device(t.device_mesh.get_group())
    except (RuntimeError, ValueError):  # a multi-dimensional mesh: its first dimension's group
        device = collective_device(t.device_mesh.get_group(0))
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride(),
                              run_check=False)


def live_tensors(module: "torch.nn.Module", *, dtype: Optional[str] = None,
                 select: Optional[Callable[[str], Optional[str]]] = None) -> ExportPlan:
    """The plan of ``module`` (unwrapped: the ``nn.Module``, not the DeepSpeed engine): its tensors
    under the names and splits ``save_pretrained`` writes (:mod:`.hub_layout`: transformers 5's
    fused MoE experts become one tensor per expert, each a slice of the fused parameter).

    Each is a :class:`~..plan.TensorPlan` (kind ``"live"``) with one :class:`~..plan.LivePiece`.
    ``dtype``: ``None`` keeps each tensor's training dtype; ``"fp32"``/``"bf16"``/``"fp16"`` casts
    floating tensors (one tensor at a time), except those the model class keeps in fp32 for that
    dtype (decided by :func:`~.passes.finish_plan`, the rule every plan gets; upcast from what the
    live model holds). Every rank must call it and get the same plan.
    Raises :class:`~..errors.LayoutError` where transformers' save-time conversion is not a split
    along the leading dims.

    ``select``: ``name -> output name or None``: only the tensors it names, under those names, and no
    Hub-layout conversion (a PEFT adapter, :mod:`.peft`); the others are never read (or gathered).
    """
    keep = keep_fp32_of_model(module) if select is None else None  # an adapter is saved as trained
    state = module.state_dict(keep_vars=True)
    if select is not None:
        state = {n: t for n, t in state.items() if select(n) is not None}
    owners = dict(module.named_modules())
    reads = _Reads()
    seen: Dict[Tuple[str, int], str] = {}
    # Point-to-point sends of ZeRO-3 partitions to the writing rank, except under AutoTP (its
    # parameters' groups are not the writer's: broadcast there).
    p2p = not any(getattr(p, "ds_is_replaced_module", False) for p in module.parameters())
    aliases: Dict[str, str] = {}  # tied name -> the name written
    # name -> (shape, stored dtype, read(lo, hi, writer, dtype) -> chunks)
    sources: Dict[str, Tuple[Tuple[int, ...], str, Read]] = {}
    for name, t in state.items():
        if t is None:
            continue
        # Tied weights are one Parameter object under two names (ZeRO-3: one ds_id).
        key = ("ds", t.ds_id) if hasattr(t, "ds_id") else ("id", id(t))
        if key in seen:
            aliases[name] = seen[key]
            continue  # tied: written once, under the first name (or the one save_pretrained keeps)
        seen[key] = name
        owner = owners.get(name.rpartition(".")[0])
        if getattr(t, "ds_is_replaced_module", False):
            shape, read = _autotp_reader(name, t, owner, reads)
        elif hasattr(t, "ds_id") and hasattr(t, "ds_shape"):
            shape, read = tuple(t.ds_shape), _zero3_reader(t, p2p, reads)
        elif _is_dtensor(t):
            shape, read = tuple(t.shape), _dtensor_reader(name, t, reads)
        else:
            shape, read = tuple(t.shape), _local_reader(t)
        sources[name] = (shape, from_torch(t.dtype), read)

    layout: List[Tuple[str, str, Tuple[int, ...], int]]
    if select is not None:  # (``state`` holds only names select() maps to one)
        layout = [(out_name, n, s[0], 0) for n, s in sources.items() if (out_name := select(n)) is not None]
    else:
        from ..convert.hub_layout import live_layout

        layout = live_layout(module, {n: s[0] for n, s in sources.items()}, aliases)
    for _, src, _, _ in layout:  # how many output tensors read each source (its gather is kept that long)
        reads.left[src] = reads.left.get(src, 0) + 1
    out: List[TensorPlan] = []
    for name, src, shape, offset in layout:
        _, stored, read = sources[src]
        piece = LivePiece(read, offset, offset + math.prod(shape), stored)
        out.append(TensorPlan(name, tuple(shape), stored, [[piece]], kind="live",
                              hub_source=src if src != name else None))
    plan = ExportPlan("live", type(module).__name__, None, out, aliases=aliases)
    return finish_plan(plan, dtype, keep)


def _local_reader(t: "torch.Tensor") -> Read:
    def read(lo: int, hi: int, writer: Optional[int], dtype: str) -> Iterator[memoryview]:
        if _writes(writer):  # other ranks move nothing to the host
            yield own_bytes(_flat(t)[lo:hi], _cast(dtype))
    return read


def _flat(t: "torch.Tensor") -> "torch.Tensor":
    return t.detach().reshape(-1)


def _zero3_reader(param: "torch.Tensor", p2p: bool, reads: _Reads) -> Read:
    def read(lo: int, hi: int, writer: Optional[int], dtype: str) -> Iterator[memoryview]:
        cast = _cast(dtype)
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        if param.ds_status == ZeroParamStatus.AVAILABLE:
            # Persistent (or already gathered): whole on every rank; no rank exchanges anything.
            if _writes(writer):
                yield own_bytes(_flat(param.data)[lo:hi], cast)
            return
        if _streamable(param):
            if p2p and writer is not None and _in_group(param.ds_process_group, writer):
                yield from _partitions_to(param, cast, lo, hi, writer, reads.traffic)
            else:
                yield from _partitions(param, cast, lo, hi, writer, reads.traffic)
            return
        import deepspeed

        reads.traffic.agree(None)  # DeepSpeed's own gather below: no rank may have failed before it
        # modifier_rank=None: read-only gather; re-partitioned (memory freed) on exit.
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if _writes(writer):
                yield own_bytes(_flat(param.data)[lo:hi], cast)

    return read


def _streamable(param: "torch.Tensor") -> bool:
    """Whether ``param``'s partition is a plain 1-D tensor in memory that :func:`_partitions` can send."""
    import torch.distributed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    part = getattr(param, "ds_tensor", None)
    return (param.ds_status == ZeroParamStatus.NOT_AVAILABLE and part is not None and part.dim() == 1
            and part.is_contiguous() and getattr(part, "final_location", None) is None
            and part.numel() * torch.distributed.get_world_size(group=param.ds_process_group) >= param.ds_numel)


def _owners(param: "torch.Tensor", lo: int, hi: int) -> Tuple[int, List[int]]:
    """``(n, owners)``: the partition size and the group ranks whose partitions overlap ``[lo, hi)``."""
    import torch.distributed as dist

    n = param.ds_tensor.numel()
    hi = min(hi, param.ds_numel)
    return n, [r for r in range(dist.get_world_size(group=param.ds_process_group)) if r * n < hi and (r + 1) * n > lo]


def _partitions(param: "torch.Tensor", cast: Optional["torch.dtype"], lo: int, hi: int, writer: Optional[int],
                traffic: "Traffic") -> Iterator[memoryview]:
    """Elements ``[lo, hi)`` of ``param``'s flat bytes, one ZeRO-3 partition at a time, each
    broadcast from the rank that owns it, yielded on rank ``writer`` (every rank when None).

    Rank ``r`` of ``param.ds_process_group`` holds flat elements ``[r*n, (r+1)*n)`` of the
    parameter (``n = ds_tensor.numel()``; the tail of the last partition is padding); only the
    partitions that overlap ``[lo, hi)`` travel (one expert of a fused MoE tensor: its own ranks).
    Every tensor is on the collective device (an offloaded partition is staged there, as DeepSpeed
    does); two partition buffers per rank at most. Collective.
    """
    import torch
    import torch.distributed as dist

    group = param.ds_process_group
    me = dist.get_rank(group=group)
    n, owners = _owners(param, lo, hi)
    hi = min(hi, param.ds_numel)
    keep = _writes(writer)
    error, buffers, mine = None, [], None
    try:
        if me in owners:
            mine = traffic.stage(param.ds_tensor.detach())
        # Partition owners[i] arrives while the one before is written (two buffers at most).
        buffers = [traffic.empty(n, param.ds_tensor.dtype) for _ in range(min(2, len(owners)))]
    except Exception as e:  # every rank must hear of it before the broadcasts
        error = e
    traffic.agree(error)

    def start(i: int) -> Tuple["torch.Tensor", Any]:  # (the buffer, its broadcast's work handle)
        # As bytes: any dtype travels (gloo has no bf16 broadcast on every build).
        r = owners[i]
        t = mine if r == me else buffers[i % 2]
        assert t is not None  # r == me: this rank staged its partition above (or agree() raised)
        work = dist.broadcast(t.view(torch.uint8), src=dist.get_global_rank(group, r), group=group, async_op=True)
        return t, work

    nxt = start(0) if owners else None
    failure = None
    for i, r in enumerate(owners):
        assert nxt is not None  # started before the loop (owners is not empty) and for each next one
        t, work = nxt
        work.wait()
        # The buffer of partition i+1 is the one of i-1, written already: receive into it now.
        nxt = start(i + 1) if i + 1 < len(owners) else None
        a, b = max(lo, r * n) - r * n, min(hi, (r + 1) * n) - r * n
        if keep and failure is None and b > a:
            try:
                yield own_bytes(t[a:b], cast)
            except Exception as e:  # finish the broadcasts the other ranks are in, then raise
                failure = e
    if failure is not None:
        raise failure


def _in_group(group: Any, rank: int) -> bool:  # group: a torch ProcessGroup
    import torch.distributed as dist

    try:
        return dist.get_group_rank(group, rank) >= 0
    except (ValueError, RuntimeError):
        return False


def _partitions_to(param: "torch.Tensor", cast: Optional["torch.dtype"], lo: int, hi: int, writer: int,
                   traffic: "Traffic") -> Iterator[memoryview]:
    """Elements ``[lo, hi)`` of ``param``'s flat bytes on rank ``writer`` (a global rank), each
    overlapping ZeRO-3 partition sent point to point by its owner: only the writing rank receives
    (the traffic of a broadcast divided by the world size). On every other rank this yields
    nothing; an owner sends its slice and returns. Every rank must call it, in the same tensor
    order (pairs are matched by order). Tensors are on the collective device (an offloaded
    partition is staged there first; the receive buffers are allocated there); the ranks agree
    before any send. The writer holds two slice-sized buffers at most: the next partition is
    received while the current one is written.
    """
    import torch
    import torch.distributed as dist

    group = param.ds_process_group
    me = dist.get_rank(group=group)
    w = dist.get_group_rank(group, writer)
    n, owners = _owners(param, lo, hi)
    hi = min(hi, param.ds_numel)

    def span(r: int) -> Tuple[int, int]:
        return max(lo, r * n) - r * n, min(hi, (r + 1) * n) - r * n

    error, mine, buffers = None, None, []
    try:
        if me in owners:
            a, b = span(me)
            mine = traffic.stage(param.ds_tensor.detach()[a:b])
        if me == w:
            size = max((span(r)[1] - span(r)[0] for r in owners if r != me), default=0)
            buffers = [traffic.empty(size, param.ds_tensor.dtype) for _ in range(min(2, len(owners)))]
    except Exception as e:  # every rank must hear of it before the sends
        error = e
    traffic.agree(error)
    if me != w:
        if mine is not None:
            # As bytes: any dtype travels (gloo has no bf16 send on every build).
            traffic.exchange([(dist.isend, mine.contiguous().view(torch.uint8), writer)])
        return

    def start(i: int) -> Tuple[Optional["torch.Tensor"], Optional[List[Any]]]:  # (the slice, its receive's works)
        r = owners[i]
        if r == me:
            return mine, None
        a, b = span(r)
        buf = buffers[i % 2][:b - a]
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf.view(torch.uint8), dist.get_global_rank(group, r))])
        return buf, works

    nxt = start(0) if owners else None
    failure = None
    for i in range(len(owners)):
        assert nxt is not None  # started before the loop (owners is not empty) and for each next one
        t, works = nxt
        assert t is not None  # this rank's own slice was staged above, as an owner (or agree() raised)
        for work in works or ():
            work.wait()
        nxt = start(i + 1) if i + 1 < len(owners) else None
        if failure is None and t.numel():
            try:
                yield own_bytes(t, cast)
            except Exception as e:  # receive what the owners are sending, then raise
                failure = e
    if failure is not None:
        raise failure


def _autotp_full_shape(name: str, param: "torch.Tensor", owner: Optional["torch.nn.Module"]) -> Tuple[int, ...]:
    """The shape before AutoTP split ``param`` (recorded by the replaced layer)."""
    for attr, shape_attr in (("weight", "_orig_weight_shape"), ("bias", "_orig_bias_shape")):
        if owner is not None and getattr(owner, attr, None) is param and getattr(owner, shape_attr, None):
            return tuple(getattr(owner, shape_attr))
    raise ValueError(f"{name}: DeepSpeed AutoTP layer {type(owner).__name__} records no original shape for this "
                     "parameter; save it with engine.save_checkpoint and export offline (hf-ckpt export)")


def _autotp_reader(name: str, param: "torch.Tensor", owner: Optional["torch.nn.Module"],
                   reads: _Reads) -> Tuple[Tuple[int, ...], Read]:
    full_shape = _autotp_full_shape(name, param, owner)
    assert owner is not None  # _autotp_full_shape found the shape on it (it raises otherwise)
    zero3 = hasattr(param, "ds_id")

    @contextlib.contextmanager
    def gathered() -> Iterator["torch.Tensor"]:
        import deepspeed

        own = list(owner.parameters(recurse=False))  # the layer gathers its parameters together
        with deepspeed.zero.GatheredParameters(own, modifier_rank=None, enabled=zero3):
            saved = [p.data for p in own]
            param.gather_params(own)
            try:
                if tuple(param.shape) != full_shape:
                    raise ValueError(f"{name}: AutoTP gather gave shape {tuple(param.shape)}, expected {full_shape}")
                yield param.data
            finally:
                for p, data in zip(own, saved):
                    p.data = data

    def gather() -> "torch.Tensor":
        reads.traffic.agree(None)  # the layer's own all-gather below: no rank may have failed before it
        with gathered() as full:
            return full

    def read(lo: int, hi: int, writer: Optional[int], dtype: str) -> Iterator[memoryview]:
        full = reads.gathered(name, gather)  # a fused MoE tensor: gathered once for all its slices
        if _writes(writer):
            yield own_bytes(_flat(full)[lo:hi], _cast(dtype))

    return full_shape, read
