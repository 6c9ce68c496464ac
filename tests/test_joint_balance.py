"""Plans of several meshes over the same ranks (torchtitan's dense mesh and its (dp, ep) expert mesh) are
balanced together: each next plan places its units given the loads of the ones before, on real gloo ranks."""

import torch
from dist_harness import run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import Muon
from dtensor_muon.plan.placement import Owned


def owners_over_two_meshes(rank: int, world_size: int) -> dict:
    """One 64×64 matrix on a 1-D mesh of the 4 ranks and three 64×64 experts on a (2, 2) mesh of the same
    ranks, every matrix split by rows over all ranks (so each is sent to an owner): the owners of the four."""
    torch.manual_seed(0)
    flat = init_device_mesh("cpu", (world_size,))
    experts = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "ep"))
    dense = nn.Parameter(distribute_tensor(torch.randn(64, 64), flat, [Shard(0)]))
    stacked = nn.Parameter(distribute_tensor(torch.randn(3, 64, 64), experts, [Shard(1), Shard(1)]))
    opt = Muon(
        [("layers.0.w", dense), ("layers.0.moe.experts.w1", stacked)], lr=0.02, ns_dtype=torch.float32, wire_dtype=None
    )
    for p in (dense, stacked):
        p.grad = torch.ones_like(p)
    opt.step()
    meshes = opt._engine.meshes
    owners = [u.placement.rank for work in meshes for u in work.plan.units if isinstance(u.placement, Owned)]
    flops = [sum(work.plan.rank_flops[r] for work in meshes) for r in range(world_size)]
    return {"owners": owners, "flops": flops, "meshes": len(meshes)}


def test_a_second_meshs_plan_avoids_the_ranks_the_first_one_loaded():
    """Alone, each plan starts at rank 0: the dense matrix and one expert would both go to rank 0 (two
    matrices there, none on rank 3). Balanced together, each rank owns one of the four."""
    results = run_distributed(owners_over_two_meshes, 4, timeout=120)
    for got in results:
        assert got == results[0]  # every rank built the same plans
    assert results[0]["meshes"] == 2
    assert sorted(results[0]["owners"]) == [0, 1, 2, 3]
    assert len(set(results[0]["flops"])) == 1
