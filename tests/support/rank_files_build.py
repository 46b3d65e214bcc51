"""Per-rank ``torch.save`` FSDP2 state dicts built in-process (a fake process group, no engine): verl's
file names around DTensors torch itself cuts, for the synthetic tests of the FSDP rank-file source."""

import torch


def write_rank_files(directory, tensors, mesh_shape, *, world=None, local_of=None):
    """verl-named rank files of ``tensors`` (``{name: (full tensor, placements)}``) as FSDP would hold
    them on a ``mesh_shape`` mesh: each rank's DTensor built by torch (a fake process group, one rank at
    a time) around the local shard torch's own placements cut. ``local_of(name, rank, local)``: what a
    rank saves instead (a damaged save)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = world or int(torch.tensor(mesh_shape).prod())
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = init_device_mesh("cpu", tuple(mesh_shape))
            coord = mesh.get_coordinate()
            sd = {}
            for name, (full, placements) in tensors.items():
                local = full
                for mesh_dim, p in enumerate(placements):
                    if hasattr(p, "dim"):  # Shard and _StridedShard (not a Shard subclass in torch 2.13)
                        local = p._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)[0][coord[mesh_dim]]
                local = local.contiguous().clone()
                if local_of is not None:
                    local = local_of(name, rank, local)
                sd[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                                              stride=full.stride())
            torch.save(sd, directory / f"model_world_size_{world}_rank_{rank}.pt")
        finally:
            dist.destroy_process_group()
    return directory


def synthetic_layouts():
    """``{layout: (mesh shape, {name: (full tensor, placements)})}``: rows uneven over 4 ranks, HSDP, FSDP x TP."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(7, 6, generator=g), torch.randn(9, 4, generator=g).to(torch.bfloat16)
    c, d, e = torch.randn(3, 5, generator=g), torch.randn(8, 3, generator=g), torch.randn(5, generator=g)
    return {
        # FSDP2's default (every tensor Shard(0)): uneven (2, 2, 2, 1 rows) and empty (1, 1, 1, 0) shards shift
        # the later tensors' offsets in rank 3's file; b (Shard(1)) between them is placed the general way
        "1d-rows": ((4,), {"a": (a, [Shard(0)]), "c": (c, [Shard(0)]), "b": (b, [Shard(1)]),
                           "d": (d, [Shard(0)]), "e": (e, [Shard(0)])}),
        "1d-uneven": ((4,), {"a": (a, [Shard(0)]), "b": (b, [Shard(1)])}),  # 2, 2, 2, 1 rows; 1-column shards
        "hsdp": ((2, 2), {"a": (a, [Replicate(), Shard(0)]), "b": (b, [Replicate(), Shard(1)])}),
        "fsdp-tp": ((2, 2), {"a": (a, [_StridedShard(0, split_factor=2), Shard(0)]), "b": (b, [Shard(0), Shard(1)])}),
    }
