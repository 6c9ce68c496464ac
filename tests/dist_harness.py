"""Runs a function on N real gloo processes (spawned, CPU) and collects what each returns."""

from __future__ import annotations

import faulthandler
import gc
import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    faulthandler.enable()  # a crash inside torch/gloo prints every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    del result
    gc.collect()  # optimizers, meshes and their groups go while gloo is still up
    # every rank leaves its collectives before any rank tears gloo down (a peer closing early aborts gloo)
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return their results by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world_size, init_file, tmp, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
