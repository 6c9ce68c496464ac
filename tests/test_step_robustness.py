"""A step that cannot run raises on every rank, naming the parameter, within seconds; non-finite updates show.

Multi-process cases run on real gloo processes under a deadline: a rank still running when it passes
fails the test (the processes are killed) instead of hanging it.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import scenarios
from dtensor_muon import Muon

PROCESS_GROUP_TIMEOUT_S = 60  # a collective that waits longer than this raises (gloo's own timeout)
DEADLINE_S = 300  # spawn, import, run: every rank must have finished by then
STEP_BOUND_S = 20  # a failing step must have raised on every rank within this


def _bounded_worker(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def run_bounded(fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = DEADLINE_S) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; fails if any is still running at the deadline."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            _bounded_worker, args=(world_size, os.path.join(tmp, "init"), tmp, fn, args), nprocs=world_size,
            join=False, start_method="spawn",
        )
        end = time.monotonic() + deadline_s
        while not context.join(timeout=max(0.0, end - time.monotonic())):
            if time.monotonic() >= end:
                running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                for p in context.processes:
                    if p.is_alive():
                        p.kill()
                pytest.fail(f"ranks {running} still running after {deadline_s} s: a hang")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def wrong_local_piece(rank: int, world_size: int) -> dict[str, Any]:
    """On rank 1 only, one gradient is a DTensor of the right global shape and placements whose local piece
    has one row too few (``from_local(..., run_check=False)``): first a Muon matrix, then an AdamW bias."""
    from torch.distributed.tensor import DTensor

    params = scenarios.distributed_params("shard0", world_size)
    opt = Muon(params, **scenarios.OPTIONS)
    out: dict[str, Any] = {}
    for name in ("layers.0.attention.wq", "layers.0.bias"):
        scenarios.set_gradients(params, 0)
        p = dict(params)[name]
        if rank == 1:
            piece = p.grad.to_local()
            p.grad = DTensor.from_local(piece[1:].clone(), p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        before = [q.to_local().clone() for _, q in params]
        dist.barrier()  # every rank enters the step together: the time below is the step's alone
        start = time.monotonic()
        try:
            opt.step()
            out[name] = (False, "no error", 0.0)
        except Exception as exc:  # noqa: BLE001 - the type and the text are what the test checks
            out[name] = (isinstance(exc, RuntimeError), str(exc), time.monotonic() - start)
        out[name + " unchanged"] = all(torch.equal(b, q.to_local()) for b, (_, q) in zip(before, params))
    return out


@pytest.mark.slow
def test_wrong_local_gradient_piece_raises_on_every_rank_naming_the_parameter():
    results = run_bounded(wrong_local_piece, 3)
    for rank, r in enumerate(results):
        for name in ("layers.0.attention.wq", "layers.0.bias"):
            is_runtime_error, message, seconds = r[name]
            assert is_runtime_error and repr(name) in message, (rank, message)
            assert seconds < STEP_BOUND_S, (rank, name, seconds)
            assert r[name + " unchanged"], (rank, name)
    assert "local piece of the gradient has shape (6, 12)" in results[1]["layers.0.attention.wq"][1]
    assert "another rank (global rank 1" in results[0]["layers.0.attention.wq"][1]
