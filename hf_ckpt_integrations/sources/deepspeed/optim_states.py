"""The optimizer states saved beside the fp32 masters, placed exactly as the masters are.

Every ZeRO optimizer file holds, per parameter group (ZeRO-3: per sub-group), one flat fp32
partition and the base optimizer's state for that partition: flat tensors of the same length
(Adam's ``exp_avg``, ``exp_avg_sq``; ``max_exp_avg_sq``, ``momentum_buffer``... for others) and
per-group scalars (``step``). ZeRO-1/2 keep them under ``base_optimizer_state`` next to
``single_partition_of_fp32_groups``, ZeRO-3 under ``optimizer_state_dict`` next to
``fp32_flat_groups``; both drop the same padding from the states as from the partition.

So a state of a parameter lies at the same element offsets of its group's state tensor as the
parameter's fp32 master lies in the partition: :meth:`OptimizerStates.state_plan` takes the
master's :class:`~...plan.TensorPlan` (placed by :mod:`.zero12`/:mod:`.zero3`, merged by
:mod:`.tp_merge`, proven against the module weights) and points each piece at the state tensor
instead. Only metadata is read (the same allowlisted unpickler), never a tensor.
"""

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ...errors import LayoutError, short_repr
from ...formats.torch_files import TensorRef
from ...plan import Chunk, Piece, TensorPlan
from .fields import OptimFile
from .rank_files import find_rank_files

__all__ = ["OptimizerStates", "state_fields"]


def state_fields(osd: Mapping[str, Any]) -> Tuple[list, dict, list]:
    """``(fp32 partitions, {group: {state name: value}}, param_groups)`` of one optimizer file's
    ``optimizer_state_dict`` (ZeRO-1/2 or ZeRO-3 layout); LayoutError when the file holds none."""
    if "fp32_flat_groups" in osd:  # ZeRO-3
        fp32, base = osd.get("fp32_flat_groups"), osd.get("optimizer_state_dict")
    else:
        fp32, base = osd.get("single_partition_of_fp32_groups"), osd.get("base_optimizer_state")
    state = base.get("state") if isinstance(base, dict) else None
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(fp32, list) or not isinstance(state, dict) or not isinstance(groups, list):
        raise LayoutError("no optimizer state beside the fp32 partitions (base_optimizer_state / "
                          "optimizer_state_dict); the save was made without optimizer states")
    return fp32, state, groups


class OptimizerStates:
    """The optimizer states of every rank file of ``tag_dir``.

    ``tensor_names``: the per-element states (same length as the fp32 partition; e.g.
    ``["exp_avg", "exp_avg_sq"]``), ``scalar_names``: per-group values (``["step"]``), in the
    order the optimizer holds them. ``param_groups``: the first file's ``param_groups`` (the
    optimizer hyperparameters). ``fields``: the first file's ``optimizer_state_dict``."""

    def __init__(self, tag_dir: str, optim: Optional[Mapping[int, Mapping[int, OptimFile]]] = None):
        # ``optim[mp][dp]``: files with ``path`` and ``osd`` (a pipeline save's, from its own reader)
        if optim is None:
            optim, _ = find_rank_files(tag_dir)
        # path -> [(first byte, end byte, fp32 ref, {state name: value})]: where each partition lies
        self._index: Dict[str, List[tuple]] = {}
        self.tensor_names: List[str] = []
        self.scalar_names: List[str] = []
        self.param_groups = None
        self.fields = None
        for mp in sorted(optim):
            for dp in sorted(optim[mp]):
                rank = optim[mp][dp]
                try:
                    fp32, state, groups = state_fields(rank.osd)
                except LayoutError as e:
                    raise LayoutError(f"{rank.path}: {e}") from None
                if self.fields is None:
                    self.fields, self.param_groups = rank.osd, groups
                for g, ref in enumerate(fp32):
                    states = state.get(g)
                    if not isinstance(ref, TensorRef) or not isinstance(states, dict):
                        raise LayoutError(f"{rank.path}: parameter group {g} has no optimizer state "
                                          f"({short_repr(states)}); the file is corrupt or from another optimizer")
                    # A state tensor covers the partition element for element; the last rank's keeps the
                    # group's alignment padding at its end, which the saved partition drops.
                    pads = rank.osd.get("group_paddings")
                    pad = pads[g] if isinstance(pads, list) and g < len(pads) and type(pads[g]) is int else 0
                    tensors = [k for k, v in states.items() if isinstance(v, TensorRef) and v.shape != ()
                               and v.numel in (ref.numel, ref.numel + pad)]
                    scalars = [k for k in states if k not in tensors]
                    if not self.tensor_names and not self.scalar_names:
                        self.tensor_names, self.scalar_names = tensors, scalars
                    # (the order of a state dict's keys varies between files of one save: 0.10 puts step first)
                    if set(tensors) != set(self.tensor_names) or set(scalars) != set(self.scalar_names):
                        raise LayoutError(f"{rank.path}: parameter group {g} holds optimizer states {tensors + scalars}, "
                                          f"other files {self.tensor_names + self.scalar_names}; files from different "
                                          "saves are mixed: copy one save's tag directory again")
                    for k in tensors:
                        if states[k].dtype != ref.dtype or not states[k].is_contiguous():
                            raise LayoutError(f"{rank.path}: optimizer state {k} of group {g} is not a flat "
                                              f"{ref.dtype} tensor; not a layout this reader knows")
                    start, nbytes = ref.byte_range()
                    self._index.setdefault(ref.path, []).append((start, start + nbytes, ref, states))

    def _where(self, piece: Piece) -> Optional[Tuple[int, Dict[str, Any]]]:
        for start, end, ref, states in self._index.get(piece.path, ()):
            if start <= piece.offset < end:
                if piece.offset + piece.numel * 4 > end or (piece.offset - start) % 4:
                    break
                return (piece.offset - start) // 4, states
        return None

    def _piece(self, piece: Piece, name: str) -> Piece:
        hit = self._where(piece)
        if hit is None:
            raise LayoutError(f"{piece.path}: bytes at {piece.offset} are not inside an fp32 partition")
        elem, states = hit
        ref = states[name]
        offset, _ = ref.byte_range(elem, piece.numel)
        return Piece(ref.path, offset, piece.numel, ref.dtype)

    def has_states(self, t: TensorPlan) -> bool:
        """Whether ``t``'s pieces are fp32 master partitions (trained parameters), as opposed to
        frozen parameters or buffers, which have no optimizer state."""
        pieces = [p for part in t.parts for p in part]
        return bool(pieces) and all(self._where(p) is not None for p in pieces)

    def state_plan(self, t: TensorPlan, name: str) -> TensorPlan:
        """The plan of state ``name`` of the trained parameter ``t``: ``t`` with every piece
        (slices, replicas, chunks) moved to the same elements of the state tensor."""
        if name not in self.tensor_names:
            raise KeyError(name)
        move = lambda pieces: [self._piece(p, name) for p in pieces]  # noqa: E731
        chunks = None
        if t.chunks is not None:
            chunks = [Chunk(tuple(move(c.pieces)), c.offsets, c.sizes) for c in t.chunks]
        return dataclasses.replace(t, parts=[move(part) for part in t.parts], replicas=[move(r) for r in t.replicas],
                                   chunks=chunks, module_check=None, tied_copies=[])

    def scalar(self, t: TensorPlan, name: str) -> Any:
        """The per-group value ``name`` (``step``) of ``t``'s group, the same in every file holding
        a piece of ``t`` (a TensorRef or a plain number); LayoutError when they differ."""
        values = []
        for p in [p for part in t.parts for p in part] + [p for r in t.replicas for p in r]:
            hit = self._where(p)
            if hit is not None:
                values.append((p.path, hit[1].get(name)))
        if not values:
            return None
        first = values[0][1]
        for path, v in values[1:]:
            if not _same_scalar(first, v):
                raise LayoutError(f"{path}: optimizer {name} of {t.name} is {short_repr(_show(v))}, but "
                                  f"{values[0][0]} says {short_repr(_show(first))}; files from different saves are "
                                  "mixed: copy one save's tag directory again")
        return first


def _show(v: Any) -> Any:
    return f"tensor at byte {v.byte_range()[0]}" if isinstance(v, TensorRef) else v


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, TensorRef) and isinstance(b, TensorRef):
        from ...mapped_files import MappedFiles

        with MappedFiles() as files:
            return a.dtype == b.dtype and a.shape == b.shape and \
                bytes(files.read(a.path, *a.byte_range())) == bytes(files.read(b.path, *b.byte_range()))
    return type(a) is type(b) and a == b

