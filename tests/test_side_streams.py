"""Work that follows the ranks, not the kernels already queued on the device: a step's consensus, and a return
exchange packed to be launched later (:mod:`dtensor_muon.distributed.side_streams`).

The consensus flags are host values, so on CUDA the all-reduce and its read run on a side stream. A return
exchange is packed on the current stream and launched after every rank's directions succeeded, from a side stream
that waits for its packing alone. Each test runs on gloo ranks sharing one GPU: every rank queues a kernel that
spins for about a second (``torch.cuda._sleep``, 2³¹ clock cycles: over a second at the H100's and H200's top
clock of 1.98 GHz) on its current stream, runs the collective, checks its result, and checks that the spinning
kernel is still running when the collective has returned. One that waited for the kernels queued on the device
would find that stream idle. A first collective before the kernel is queued makes the one-time setup (the side
stream, gloo's pinned buffers) happen outside the measured one.
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
from dtensor_muon.distributed.exchange import mesh_group, pack_all_to_all
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


def packed_exchange_beside_a_spinning_kernel(rank: int, world_size: int) -> dict[str, Any]:
    """Pack an all-to-all to be launched later (rank r sends ``[10·r + d] * (d + 1)`` to rank d), queue the
    spinning kernel, then launch and wait: the exchange must complete, with the values packed, while the kernel
    still runs."""
    mesh = init_device_mesh("cuda", (world_size,))
    comm = mesh_group(mesh, rank)
    device = torch.device("cuda", 0)

    def exchange(spin: bool) -> tuple[dict[int, list[float]], bool]:
        pieces = {d: torch.full((d + 1,), 10.0 * rank + d, device=device) for d in range(world_size)}
        recv = {s: rank + 1 for s in range(world_size)}
        packed = pack_all_to_all(
            comm, {d: [p] for d, p in pieces.items()}, recv, torch.float32, device, launched_later=True
        )
        if spin:
            torch.cuda._sleep(SPIN_CYCLES)
        got = packed.start().wait()
        spinning = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        return {s: t.tolist() for s, t in got.items()}, spinning

    warm, _ = exchange(spin=False)
    got, spinning = exchange(spin=True)
    return {"warm": warm, "got": got, "spinning": spinning}


def test_a_packed_exchange_follows_its_packing_not_the_kernels_queued_after_it():
    for rank, r in enumerate(run_distributed(packed_exchange_beside_a_spinning_kernel, 2, device="cuda", timeout=120)):
        want = {s: [10.0 * s + rank] * (rank + 1) for s in range(2)}
        assert r["warm"] == want and r["got"] == want, (rank, r)
        assert r["spinning"], f"rank {rank}: the packed exchange waited for the kernel queued after its packing"
