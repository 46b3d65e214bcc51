"""Per-rank ``torch.save`` FSDP state dicts (hf_ckpt_integrations/sources/fsdp_rank_files/).

Engine cases (tests/engines/fsdp_rank_files.py, real torchrun processes on CPU/gloo): FSDP2 saved
as verl's ``FSDPCheckpointManager`` saves it (vocabulary 1001 on ``Shard(1)`` by verl's placement
function), FSDP2 x TP on a ("dp", "tp") mesh of 4 ranks, and as Accelerate's
``save_fsdp_model(use_dcp=False)`` saves FSDP2 and FSDP1 (ShardedTensor); each export bitwise
equal to the engine's own full state dict and loaded with ``from_pretrained``.

Fast: :func:`local_indices` against torch's own sharding of an index tensor; rank files whose
DTensors torch builds under a fake process group (1-D uneven, HSDP, FSDP x TP layouts and the
refusals); a LoRA actor's adapter.
"""

import itertools
import json

import pytest
import torch

from helpers import (assert_bitwise_equal, export, export_refused, hf_ckpt, load_hf_state, load_safetensors,
                    tampered_copy)
from hf_ckpt_integrations.sources.fsdp_rank_files import local_indices
from rank_files_build import synthetic_layouts, write_rank_files


# ---------------------------------------------------------------- placement arithmetic


def _torch_local(shape, mesh_shape, coord, placements):
    """The global flat indices rank ``coord`` holds, by torch's own split of an index tensor."""
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    t = torch.arange(int(torch.tensor(shape).prod())).view(shape)
    for mesh_dim, (kind, dim, factor) in enumerate(placements):
        if kind == "replicate":
            continue
        p = Shard(dim) if kind == "shard" else _StridedShard(dim, split_factor=factor)
        t = p._split_tensor(t, mesh_shape[mesh_dim], with_padding=False, contiguous=False)[0][coord[mesh_dim]]
    return t.reshape(-1).tolist()


LAYOUTS = [
    ((1001, 64), (2,), [("shard", 0, 0)]),
    ((1001, 64), (2,), [("shard", 1, 0)]),
    ((5, 3), (4,), [("shard", 0, 0)]),  # uneven: 2, 2, 1, 0 rows
    ((7, 6), (2, 2), [("replicate", -1, 0), ("shard", 0, 0)]),  # HSDP
    ((10, 6), (2, 2), [("shard", 0, 0), ("shard", 1, 0)]),
    ((10, 6), (2, 3), [("strided", 0, 3), ("shard", 0, 0)]),  # FSDP x TP on one dim
    ((9, 4), (2, 2), [("strided", 0, 2), ("shard", 0, 0)]),  # ... uneven
    ((8, 6), (2, 2), [("shard", 1, 0), ("shard", 0, 0)]),
]


@pytest.mark.parametrize("shape,mesh,placements", LAYOUTS, ids=[str(i) for i in range(len(LAYOUTS))])
def test_local_indices_are_torchs_own_split(shape, mesh, placements):
    for coord in itertools.product(*(range(n) for n in mesh)):
        idx = local_indices(shape, mesh, coord, placements)
        strides = [int(torch.tensor(shape[d + 1:]).prod()) for d in range(len(shape))]
        flat = [sum(i * s for i, s in zip(pos, strides)) for pos in itertools.product(*idx)]
        assert flat == _torch_local(shape, mesh, coord, placements), (coord, placements)


# ---------------------------------------------------------------- real saves


def _check_export(case, src, out, *args):
    r = export(src, out, *args)
    ref = load_safetensors(case / "reference.safetensors")
    got = load_safetensors(out / "model.safetensors")
    assert set(got) == set(ref) - ({"lm_head.weight"} if "lm_head.weight" not in got else set())
    assert_bitwise_equal(got, {k: v for k, v in ref.items() if k in got})
    assert all(got[k].dtype == torch.float32 for k in got)  # stored dtype kept (bf16 compute, fp32 params)
    assert_bitwise_equal(load_hf_state(out, torch.float32), ref)
    return r


@pytest.mark.parametrize("entry", ["ckpt", "ckpt/global_step_2", "ckpt/global_step_2/actor"])
def test_verl_export_is_the_engines_weights(engine_ckpt, tmp_path, entry):
    case = engine_ckpt("rank-verl")
    _check_export(case, case / entry, tmp_path / "out")  # config from actor/huggingface, no --config
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == \
        (case / "ckpt/global_step_2/actor/huggingface/tokenizer.json").read_bytes()


def test_fsdp_tp_diverged_copy_refused(engine_ckpt, tmp_path):
    """The two TP ranks of a DP group hold the same blocks of every tensor on the "dp" sub-mesh: a copy
    that differs from the one written is refused, naming its file."""
    name = "model.norm.weight"
    src = tampered_copy(engine_ckpt("rank-fsdp-tp") / "ckpt/global_step_2/actor", tmp_path,
                        "model_world_size_4_rank_1.pt", edit=lambda sd: sd[name]._local_tensor.add_(1),
                        weights_only=False, name="actor")
    export_refused(src, tmp_path / "out", match=("model_world_size_4_rank_1.pt", name, "replicas"))


def test_accelerate_use_dcp_false_export_is_the_engines_weights(engine_ckpt, tmp_path):
    case = engine_ckpt("rank-accelerate")
    _check_export(case, case / "state", tmp_path / "out", "--config", case / "config")


@pytest.fixture
def verl_actor(engine_ckpt, tmp_path):
    return tampered_copy(engine_ckpt("rank-verl") / "ckpt/global_step_2/actor", tmp_path, name="actor")


def test_missing_rank_file_refused(verl_actor, tmp_path):
    (verl_actor / "model_world_size_2_rank_1.pt").unlink()
    export_refused(verl_actor, tmp_path / "out", match=("model_world_size_2_rank_1.pt", "missing"))


def test_world_size_disagreeing_with_fsdp_config_refused(verl_actor, tmp_path):
    (verl_actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 4}))
    export_refused(verl_actor, tmp_path / "out", match=("fsdp_config.json", "world_size 4"))


def test_swapped_rank_files_refused(verl_actor, tmp_path):
    """Each file's mesh records its rank and coordinate: renamed files are not placed by their names."""
    a, b = verl_actor / "model_world_size_2_rank_0.pt", verl_actor / "model_world_size_2_rank_1.pt"
    a.rename(tmp_path / "t")
    b.rename(a)
    (tmp_path / "t").rename(b)
    export_refused(verl_actor, tmp_path / "out", match=("model_world_size_2_rank_0.pt", "renamed or mixed"))


def test_overlapping_shards_refused(verl_actor, tmp_path):
    """Two ranks holding the same shard (a copy of rank 0's file under rank 1's name, its recorded
    rank edited to match) leave a gap and an overlap: refused, never exported."""
    sd = torch.load(verl_actor / "model_world_size_2_rank_0.pt", weights_only=False)
    for v in sd.values():
        v._spec.mesh._rank = 1
    torch.save(sd, verl_actor / "model_world_size_2_rank_1.pt")
    export_refused(verl_actor, tmp_path / "out", match=("do not tile", "duplicated or from another save"))


def test_fsdp1_sharded_tensor_export_is_the_engines_weights(engine_ckpt, tmp_path):
    """FSDP1 SHARDED_STATE_DICT through Accelerate's save_fsdp_model(use_dcp=False): ShardedTensors."""
    case = engine_ckpt("rank-accelerate-fsdp1")
    _check_export(case, case / "state", tmp_path / "out", "--config", case / "config")
    info = json.loads(hf_ckpt("inspect", case / "state", "--json").stdout)
    assert info["placements"] == {"ShardedTensor": info["tensor_count"]}


def test_fsdp_tp_2d_mesh_export_is_the_engines_weights(engine_ckpt, tmp_path):
    """A ("dp", "tp") mesh: TP-sharded weights on both dims (_StridedShard over dp), the rest on the
    "dp" sub-mesh, held by both TP ranks of a DP group (copies, checked equal)."""
    case = engine_ckpt("rank-fsdp-tp")
    _check_export(case, case / "ckpt", tmp_path / "out")
    info = json.loads(hf_ckpt("inspect", case / "ckpt", "--json").stdout)
    assert info["mesh"] == [2, 2] and info["mesh_dim_names"] == ["dp", "tp"]
    assert set(info["placements"]) == {"Shard(0)", "Shard(0), Shard(1)", "_StridedShard(0, 2), Shard(0)"}


def test_partial_placement_refused(verl_actor, tmp_path):
    from torch.distributed.tensor import Partial

    for r in (0, 1):
        path = verl_actor / f"model_world_size_2_rank_{r}.pt"
        sd = torch.load(path, weights_only=False)
        sd["model.norm.weight"]._spec.placements = (Partial(),)
        torch.save(sd, path)
    export_refused(verl_actor, tmp_path / "out", match=("model_world_size_2_rank_0.pt", "Partial placement (per-rank partial sums"))


def test_getattr_of_anything_else_refused(tmp_path):
    """ShardedTensor's pickle calls getattr(ShardedTensor, "ProcessGroupState"); no other getattr."""
    import zipfile

    from hf_ckpt_integrations.errors import UnsafeCheckpointError
    from hf_ckpt_integrations.formats import torch_files
    from hf_ckpt_integrations.sources.fsdp_rank_files import ALLOWED

    pkl = (b"\x80\x02c__builtin__\ngetattr\nctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n"
           b"X\x08\x00\x00\x00__init__\x86R.")
    with zipfile.ZipFile(tmp_path / "a.pt", "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pkl)
    with pytest.raises(UnsafeCheckpointError, match="getattr"):
        torch_files.load(tmp_path / "a.pt", allowed=ALLOWED)


# ---------------------------------------------------------------- synthetic rank files (no engine run)


@pytest.mark.parametrize("layout", ["1d-rows", "1d-uneven", "hsdp", "fsdp-tp"])
def test_synthetic_layouts_export_bitwise(tmp_path, layout):
    from hf_ckpt_integrations import export_checkpoint

    mesh, tensors = synthetic_layouts()[layout]
    src = write_rank_files(tmp_path / "actor", tensors, mesh)
    export_checkpoint(str(src), str(tmp_path / "out"), weights_only=True)  # synthetic: no model config
    got = load_safetensors(tmp_path / "out" / "model.safetensors")
    assert_bitwise_equal(got, {n: full for n, (full, _) in tensors.items()})


def test_synthetic_diverged_replica_refused(tmp_path):
    mesh, tensors = synthetic_layouts()["hsdp"]
    src = write_rank_files(tmp_path / "actor", tensors, mesh,
                           local_of=lambda name, rank, t: t + 1 if (name, rank) == ("a", 3) else t)
    export_refused(src, tmp_path / "out", "--weights-only", match=("model_world_size_4_rank_3.pt",
                                                                   "its copy of a differs"))


def test_synthetic_partial_refused(tmp_path):
    from torch.distributed.tensor import Partial

    src = write_rank_files(tmp_path / "actor", {"a": (torch.ones(4, 2), [Partial()])}, (2,))
    export_refused(src, tmp_path / "out", match=("model_world_size_2_rank_0.pt", "Partial placement (per-rank partial sums"))


def test_synthetic_missing_rank_and_world_size_refused(tmp_path):
    mesh, tensors = synthetic_layouts()["1d-uneven"]
    src = write_rank_files(tmp_path / "actor", tensors, mesh)
    (src / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 2}))
    export_refused(src, tmp_path / "out", match=("fsdp_config.json", "world_size 2"))
    (src / "fsdp_config.json").unlink()
    (src / "model_world_size_4_rank_2.pt").unlink()
    export_refused(src, tmp_path / "out", match=("model_world_size_4_rank_2.pt", "missing"))


@pytest.mark.parametrize("rank", [0, 2])
def test_synthetic_shard_of_the_wrong_shape_refused(tmp_path, rank):
    """A local shard that is not what its placements cut (a file of another save) is refused; at rank 2,
    after rank 0 took the tensor as rows (.rows), by the general way's second reading."""
    mesh, tensors = synthetic_layouts()["1d-uneven"]
    src = write_rank_files(tmp_path / "actor", tensors, mesh,
                           local_of=lambda name, r, t: t[:1] if (name, r) == ("a", rank) else t)
    export_refused(src, tmp_path / "out", match=(f"model_world_size_4_rank_{rank}.pt", "placements Shard(0)"))


def test_shard0_tensors_are_planned_as_rows_of_every_rank_file(tmp_path, monkeypatch):
    """FSDP2's Shard(0) tensors become one StridedPieces each (no per-rank shards kept), rank 3's offsets
    shifted by its shorter shards before them; the pieces are the general placement's, one by one."""
    from hf_ckpt_integrations.boxes import StridedPieces
    from hf_ckpt_integrations.sources import fsdp_rank_files
    from hf_ckpt_integrations.sources.fsdp_rank_files import rows
    from hf_ckpt_integrations.sources.protocol import PlanContext

    mesh, tensors = synthetic_layouts()["1d-rows"]
    src = write_rank_files(tmp_path / "actor", tensors, mesh)
    got = {t.name: t for t in fsdp_rank_files.plan(PlanContext(path=str(src))).tensors}
    assert list(got) == list(tensors)
    assert {n for n, t in got.items() if isinstance(t.parts[0], StridedPieces)} == {"a", "c", "d", "e"}
    bases = got["d"].parts[0].bases
    assert bases[0] == bases[1] == bases[2] != bases[3], bases  # rank 3's file: a and c shorter before d
    monkeypatch.setattr(rows.RowShards, "take", lambda self, *args: False)  # every tensor the general way
    general = {t.name: t for t in fsdp_rank_files.plan(PlanContext(path=str(src))).tensors}
    assert not any(isinstance(t.parts[0], StridedPieces) for t in general.values())
    for name in ("a", "c", "d", "e"):
        assert list(got[name].flat_pieces()) == list(general[name].flat_pieces()), name


# ---------------------------------------------------------------- rank files read in worker processes (.workers)


def _plan_with(src, processes, monkeypatch):
    from hf_ckpt_integrations.sources import fsdp_rank_files
    from hf_ckpt_integrations.sources.protocol import PlanContext

    monkeypatch.setenv("HFCKPT_READ_PROCESSES", str(processes))
    return fsdp_rank_files.plan(PlanContext(path=str(src)))


def test_a_file_of_a_1024_rank_save_is_read(tmp_path):
    """torch 2.9+ pickles a DeviceMesh with one int per rank of the world (``_flatten_rank_map``),
    and every DTensor of a file shares the mesh: at 1,024 ranks the mesh was ~1,100 nodes, counted at
    each DTensor, so a file of 2,000 DTensors (2.2M nodes; a DeepSeek-V3 file: 50M) was refused as
    crafted. The mesh stand-in keeps only the fields the source reads."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from hf_ckpt_integrations.formats import torch_files
    from hf_ckpt_integrations.sources.fsdp_rank_files.stand_ins import ALLOWED

    world, rank, n = 1024, 5, 2000
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        assert len(mesh.__getstate__()["_flatten_rank_map"]) == world  # (what torch pickles, which the test is about)
        sd = {f"layers.{i}.w": DTensor.from_local(torch.full((1, 2), float(i)), mesh, [Shard(0)], run_check=False,
                                                  shape=torch.Size((world, 2)), stride=(2, 1)) for i in range(n)}
        torch.save(sd, tmp_path / "model_world_size_1024_rank_5.pt")
    finally:
        dist.destroy_process_group()
    loaded = torch_files.load(str(tmp_path / "model_world_size_1024_rank_5.pt"), allowed=ALLOWED)
    assert len(loaded) == n
    meshes = {id(t.spec.field("mesh")) for t in loaded.values()}
    assert len(meshes) == 1  # one mesh, shared, as torch pickled it
    got = loaded["layers.7.w"]
    assert (got.spec.field("mesh").field("_coordinate_on_dim"), got.spec.field("mesh").field("_rank")) == ((5,), 5)
    assert (got.local.shape, got.local.dtype, tuple(got.shape)) == ((1, 2), "F32", (world, 2))


@pytest.mark.parametrize("layout", ["1d-rows", "hsdp", "fsdp-tp"])
def test_worker_processes_plan_what_one_process_plans(tmp_path, monkeypatch, layout):
    """Ranks 1-3 read by 2 real worker processes: the same tensors, pieces (rank 3's shifted rows
    included), tied copies, notes and detail as reading every file here."""
    mesh, tensors = synthetic_layouts()[layout]
    src = write_rank_files(tmp_path / "actor", tensors, mesh)
    here, there = _plan_with(src, 0, monkeypatch), _plan_with(src, 2, monkeypatch)
    assert [t.name for t in here.tensors] == list(tensors)
    assert there.tensors == here.tensors
    assert (there.notes, there.detail) == (here.notes, here.detail)


@pytest.mark.parametrize("case", ["wrong-shape", "extra-name"])
def test_a_file_a_worker_refuses_is_refused_here_naming_it(tmp_path, monkeypatch, case):
    """A worker only says it could not read a rank: this process reads that file again and raises its
    own error for it (the lowest such rank), never a worker's word."""
    mesh, tensors = synthetic_layouts()["1d-uneven"]
    src = write_rank_files(tmp_path / "actor", tensors, mesh,
                           local_of=lambda name, r, t: t[:1] if (case, name, r) == ("wrong-shape", "a", 2) else t)
    if case == "extra-name":  # rank 3's file holds a tensor the others do not
        bad = torch.load(src / "model_world_size_4_rank_3.pt", weights_only=False)
        bad["stray"] = torch.zeros(1)
        torch.save(bad, src / "model_world_size_4_rank_3.pt")
    monkeypatch.setenv("HFCKPT_READ_PROCESSES", "2")
    match = ("model_world_size_4_rank_2.pt", "placements Shard(0)") if case == "wrong-shape" else \
        ("model_world_size_4_rank_3.pt", "stray is in one only")
    export_refused(src, tmp_path / "out", match=match)


def test_lost_workers_ranks_are_read_here(tmp_path, monkeypatch):
    """Workers that cannot start (here: no such entry module) deliver nothing; every rank is read here."""
    from hf_ckpt_integrations.sources.fsdp_rank_files import workers

    mesh, tensors = synthetic_layouts()["1d-rows"]
    src = write_rank_files(tmp_path / "actor", tensors, mesh)
    monkeypatch.setattr(workers, "_BOOT", "import hf_ckpt_integrations.no_such_module")
    lost = _plan_with(src, 2, monkeypatch)
    assert lost.tensors == _plan_with(src, 0, monkeypatch).tensors


def test_what_a_worker_prints_never_enters_its_answers(tmp_path, monkeypatch, caplog):
    """A sitecustomize (or .pth file, or import) that prints to stdout at the interpreter's start: the
    workers answer on a pipe of their own, so their answers are used, not read again here."""
    mesh, tensors = synthetic_layouts()["1d-rows"]
    src = write_rank_files(tmp_path / "actor", tensors, mesh)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.stdout.write('\\x00' * 64 + 'hello\\n')\n")
    monkeypatch.setenv("PYTHONPATH", str(site))
    with caplog.at_level("WARNING", logger="hf_ckpt_integrations.sources.fsdp_rank_files.workers"):
        printed = _plan_with(src, 2, monkeypatch)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert printed.tensors == _plan_with(src, 0, monkeypatch).tensors


def test_workers_exchange_plain_data_only(monkeypatch):
    import pickle

    from hf_ckpt_integrations.boxes import Piece
    from hf_ckpt_integrations.errors import OptionError
    from hf_ckpt_integrations.sources.fsdp_rank_files import workers

    plain = ({"a": ((2, 3), "float32", 0, 0)}, [(1, 64)], "x", 1.5, None, True, {"names", "sent", "as sets"})
    assert workers.plain_loads(pickle.dumps(plain)) == plain
    with pytest.raises(pickle.UnpicklingError, match="plain data only"):
        workers.plain_loads(pickle.dumps(Piece("p", 0, 1, "float32")))
    monkeypatch.setenv("HFCKPT_READ_PROCESSES", "3")
    assert workers.processes(2, 0.0) == 2  # never more workers than files
    monkeypatch.setenv("HFCKPT_READ_PROCESSES", "many")
    with pytest.raises(OptionError, match="HFCKPT_READ_PROCESSES='many'"):
        workers.processes(2, 0.0)
    monkeypatch.delenv("HFCKPT_READ_PROCESSES")
    assert workers.processes(1000, 0.001) == 0  # a small save: starting workers would cost more
    monkeypatch.setattr(workers.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert workers.processes(1000, 1.0) == workers.MAX_WORKERS
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's 4 ranks of one node each plan: 4 CPUs each
    assert workers.processes(1000, 1.0) == 4
