"""The pooled gloo harness: results by rank, a call sees a process as a fresh one would, failures and hangs
raise in the test and replace the pool, ``fresh=True`` runs apart from it."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import DEVICES, DistributedRunError, run_distributed
from torch.distributed.device_mesh import init_device_mesh

pytestmark = pytest.mark.slow
WORLD_SIZE = 2
MARKER = "DIST_HARNESS_TEST_MARKER"


def gloo_threads() -> int:
    """This process's gloo worker threads (two per process group)."""
    names = (Path(f"/proc/self/task/{tid}/comm").read_text() for tid in os.listdir("/proc/self/task"))
    return sum(name.startswith("pt_gloo") for name in names)


def observe(rank: int, world_size: int) -> dict[str, Any]:
    """What a call finds in its process."""
    return {
        "pid": os.getpid(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "marker": os.environ.get(MARKER),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "gloo_threads": gloo_threads(),
        "cwd": os.getcwd(),
        "world_size": dist.get_world_size(),
    }


def change_everything(rank: int, world_size: int) -> dict[str, Any]:
    """Leave behind what a test's function might: a 2-D mesh (two new groups), dtype, threads, env, cwd."""
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "b"))
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.get_group("b"))
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    os.environ[MARKER] = "1"
    os.chdir("/")
    return {"pid": os.getpid(), "reduced": t.item(), "groups": len(dist.distributed_c10d._world.pg_map)}


def raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 waits for a peer that never comes


def block_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        threading.Event().wait()  # never set: a hang
    dist.barrier()


def test_a_call_sees_what_a_fresh_process_would_after_another_changed_it():
    before = run_distributed(observe, WORLD_SIZE)
    changed = run_distributed(change_everything, WORLD_SIZE)
    after = run_distributed(observe, WORLD_SIZE)
    for b, c, a in zip(before, changed, after):
        assert b["pid"] == c["pid"] == a["pid"]  # the same pooled processes
        assert c["reduced"] == WORLD_SIZE and c["groups"] > b["groups"]
        assert a["dtype"] == torch.float32 and a["threads"] == 1 and a["marker"] is None
        assert a["cwd"] == b["cwd"] and a["world_size"] == WORLD_SIZE
        assert a["groups"] == b["groups"] and a["gloo_threads"] == b["gloo_threads"]  # the mesh's groups are gone


def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_the_pool_is_replaced():
    pids = {r["pid"] for r in run_distributed(observe, WORLD_SIZE)}
    with pytest.raises(
        DistributedRunError, match=r"(?s)raise_on_rank_1 failed on ranks \[1\].*ValueError: rank 1 fails"
    ):
        run_distributed(raise_on_rank_1, WORLD_SIZE)
    assert not pids & {r["pid"] for r in run_distributed(observe, WORLD_SIZE)}


def test_a_call_past_its_deadline_raises_and_the_pool_is_replaced():
    pids = {r["pid"] for r in run_distributed(observe, WORLD_SIZE)}
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=r"block_on_rank_1: ranks \[0, 1\] of 2 still running past"):
        run_distributed(block_on_rank_1, WORLD_SIZE, timeout=5)
    assert time.monotonic() - start < 30
    assert not pids & {r["pid"] for r in run_distributed(observe, WORLD_SIZE)}


def test_fresh_runs_on_its_own_processes_and_leaves_the_pool():
    pooled = {r["pid"] for r in run_distributed(observe, WORLD_SIZE)}
    fresh = run_distributed(observe, WORLD_SIZE, fresh=True)
    assert not pooled & {r["pid"] for r in fresh} and [r["world_size"] for r in fresh] == [WORLD_SIZE] * WORLD_SIZE
    assert pooled == {r["pid"] for r in run_distributed(observe, WORLD_SIZE)}


def pieces_gathered_on_a_cpu_mesh(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """Uneven Shard(0), Shard(1) and a 2-D mesh's (Replicate, Shard(0)), gathered by full_tensor (through a
    CPU mesh of the same ranks on CUDA workers; here directly as well, so CPU runs check that path too)."""
    from dist_harness import full_tensor, gathered_over_a_cpu_mesh, worker_device
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    assert worker_device().type == device
    whole = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    flat = init_device_mesh(device, (world_size,))
    square = init_device_mesh(device, (2, world_size // 2), mesh_dim_names=("a", "b"))
    cases = {
        "shard0": distribute_tensor(whole, flat, [Shard(0)]),
        "shard1": distribute_tensor(whole, flat, [Shard(1)]),
        "2d": distribute_tensor(whole, square, [Replicate(), Shard(0)]),
    }
    return {name: (full_tensor(t), gathered_over_a_cpu_mesh(t), t.to_local().device.type) for name, t in cases.items()}


@pytest.mark.parametrize("device", DEVICES)
def test_full_tensor_gathers_uneven_and_2d_pieces_on_either_device(device):
    whole = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    for result in run_distributed(pieces_gathered_on_a_cpu_mesh, 4, device, device=device):
        for name, (gathered, over_cpu, local_device) in result.items():
            assert local_device == device, name
            assert torch.equal(gathered, whole) and torch.equal(over_cpu, whole), name
