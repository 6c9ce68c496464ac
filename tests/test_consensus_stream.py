"""A step's consensus does not wait for the kernels already queued on the device.

Its flags are host values, so on CUDA the all-reduce and its read run on a side stream
(:func:`consensus.beside_queued_work`). Each test runs on gloo ranks sharing one GPU: every rank queues a kernel that
spins for about a second (``torch.cuda._sleep``, 2³¹ clock cycles: over a second at the H100's and H200's top
clock of 1.98 GHz) on its current stream, runs a consensus, checks its result, and checks that the spinning
kernel is still running when the consensus has returned. A consensus that waited for the kernels queued on the
device would find that stream idle. A first consensus before the kernel is queued makes the one-time setup (the
side stream, gloo's pinned buffers) happen outside the measured one.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import requires_cuda, run_distributed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import Muon
from dtensor_muon.distributed import consensus
from dtensor_muon.engine import preflight

pytestmark = [requires_cuda, pytest.mark.slow]

SPIN_CYCLES = 2**31


def any_rank_beside_a_spinning_kernel(rank: int, world_size: int) -> dict[str, Any]:
    """``any_rank`` with rank 1's flag set, once before and once after queueing the spinning kernel."""
    mesh = init_device_mesh("cuda", (world_size,))
    groups = [(mesh.get_group(), torch.device("cuda", 0))]
    warm = consensus.any_rank(False, groups)
    torch.cuda._sleep(SPIN_CYCLES)
    flag = consensus.any_rank(rank == 1, groups)
    spinning = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"warm": warm, "flag": flag, "spinning": spinning}


def test_any_rank_returns_while_queued_kernels_run():
    for rank, r in enumerate(run_distributed(any_rank_beside_a_spinning_kernel, 2, device="cuda", timeout=120)):
        assert r["warm"] is False and r["flag"] is True, (rank, r)
        assert r["spinning"], f"rank {rank}: any_rank waited for the kernel queued before it"


def agree_beside_a_spinning_kernel(rank: int, world_size: int) -> dict[str, Any]:
    """The step's first consensus (:func:`preflight.agree`) over the engine's own groups, where only rank 1 has
    a gradient for the first parameter: every rank must learn that it is active."""
    mesh = init_device_mesh("cuda", (world_size,))
    gen = torch.Generator().manual_seed(0)
    params = [
        (f"w{k}", nn.Parameter(distribute_tensor(torch.randn(8, 6, generator=gen).cuda(), mesh, [Shard(0)])))
        for k in range(2)
    ]
    engine = Muon(params, lr=0.02)._engine
    first = engine.entries[0].index
    grads = {e.index: torch.ones(1, device="cuda") if rank == 1 and e.index == first else None for e in engine.entries}
    warm = preflight.agree(engine.consensus_groups, engine.entries, dict(grads), None, {}, False)
    torch.cuda._sleep(SPIN_CYCLES)
    active, nonfinite, failed = preflight.agree(engine.consensus_groups, engine.entries, grads, None, {}, False)
    spinning = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"warm": warm[0], "active": active, "first": first, "outcome": (nonfinite, failed), "spinning": spinning}


def test_the_step_consensus_returns_while_queued_kernels_run():
    for rank, r in enumerate(run_distributed(agree_beside_a_spinning_kernel, 2, device="cuda", timeout=120)):
        assert r["warm"] == {r["first"]} and r["active"] == {r["first"]}, (rank, r)
        assert r["outcome"] == (False, None), (rank, r)
        assert r["spinning"], f"rank {rank}: the step's consensus waited for the kernel queued before it"
