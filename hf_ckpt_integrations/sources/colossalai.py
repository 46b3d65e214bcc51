"""A live ColossalAI-boosted model (``HybridParallelPlugin``: TP, PP, DP) -> the writer's plan.

Call order (every rank makes every call, in the same order):

1. :func:`describe_model` — collective (``all_gather_object``): every rank reports the tensors it
   holds (local shape, dtype, TP sharding, vocabulary padding); all ranks get the same merged,
   global list of :class:`TensorInfo` (names from ``state_dict()``, so unheld pipeline stages and
   tied weights resolve to HF names).
2. :func:`live_plan` turns the infos into an :class:`~..plan.ExportPlan` whose tensors have one
   :class:`~..plan.LivePiece` each, closed by the passes every plan gets
   (:func:`~.passes.finish_plan`: the output dtype, ``check_plan``);
3. the writer (:func:`~..orchestrator.write`) assigns each tensor to a rank and calls every read
   with that rank: on the writing rank the read receives the TP pieces from their holders
   (point-to-point, so only the writer ever holds the gathered tensor, and only one tensor at a
   time), concatenates them along the sharded dimension, and only then cuts the vocabulary
   padding back to the recorded original length; on a holding rank it sends its local piece to
   the writer; on other ranks it does nothing.

Why gather first: ColossalAI records ``_origin_length`` / ``_current_length`` on each
rank's *local* shard, but both describe the *global* padded dimension (e.g. 1001 of 1024 rows).
Cutting a 512-row local shard to 1001 rows is a no-op, and the gathered tensor keeps 1024 rows —
the checkpoint that ``from_pretrained`` refuses. Here the padded length is checked against the
gathered tensor before the cut, so a layout that disagrees raises instead of writing a wrong shape.

This module uses only ``torch.distributed`` point-to-point calls and the layout attributes
ColossalAI attaches to parameters; it never calls ColossalAI's own gather/unpad helpers.
"""

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

from ..errors import LayoutError
from ..dtype_rule import keep_fp32_of_model
from ..formats.dtypes import FLOATS, from_torch, to_torch
from ..plan import ExportPlan, LivePiece, TensorPlan
from .live import own_bytes
from ..convert.passes import finish_plan

if TYPE_CHECKING:
    import torch

    from ..comm import Traffic

__all__ = ["TensorInfo", "describe_model", "live_plan", "local_tensors"]


@dataclass
class TensorInfo:
    """One output tensor, identical on every rank after :func:`describe_model`.

    ``holders``: ``{rank: local_shape}`` for every rank holding (a piece of) the tensor.
    ``groups``: for a TP-sharded tensor, each distinct TP group holding it, as its global ranks in
    shard order (a DP replica of the model is another group); empty for a whole tensor.
    ``shard_dim``: the dimension split over the TP group (``None`` for a whole tensor).
    ``padding``: ``(dim, origin_length, padded_length)`` of the *global* tensor, or ``None``.
    ``shape``: the shape written (gathered, unpadded).
    """

    name: str
    dtype: str
    shape: Tuple[int, ...]
    holders: Dict[int, Tuple[int, ...]] = field(default_factory=dict)
    groups: List[Tuple[int, ...]] = field(default_factory=list)
    shard_dim: Optional[int] = None
    padding: Optional[Tuple[int, int, int]] = None

    def sources(self, writer: int) -> List[int]:
        """The ranks whose local pieces, in order, make the tensor written by ``writer``."""
        if self.shard_dim is None:
            return [writer] if writer in self.holders else [min(self.holders)]
        for g in self.groups:
            if writer in g:
                return list(g)
        return list(self.groups[0])


def _named_tensors(module: "torch.nn.Module") -> Iterator[Tuple[str, "torch.Tensor"]]:
    """Parameters, then persistent buffers, in ``state_dict`` naming — read directly, never through
    ``state_dict()``: shardformer's ``ParallelModule._save_to_state_dict`` gathers and unpads every TP
    tensor itself (an all-gather on every rank), which is the path this source must not depend on."""
    yield from module.named_parameters()
    for mod_name, mod in module.named_modules():
        skip: Set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        for b_name, b in mod.named_buffers(recurse=False):
            if b is not None and b_name not in skip:
                yield (f"{mod_name}.{b_name}" if mod_name else b_name), b


def local_tensors(module: "torch.nn.Module") -> List[Tuple[str, "torch.Tensor"]]:
    """``(name, tensor)`` of the module's local parameters and persistent buffers (this rank's TP piece,
    still padded), a tied tensor once (first name).

    With ``config.tie_word_embeddings`` the model's ``_tied_weights_keys`` (``lm_head.weight``) are
    left out, as ``save_pretrained`` does: shardformer's TP layers may hold the tied head as a
    separate Parameter object, so identity alone does not see the tie; ``from_pretrained`` re-ties it.
    """
    config = getattr(module, "config", None)
    tied = set(getattr(module, "_tied_weights_keys", None) or ()) if getattr(
        config, "tie_word_embeddings", False) else set()
    seen, out = set(), []
    for name, t in _named_tensors(module):
        if t is None or id(t) in seen or name in tied:
            continue
        seen.add(id(t))
        out.append((name, t))
    return out


def _local_record(name: str, t: "torch.Tensor") -> Dict[str, Any]:
    import torch.distributed as dist
    from colossalai.tensor.d_tensor import is_distributed_tensor
    from colossalai.tensor.d_tensor.api import is_customized_distributed_tensor
    from colossalai.tensor.padded_tensor import is_padded_tensor

    rec: Dict[str, Any] = {"name": name, "dtype": from_torch(t.dtype), "local_shape": tuple(t.shape), "shard_dim": None,
           "group": None, "global_shape": tuple(t.shape), "padding": None}
    if is_customized_distributed_tensor(t):
        raise LayoutError(f"{name}: a customized distributed tensor (e.g. a fused QKV split) has no generic "
                          "gather rule; save this model with the booster's own save_model (install_colossalai_hooks "
                          "cannot write it)")
    if is_distributed_tensor(t):
        layout = t.dist_layout
        parts = {d: axes for d, axes in layout.sharding_spec.dim_partition_dict.items() if axes}
        if len(parts) > 1 or any(len(a) != 1 for a in parts.values()):
            raise LayoutError(f"{name}: sharded over {parts} (dim -> device-mesh axes); only 1-D tensor "
                              "parallelism (one dimension over one axis) is supported — save with the booster's "
                              "own save_model")
        rec["global_shape"] = tuple(layout.global_shape)
        if parts:
            (dim, (axis,)), = parts.items()
            group = layout.device_mesh.get_process_group(axis)
            rec["shard_dim"] = int(dim)
            rec["group"] = tuple(dist.get_process_group_ranks(group))
    if is_padded_tensor(t):
        rec["padding"] = (int(t._padding_dim), int(t._origin_length), int(t._current_length))
    return rec


def describe_model(module: "torch.nn.Module") -> List[TensorInfo]:
    """The global tensor list of a boosted model's unwrapped module. Collective: every rank calls it.

    Raises :class:`LayoutError` (on every rank that sees it) when ranks disagree about a tensor or a
    padding record does not match the gathered shape.
    """
    from ..comm import default_comm

    local = [_local_record(n, t) for n, t in local_tensors(module)]
    comm = default_comm()  # pickled objects on the CPU (a gloo side group under NCCL)
    everyone: List[Tuple[int, List[Dict[str, Any]]]] = comm.all_gather((comm.rank, local))
    infos: Dict[str, TensorInfo] = {}
    for rank, records in everyone:  # rank order, then state_dict order: the same list everywhere
        for r in records:
            info = infos.get(r["name"])
            if info is None:
                info = infos[r["name"]] = TensorInfo(r["name"], r["dtype"], r["global_shape"],
                                                     shard_dim=r["shard_dim"], padding=r["padding"])
            elif (info.dtype, info.shape, info.shard_dim, info.padding) != (r["dtype"], r["global_shape"],
                                                                            r["shard_dim"], r["padding"]):
                raise LayoutError(f"{r['name']}: rank {rank} holds it as {r['dtype']} {r['global_shape']} "
                                  f"(shard dim {r['shard_dim']}, padding {r['padding']}) but another rank as "
                                  f"{info.dtype} {info.shape} (shard dim {info.shard_dim}, padding {info.padding}); "
                                  "the ranks do not hold the same model — save from one boosted model")
            info.holders[rank] = r["local_shape"]
            if r["group"] is not None and r["group"] not in info.groups:
                info.groups.append(r["group"])
    out = list(infos.values())
    for info in out:
        _finish(info)
    return out


def _finish(info: TensorInfo) -> None:
    """Check the pieces cover the global shape, then apply the padding record to the *global* shape."""
    if info.shard_dim is not None:
        for g in info.groups:
            got = sum(info.holders[r][info.shard_dim] for r in g)
            if got != info.shape[info.shard_dim]:
                raise LayoutError(f"{info.name}: TP group {list(g)} holds {got} of {info.shape[info.shard_dim]} "
                                  f"entries along dim {info.shard_dim}; the layout metadata is inconsistent")
    if info.padding is not None:
        dim, origin, padded = info.padding
        if info.shape[dim] != padded:
            # The record describes the global padded length; anything else means we would cut wrongly.
            raise LayoutError(f"{info.name}: padded to {padded} along dim {dim}, but the gathered tensor has "
                              f"{info.shape[dim]} there; refusing to unpad (pad records are global)")
        shape = list(info.shape)
        shape[dim] = origin
        info.shape = tuple(shape)


# The writer casts and copies the gathered tensor to the host this many bytes at a time, so it holds
# the gathered tensor and one block, not a cast and a contiguous copy of the whole tensor besides.
_BLOCK_BYTES = 64 << 20


def _gather(info: TensorInfo, local: Optional["torch.Tensor"], sources: Sequence[int], me: int, writer: int,
            traffic: Union["Traffic", "_LocalTraffic"]) -> Optional["torch.Tensor"]:
    """One TP-sharded (or whole) tensor, point to point to ``writer``: the full tensor there
    (``None`` elsewhere). Every tensor is on the collective device; the ranks agree before the
    transfer, so an error while staging (out of memory) is the same error everywhere. On the writer,
    pieces are received straight into the gathered tensor (a dim-0 split: views of it), else each
    into one piece buffer and copied in: the writer holds the tensor and at most one piece."""
    import torch
    import torch.distributed as dist

    dtype = to_torch(info.dtype)
    error, full, staged, views = None, None, None, []
    try:
        if me in sources and me != writer:
            assert local is not None  # a source rank holds its piece
            staged = traffic.stage(local.detach()).contiguous()
        if me == writer and list(sources) == [me]:
            assert local is not None  # the writer is the one source: it holds the tensor
            full = local.detach()  # whole here already: nothing to receive
        elif me == writer:
            shapes = [tuple(info.holders[r]) for r in sources]
            dim = info.shard_dim or 0
            whole = list(shapes[0])
            whole[dim] = sum(s[dim] for s in shapes)
            full = torch.empty(whole, dtype=dtype, device=traffic.device)
            at = 0
            for r, shape in zip(sources, shapes):
                views.append((r, full.narrow(dim, at, shape[dim])))
                at += shape[dim]
    except Exception as e:  # every rank must hear of it before the transfer
        error = e
    traffic.agree(error)
    if me != writer:
        if staged is not None:
            traffic.exchange([(dist.isend, staged.reshape(-1).view(torch.uint8), writer)])
        return None
    for r, view in views:
        if r == me:
            assert local is not None  # the writer is one of the sources: it holds its piece
            view.copy_(local.detach())
            continue
        direct = view.is_contiguous()
        buf = view if direct else torch.empty(view.shape, dtype=dtype, device=traffic.device)
        traffic.exchange([(dist.irecv, buf.reshape(-1).view(torch.uint8), r)])  # bytes: every dtype travels
        if not direct:
            view.copy_(buf)
            del buf
    assert full is not None  # the writer built it above (or agree() raised)
    if info.padding is not None:  # only now, on the gathered tensor
        dim, origin, _ = info.padding
        full = full.narrow(dim, 0, origin)
    return full


def _blocks(full: "torch.Tensor", cast: Optional["torch.dtype"]) -> Iterator[memoryview]:
    """``full``'s bytes (cast), in blocks of whole leading-dim rows of about ``_BLOCK_BYTES``."""
    rows = full.shape[0] if full.dim() else 1
    if full.dim() == 0 or rows <= 1:
        yield own_bytes(full.reshape(-1), cast)
        return
    row_bytes = max(1, full[0].numel() * full.element_size())
    step = max(1, _BLOCK_BYTES // row_bytes)
    for a in range(0, rows, step):
        yield own_bytes(full[a:a + step], cast)


class _LocalTraffic:
    """One process: no collective, tensors stay where they are."""

    def __init__(self, local: Optional["torch.Tensor"]):
        self.device = local.device if local is not None else "cpu"

    def stage(self, t: "torch.Tensor") -> "torch.Tensor":
        return t

    def agree(self, error: Optional[BaseException]) -> None:
        if error is not None:
            raise error

    def exchange(self, ops: Sequence[Tuple[Callable[..., Any], "torch.Tensor", int]]) -> None:
        raise AssertionError("one process has no one to exchange with")


def live_plan(infos: Sequence[TensorInfo], module: "torch.nn.Module", *, dtype: Optional[str] = None) -> ExportPlan:
    """The plan for ``infos``: one :class:`~..plan.TensorPlan` per tensor, its one piece a
    :class:`~..plan.LivePiece` whose ``read(lo, hi, writer, dtype)`` runs on every rank once the writer
    has assigned the tensor to rank ``writer``: the writer receives the TP pieces from their
    holders (point to point), concatenates and unpads them, and yields the bytes; a holding rank
    sends its local piece to the writer; other ranks do nothing. Every rank must read the tensors
    in the same order (the writer's). ``dtype``: ``None`` keeps the training dtype;
    ``"fp32"``/``"bf16"``/``"fp16"`` casts floats, but the model class's fp32-kept modules
    (decided by :func:`~.passes.finish_plan`, the rule every plan gets).
    """
    import torch
    import torch.distributed as dist

    from ..comm import Traffic

    distributed = dist.is_available() and dist.is_initialized()
    me = dist.get_rank() if distributed else 0
    mine = dict(local_tensors(module))
    shared: Dict[str, Union[Traffic, _LocalTraffic]] = {}
    out: List[TensorPlan] = []
    for info in infos:
        local = mine.get(info.name)

        def read(lo: int, hi: int, writer: int, dtype: str, info: TensorInfo = info,
                 local: Optional["torch.Tensor"] = local) -> Iterator[memoryview]:
            if "traffic" not in shared:
                shared["traffic"] = Traffic() if distributed else _LocalTraffic(local)
            full = _gather(info, local, info.sources(writer), me, writer, shared["traffic"])
            if full is not None:
                cast = to_torch(dtype) if info.dtype in FLOATS else None
                if (lo, hi) == (0, math.prod(info.shape)):
                    yield from _blocks(full, cast)
                else:
                    yield own_bytes(full.reshape(-1)[lo:hi], cast)

        numel = math.prod(info.shape)
        out.append(TensorPlan(info.name, tuple(info.shape), info.dtype, [[LivePiece(read, 0, numel, info.dtype)]],
                              kind="live"))
    return finish_plan(ExportPlan("live", type(module).__name__, None, out), dtype, keep_fp32_of_model(module))
