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
from ...boxes import as_pieces
from ...plan import Chunk, Piece, StridedPieces, TensorPlan
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
        # id(rank files of a ZeRO-3 plan) [, what] -> (those files, their bases, the answer): see _strided
        self._strided_cache: Dict[object, tuple] = {}
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

    def _strided(self, pieces: StridedPieces) -> Optional[Tuple[int, list]]:
        """For a ZeRO-3 :class:`~...plan.StridedPieces` part: ``(elements every rank's partition holds
        from the part's flat-buffer base, [(element of that base in the partition, states) per rank])``,
        or None when some rank's base is not inside a partition. Computed once per plan (the rank
        files are shared by all its tensors), so no piece is made: a piece of it lies in rank ``r``'s
        partition exactly when ``local + chunk`` fits that room, which :meth:`_where` would find."""
        key = id(pieces.paths)
        hit = self._strided_cache.get(key)
        if hit is not None and hit[0] is pieces.paths and hit[1] is pieces.bases:
            return hit[2]
        per: Optional[List[Tuple[int, dict]]] = []
        room: Optional[int] = None
        for path, base in zip(pieces.paths, pieces.bases):
            found: Optional[Tuple[int, dict, int]] = None
            for start, end, ref, states in self._index.get(path, ()):
                if start <= base < end or start == base == end:
                    if not (base - start) % 4:
                        found = ((base - start) // 4, states, (end - base) // 4)
                    break
            if found is None:
                per = None
                break
            per.append((found[0], found[1]))  # type: ignore[union-attr]  # None only past the break
            room = found[2] if room is None else min(room, found[2])
        out = (room or 0, per) if per is not None else None
        self._strided_cache[key] = (pieces.paths, pieces.bases, out)
        return out

    def _strided_has(self, pieces: StridedPieces) -> bool:
        hit = self._strided(pieces)
        return hit is not None and pieces.local + pieces.chunk <= hit[0]

    def _strided_state(self, pieces: StridedPieces, name: str) -> StridedPieces:
        """``pieces`` moved to state ``name`` (the same elements of each rank's state tensor), still on demand."""
        if not self._strided_has(pieces):
            first = pieces[0]
            raise LayoutError(f"{first.path}: bytes at {first.offset} are not inside an fp32 partition")
        key = (id(pieces.paths), name)
        hit = self._strided_cache.get(key)
        if hit is None or hit[0] is not pieces.paths or hit[1] is not pieces.bases:
            _, per = self._strided(pieces)  # type: ignore[misc]  # not None: _strided_has said so
            refs = [states[name] for _, states in per]
            paths = tuple(ref.path for ref in refs)
            bases = tuple(ref.byte_range(elem, 0)[0] for ref, (elem, _) in zip(refs, per))
            dtypes = {ref.dtype for ref in refs}
            hit = (pieces.paths, pieces.bases, (paths, bases, dtypes.pop() if len(dtypes) == 1 else None))
            self._strided_cache[key] = hit
        paths, bases, dtype = hit[2]
        if dtype is None:  # (every state was checked to be of its partition's dtype: not reached)
            raise LayoutError(f"{paths[0]}: optimizer state {name} is of several dtypes across the ranks")
        return StridedPieces(paths, bases, pieces.local, pieces.chunk, pieces.start, pieces.stop, dtype)

    def _strided_scalar(self, pieces: StridedPieces, name: str):
        """The per-group value ``name`` when every rank of ``pieces``' plan holds the same one (checked
        once per plan, not once per piece); ``_DISAGREE`` when they do not or some rank's place is not
        known (:meth:`scalar` then walks the pieces and names the file that differs)."""
        key = (id(pieces.paths), "scalar", name)
        hit = self._strided_cache.get(key)
        if hit is None or hit[0] is not pieces.paths or hit[1] is not pieces.bases:
            found = self._strided(pieces) if self._strided_has(pieces) else None
            value = _DISAGREE
            if found is not None and found[1]:
                values = [states.get(name) for _, states in found[1]]
                if all(_same_scalar(values[0], v) for v in values[1:]):
                    value = values[0]
            hit = (pieces.paths, pieces.bases, value)
            self._strided_cache[key] = hit
        return hit[2]

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
        if t.parts and all(isinstance(part, StridedPieces) for part in t.parts):  # ZeRO-3: no piece made
            return any(len(part) for part in t.parts) and all(self._strided_has(part)  # type: ignore[arg-type]
                                                               for part in t.parts)
        pieces = [p for part in t.parts for p in part]
        return bool(pieces) and all(self._where(p) is not None for p in pieces)

    def state_plan(self, t: TensorPlan, name: str) -> TensorPlan:
        """The plan of state ``name`` of the trained parameter ``t``: ``t`` with every piece
        (slices, replicas, chunks) moved to the same elements of the state tensor."""
        if name not in self.tensor_names:
            raise KeyError(name)
        def move(pieces):
            if isinstance(pieces, StridedPieces):
                return self._strided_state(pieces, name)
            return [self._piece(p, name) for p in pieces]

        chunks = None
        if t.chunks is not None:
            chunks = [Chunk(as_pieces(move(c.pieces)), c.offsets, c.sizes) for c in t.chunks]
        return dataclasses.replace(t, parts=[move(part) for part in t.parts], replicas=[move(r) for r in t.replicas],
                                   chunks=chunks, module_check=None, tied_copies=[])

    def scalar(self, t: TensorPlan, name: str) -> Any:
        """The per-group value ``name`` (``step``) of ``t``'s group, the same in every file holding
        a piece of ``t`` (a TensorRef or a plain number); LayoutError when they differ."""
        if not t.replicas and t.parts and all(isinstance(part, StridedPieces) for part in t.parts):
            agreed = self._strided_scalar(t.parts[0], name)  # type: ignore[arg-type]
            if agreed is not _DISAGREE:
                return agreed
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


_DISAGREE = object()


def _show(v: Any) -> Any:
    return f"tensor at byte {v.byte_range()[0]}" if isinstance(v, TensorRef) else v


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, TensorRef) and isinstance(b, TensorRef):
        from ...mapped_files import MappedFiles

        with MappedFiles() as files:
            return a.dtype == b.dtype and a.shape == b.shape and \
                bytes(files.read(a.path, *a.byte_range())) == bytes(files.read(b.path, *b.byte_range()))
    return type(a) is type(b) and a == b

