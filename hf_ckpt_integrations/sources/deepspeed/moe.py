"""DeepSpeed MoE (``deepspeed.moe.layer.MoE``) with expert parallelism under ZeRO-1/2.

What such a save holds (DeepSpeed ``engine._save_moe_checkpoint``, ``stage_1_and_2``'s MoE groups,
``utils/groups``):

- every expert's module weights in its own ``layer_{L}_expert_{E}_mp_rank_{MM}_model_states.pt``,
  named by the expert's global id ``E`` (``…deepspeed_moe.experts.deepspeed_experts.{E}.…``);
  ``mp_rank_{MM}_model_states.pt``'s module holds no expert;
- ``param_shapes`` is rank 0's: its expert groups name the *local* experts of expert-parallel
  rank 0 (``deepspeed_experts.{i}``, ``i < num_local``); every expert-parallel rank ``e`` has the
  same local structure, its local expert ``i`` being global expert ``e * num_local + i``;
- an expert group (``moe: True``) is flattened per expert-parallel rank and partitioned over that
  rank's expert-data-parallel group: ``partition_count[g]`` = world / ``ep_size`` ranks, while the
  dense groups are partitioned over every data-parallel rank;
- which global ranks form one expert-data-parallel group is not recorded. DeepSpeed builds it
  "E + D" by default (ranks ``e, e + ep, e + 2 ep, …``) or "D + E"
  (``use_data_before_expert_parallel_``: ranks ``e * count … (e + 1) * count - 1``). Each is tried
  and proven against the expert files' module weights; one that does not prove is never used.

The output names experts by their global id, as DeepSpeed's own expert files do.
"""

import os
import re
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ... import guards
from ...errors import LayoutError
from ...formats.torch_files import TensorRef
from .allowlist import load

from .fields import OptimFile

if TYPE_CHECKING:
    from ...plan import TensorPlan

__all__ = ["EXPERT_FILE_RE", "EXPERT_NAME_RE", "AUTOEP_NAME_RE", "Experts", "expert_name", "expert_files", "find_expert_files", "global_expert_name",
           "TOPOLOGIES", "plan_expert_group"]

EXPERT_FILE_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# prefix (through "deepspeed_experts."), expert id, the rest of the name
EXPERT_NAME_RE = re.compile(r"^(.*\.?deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..+)$")
# AutoEP (0.19.2+) writes the same file names, holding "{module}.experts.w1.{global id}" & co. (.autoep)
AUTOEP_NAME_RE = re.compile(r"^(.*\.)?experts\.w[123]\.\d+$")



def _expert_then_data(e: int, k: int, ep: int, count: int) -> int:
    """DeepSpeed's default: expert-data-parallel group ``e`` is ranks ``e, e + ep, e + 2 ep, ...``."""
    return k * ep + e


def _data_then_expert(e: int, k: int, ep: int, count: int) -> int:
    """``use_data_before_expert_parallel_``: group ``e`` is ranks ``e * count ... (e + 1) * count - 1``."""
    return e * count + k


# (name, the global rank of expert-parallel rank e's k-th expert-data-parallel rank given ep, count)
TOPOLOGIES: Tuple[Tuple[str, Callable[[int, int, int, int], int]], ...] = (
    ("expert-parallel ranks adjacent (DeepSpeed's default E + D)", _expert_then_data),
    ("data-parallel ranks adjacent (use_data_before_expert_parallel_)", _data_then_expert),
)


class Experts:
    """The expert files of one model-parallel rank: ``weights`` (global name -> module weight) and
    ``counts`` (MoE layer's name prefix -> its number of experts)."""

    def __init__(self, weights: Dict[str, TensorRef], counts: Dict[str, int], files: List[str]):
        self.weights = weights
        self.counts = counts
        self.files = files

    def __bool__(self) -> bool:
        return bool(self.files)


def expert_name(layer: int, expert: int, mp_rank: int) -> str:
    """The expert file name DeepSpeed writes (``engine._get_expert_ckpt_name``)."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def expert_files(tag_dir: str, names: List[str], mp_rank: int) -> Dict[int, Dict[int, str]]:
    """``{layer: {expert: path}}`` of ``mp_rank``'s expert files among ``names``; two files for one
    (layer, expert) are refused (:func:`~...guards.claim_file`)."""
    by_layer: Dict[int, Dict[int, str]] = {}
    for n in names:
        m = EXPERT_FILE_RE.match(n)
        if m and int(m.group(3)) == mp_rank:
            layer, expert = int(m.group(1)), int(m.group(2))
            guards.claim_file(by_layer.setdefault(layer, {}), expert, os.path.join(tag_dir, n), where=tag_dir,
                              what=f"MoE layer {layer}'s expert", canonical=expert_name(layer, expert, mp_rank))
    return by_layer


def find_expert_files(tag_dir: str, names: List[str], mp_rank: int) -> Experts:
    """Read the ``layer_L_expert_E_mp_rank_MM_model_states.pt`` files among ``names`` (the tag
    dir's listing) for ``mp_rank``. Every layer's experts must be 0..N-1, each file naming only
    its own expert. Raises :class:`LayoutError` naming the file otherwise."""
    by_layer = expert_files(tag_dir, names, mp_rank)
    weights: Dict[str, TensorRef] = {}
    counts: Dict[str, int] = {}
    files: List[str] = []
    for layer in sorted(by_layer):
        ids = sorted(by_layer[layer])
        if ids != list(range(len(ids))):
            missing = sorted(set(range(ids[-1] + 1)) - set(ids))[:8]
            raise LayoutError(f"{tag_dir}: MoE layer {layer}'s expert files layer_{layer}_expert_E_mp_rank_"
                              f"{mp_rank:02d}_model_states.pt miss experts {missing}; copy the whole tag "
                              "directory again")
        prefixes = set()
        for expert in ids:
            path = by_layer[layer][expert]
            files.append(path)
            state = load(path)
            if not isinstance(state, dict) or not state:
                raise LayoutError(f"{path}: not a DeepSpeed expert file (no expert weights); the file is corrupt")
            for key, ref in state.items():
                if isinstance(key, str) and AUTOEP_NAME_RE.match(key):
                    # (AutoEP saves are read by .autoep; here one sits among deepspeed.moe expert files)
                    raise LayoutError(f"{path}: a DeepSpeed AutoEP expert file ({key!r}) among deepspeed.moe "
                                      "expert files; files from different saves are mixed: copy one save's tag "
                                      "directory again")
                m = EXPERT_NAME_RE.match(key) if isinstance(key, str) else None
                if m is None or int(m.group(2)) != expert or not isinstance(ref, TensorRef):
                    raise LayoutError(f"{path}: holds {key!r}, not a weight of expert {expert}; the file was "
                                      "renamed or is corrupt: copy the tag directory again")
                prefixes.add(m.group(1))
                weights[key] = ref
        for prefix in prefixes:
            counts[prefix] = len(ids)
    return Experts(weights, counts, files)


def global_expert_name(local_name: str, ep_rank: int, ep: int, counts: Dict[str, int], path: str) -> str:
    """``local_name`` (a parameter of a local expert, as ``param_shapes`` names it) as global expert
    ``ep_rank * num_local + i`` names it, ``num_local`` = the layer's experts / ``ep``."""
    m = EXPERT_NAME_RE.match(local_name)
    if m is None or m.group(1) not in counts:
        raise LayoutError(f"{path}: the expert parameter group holds {local_name!r}, which no "
                          "layer_*_expert_*_model_states.pt file names; expert files are missing or from "
                          "another save: copy the whole tag directory again")
    total = counts[m.group(1)]
    local = int(m.group(2))
    if total % ep or local >= total // ep:
        raise LayoutError(f"{path}: {local_name!r} is local expert {local} of a layer with {total} expert files "
                          f"over {ep} expert-parallel ranks; expert files are missing or come from another save: "
                          "copy the whole tag directory again")
    return f"{m.group(1)}{ep_rank * (total // ep) + local}{m.group(3)}"


def plan_expert_group(ranks: Mapping[int, OptimFile], group: int, names: List[str],
                      shapes: Sequence[Tuple[int, ...]], count: Optional[int], model_path: str,
                      tensors: Dict[str, "TensorPlan"], experts: Experts, notes: List[str], *,
                      plan_group: Callable[..., None]) -> None:
    """Plan expert parameter group ``group`` (partitioned over ``count`` expert-data-parallel ranks)
    of every expert-parallel rank into ``tensors``, by global expert name. ``ranks``: every
    data-parallel rank's :class:`~.rank_files.RankFile`; ``names``/``shapes``: the group as
    ``param_shapes`` records it (local experts); ``plan_group``: the ZeRO-1/2 group planner
    (:func:`.zero12.plan_group`, which places and proves one group's partitions). Raises
    :class:`LayoutError` when no topology proves."""
    dp = len(ranks)
    if not isinstance(count, int) or count <= 0 or dp % count:
        raise LayoutError(f"{ranks[0].path}: records partition_count {count!r} for parameter group {group}, "
                          f"which does not divide the {dp} data-parallel rank files; files from different "
                          "saves are mixed: copy one save's tag directory again")
    ep = dp // count
    out_names = [[global_expert_name(n, e, ep, experts.counts, model_path) for n in names] for e in range(ep)]
    copies = [{n: experts.weights.get(g) for n, g in zip(names, out_names[e])} for e in range(ep)]
    # Every master must be proven against its expert's weights: without them any rank order "proves".
    absent = [g for e in range(ep) for n, g in zip(names, out_names[e]) if copies[e][n] is None]
    if absent:
        raise LayoutError(f"{model_path}: no layer_*_expert_* file holds {absent[:3]}; expert files are "
                          "missing or from another save: copy the whole tag directory again")
    failures = []
    for label, rank_of in TOPOLOGIES:
        planned: Dict = {}
        try:
            for e in range(ep):
                members = {k: ranks[rank_of(e, k, ep, count)] for k in range(count)}
                plan_group(members, group, names, shapes, model_path, copies[e], planned, notes,
                           names_out=out_names[e])
        except LayoutError as err:
            failures.append((label, err))
            continue
        tensors.update(planned)
        notes.append(f"MoE: parameter group {group} holds experts over {ep} expert-parallel ranks, each "
                     f"partitioned over {count} expert-data-parallel ranks ({label}); experts are named by "
                     "their global id, as the layer_*_expert_* files name them")
        return
    raise LayoutError(f"{model_path}: a DeepSpeed MoE save (expert group {group} over {ep} expert-parallel x "
                      f"{count} expert-data-parallel ranks) whose fp32 partitions match the expert files' weights "
                      f"in no rank order DeepSpeed builds ({'; '.join(label for label, _ in failures)}); first "
                      f"disagreement: {failures[0][1]}")
