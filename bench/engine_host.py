"""Host time of a multi-rank step, phase by phase, on a real model's parameter structure with negligible compute.

    PYTHONPATH=src:bench python bench/engine_host.py --model qwen3_30b_a3b --layers 48 --world-size 2
    PYTHONPATH=src:bench python bench/engine_host.py --quick            # 2 ranks, 2 layers, a few steps

At scale a rank's share of the Newton–Schulz work shrinks with the world size, but the engine's host work per
step does not: every rank checks, prepares and applies its piece of every parameter. This benchmark measures
that part. The model's parameters (``bench/optimizer_step.py``'s shapes: torchtitan's meta model, every layer)
keep their count, their experts and their names, with every other side divided by ``--shrink`` (at least 2), so
that the products take little time; they are laid out as FSDP2 lays them (``Shard(0)`` over ``--world-size``
gloo processes on CPU) and stepped by ``dtensor_muon.Muon`` with its defaults. Reported per phase (the
optimizer's own ``muon/time_<phase>_ms`` metrics, wall time on the host): the median over ``--steps`` steps after
one warm-up, of the slowest rank in each step. The phases before the first product (preflight, consensus,
redistribute, prepare) hold the device idle on a GPU; the others overlap its kernels.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import benchmark_parser, markdown_table, median, write_result
from optimizer_step import MODELS, model_shapes
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import Muon, exit_without_finalization

PHASES = ("preflight", "consensus", "redistribute", "prepare", "local_compute", "owner_compute", "adamw", "finish")
"""The step's phases reported (``muon/time_<phase>_ms``), in the order a step runs them."""


def shrunk_shapes(model: str, layers: int, shrink: int, quick: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameter shapes (all ``layers``), every side but an expert count divided by ``shrink``
    (at least 2); ``quick``: the model's cut-down flavor, as ``optimizer_step.py --quick`` takes it."""
    shapes, _ = model_shapes(model, layers, quick)
    return [
        (name, tuple(d if (len(s) == 3 and i == 0) else max(2, d // shrink) for i, d in enumerate(s)))
        for name, s in shapes
    ]


def worker(rank: int, world: int, init_file: str, out_dir: str, shapes: list, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=600)
    )
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    params = []
    for name, shape in shapes:
        p = nn.Parameter(distribute_tensor(torch.randn(shape, generator=gen) * 0.02, mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(shape, generator=gen), mesh, [Shard(0)])
        params.append((name, p))
    opt = Muon(params, lr=0.02)
    per_step: list[dict[str, float]] = []
    for step in range(steps + 1):
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        wall = torch.tensor(
            [1e3 * (time.perf_counter() - start)] + [opt.metrics.get(f"muon/time_{p}_ms", 0.0) for p in PHASES]
        )
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)  # the slowest rank, phase by phase
        if step > 0:
            per_step.append(dict(zip(("step", *PHASES), wall.tolist())))
    if rank == 0:
        with open(os.path.join(out_dir, "steps.json"), "w") as f:
            json.dump(per_step, f)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalization()  # a spawned child finalizes CPython; gloo can abort it there (docs/limits.md)


def measure(model: str, layers: int, shrink: int, world: int, steps: int, quick: bool) -> dict[str, Any]:
    """One run: the medians of each phase (slowest rank per step) for ``world`` ranks."""
    shapes = shrunk_shapes(model, layers, shrink, quick)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), tmp, shapes, steps), nprocs=world, join=True)
        with open(os.path.join(tmp, "steps.json")) as f:
            per_step = json.load(f)
    row: dict[str, Any] = {"model": model, "layers": layers, "parameters": len(shapes), "world_size": world}
    row.update({f"{k}_ms": median([s[k] for s in per_step]) for k in ("step", *PHASES)})
    return row


def main() -> None:
    parser = benchmark_parser(__doc__, "engine_host")
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3_30b_a3b")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 48; quick: 2)")
    parser.add_argument("--shrink", type=int, default=32, help="divide every side but the expert count by this")
    parser.add_argument("--world-size", type=int, nargs="+", default=None, help="gloo processes (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 5; quick: 2)")
    args = parser.parse_args()
    args.layers = args.layers or (2 if args.quick else 48)
    args.world_size = args.world_size or [2]
    args.steps = args.steps or (2 if args.quick else 5)
    rows = [measure(args.model, args.layers, args.shrink, w, args.steps, args.quick) for w in args.world_size]
    columns = [("model", "model", "{}"), ("parameters", "parameters", "{}"), ("world_size", "ranks", "{}")]
    columns += [(f"{k}_ms", f"{k} ms", "{:.2f}") for k in ("step", *PHASES)]
    print(markdown_table(rows, columns))
    write_result(args, rows)


if __name__ == "__main__":
    main()
