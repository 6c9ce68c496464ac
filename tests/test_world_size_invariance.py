"""Results do not depend on the world size: the batches an owner computes are fixed by the model.

24 experts of 12×7 in float32 Newton–Schulz next to a dense matrix: batched matrix products are not
batch-size invariant (on this CPU, Newton–Schulz of six such matrices stacked differs from that of three
stacked pairs by up to 2.7e-7 with one thread), so an engine that batched whatever same-shape matrices a rank
happened to hold (8 experts per rank at 3 ranks, 5/5/5/5/4 at 5) differed from one process, which stacked all
24 (by 2.4e-7 at 5 ranks). Now the experts form fixed units of 2 (24 / 8 per unit, rounded down to a power of two): whole on each
rank at 3 ranks, and straddling ranks 0 and 1 (experts 4 and 5), 1 and 2, … at 5, where they travel to owners.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_harness import full_tensor, one_thread, requires_cuda, run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import SOAP, Muon, NorMuon

SHAPES = [("layers.0.moe.experts", (24, 12, 7)), ("layers.0.attention.wq", (64, 256))]
CPU_OPTIMIZERS = {
    "Muon": (Muon, dict(lr=0.02, ns_dtype=torch.float32, wire_dtype=torch.float32)),
    "SOAP-cholqr": (SOAP, dict(lr=0.02, basis="cholqr", precondition_frequency=2)),
}
"""SOAP with basis="cholqr" takes a unit's experts as one batch (factors, refresh and Adam as [B, m, n]
products), so its units must be as fixed as Muon's; a refresh every 2 steps puts both kinds of step in 3."""
STEPS = 3


def initial() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(name, torch.randn(shape, generator=g)) for name, shape in SHAPES]


def gradient(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(shape, generator=g) for _, shape in SHAPES]


@functools.cache
def one_process(optimizer: str) -> list[torch.Tensor]:
    """The reference, computed once per pytest run on one thread as the gloo workers run (the test process's
    thread count is put back after)."""
    front, options = CPU_OPTIMIZERS[optimizer]
    with one_thread():
        params = [(n, p.clone().requires_grad_()) for n, p in initial()]
        opt = front(params, **options)
        for step in range(STEPS):
            for (_, p), g in zip(params, gradient(step)):
                p.grad = g
            opt.step()
    return [p.detach() for _, p in params]


def sharded(rank: int, world_size: int, optimizer: str) -> list[torch.Tensor]:
    front, options = CPU_OPTIMIZERS[optimizer]
    mesh = init_device_mesh("cpu", (world_size,))
    params = [(n, torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]))) for n, p in initial()]
    opt = front(params, **options)
    for step in range(STEPS):
        for (_, p), g in zip(params, gradient(step)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    return [p.full_tensor() for _, p in params]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", sorted(CPU_OPTIMIZERS))
@pytest.mark.parametrize("world_size", [3, 5])
def test_experts_equal_one_process_bitwise_at_3_and_5_ranks(world_size, optimizer):
    want = one_process(optimizer)
    got = run_distributed(sharded, world_size, optimizer)[0]
    for (name, _), a, b in zip(SHAPES, got, want):
        assert torch.equal(a, b), f"{name}: max |Δ| {float((a - b).abs().max()):.3e} at {world_size} ranks"


# ---------------------------------------------------------------- on one GPU
GPU_SHAPES = [
    ("layers.0.moe.experts", (8, 768, 2048)),  # a stack of Qwen3-30B-A3B-sized experts: Gram Newton–Schulz
    ("layers.0.attention.wq", (2048, 4096)),  # the GPU backend's Triton products
    ("layers.0.feed_forward.w1", (8192, 4096)),  # tall: transposed, the SYRK products
]
GPU_STEPS = 3
GPU_OPTIMIZERS = {"Muon": Muon, "NorMuon": NorMuon, "SOAP": SOAP}
"""Default options: bf16 Newton–Schulz with the bf16 wire, CUDA graphs on owners (Muon, NorMuon); SOAP's
fp32 wire and its per-step eigenbasis refresh."""


def gpu_initial() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(name, torch.randn(shape, generator=g) / shape[-1] ** 0.5) for name, shape in GPU_SHAPES]


def gpu_gradient(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return [torch.randn(shape, generator=g) for _, shape in GPU_SHAPES]


@functools.cache
def gpu_one_process(name: str) -> list[torch.Tensor]:
    params = [(n, p.cuda().requires_grad_()) for n, p in gpu_initial()]
    opt = GPU_OPTIMIZERS[name](params)
    for step in range(GPU_STEPS):
        for (_, p), g in zip(params, gpu_gradient(step)):
            p.grad = g.cuda()
        opt.step()
    return [p.detach().cpu() for _, p in params]


def gpu_sharded(rank: int, world_size: int, name: str) -> list[torch.Tensor]:
    mesh = init_device_mesh("cuda", (world_size,))
    params = [(n, torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]))) for n, p in gpu_initial()]
    opt = GPU_OPTIMIZERS[name](params)
    for step in range(GPU_STEPS):
        for (_, p), g in zip(params, gpu_gradient(step)):
            p.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    return [full_tensor(p) for _, p in params]


@requires_cuda
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", sorted(GPU_OPTIMIZERS))
def test_ranks_sharing_one_gpu_equal_one_process_on_it_bitwise(name, world_size):
    want = gpu_one_process(name)
    got = run_distributed(gpu_sharded, world_size, name, device="cuda")[0]
    for (param, _), a, b in zip(GPU_SHAPES, got, want):
        assert torch.equal(a, b), f"{name} {param}: max |Δ| {float((a - b).abs().max()):.3e} at {world_size} ranks"
