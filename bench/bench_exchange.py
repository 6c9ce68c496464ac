"""Owner exchange vs gather_all: optimizer step time on gloo (CPU) or NCCL, side by side in one run.

    python bench/bench_exchange.py --world-size 4 --steps 6            # bench/results/exchange.json
    python bench/bench_exchange.py --world-size 8 --device cuda --json bench/results/exchange_nccl_ws8.json
    python bench/bench_exchange.py --quick                             # 2 gloo processes, tiny shapes

A stack of transformer-like layers whose matrices hold a few hundred thousand parameters each, sharded
with ``Shard(0)`` over all ranks. For each exchange mode it times ``optimizer.step()`` (median over steps
after one warm-up, the slowest rank per step) and the Newton–Schulz phase, and prints the plan's imbalance.
Rank 0 also runs ``dtensor_muon.Muon`` on the same full parameters and gradients as plain tensors; each mode
reports the largest difference of its updates from that single-process run, relative to the largest update.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import benchmark_parser, markdown_table, median, write_result
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import Muon, exit_without_finalization

LAYER_SHAPES = [(512, 512), (512, 512), (128, 512), (512, 512), (1024, 512), (512, 1024)]
QUICK_LAYER_SHAPES = [(32, 32), (8, 32), (64, 32), (32, 64)]
MODES = ("owner", "gather_all")


def initial_values(layers: int, shapes: list[tuple[int, int]]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (f"layers.{layer}.w{i}", torch.randn(shape, generator=gen) * 0.02)
        for layer in range(layers)
        for i, shape in enumerate(shapes)
    ]


def gradients(step: int, shapes: list[torch.Size]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def single_process(init: list[tuple[str, torch.Tensor]], steps: int) -> list[torch.Tensor]:
    """The same optimizer on plain full tensors: the reference every mode must reproduce."""
    params = [(n, nn.Parameter(v.clone())) for n, v in init]
    opt = Muon(params, lr=0.02)
    for step in range(steps):
        for (_, p), g in zip(params, gradients(step, [p.shape for _, p in params])):
            p.grad = g
        opt.step()
    return [p.detach() for _, p in params]


def worker(
    rank: int,
    world: int,
    init_file: str,
    out_dir: str,
    layers: int,
    steps: int,
    device_type: str,
    shapes: list[tuple[int, int]],
) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    mesh = init_device_mesh(device_type, (world,))
    init = initial_values(layers, shapes)
    results, finals = {}, {}
    for mode in MODES:
        params = [(n, nn.Parameter(distribute_tensor(v, mesh, [Shard(0)]))) for n, v in init]
        opt = Muon(params, lr=0.02, exchange=mode)
        step_ms, ns_ms = [], []
        for step in range(steps + 1):
            for (_, p), g in zip(params, gradients(step, [p.shape for _, p in params])):
                p.grad = distribute_tensor(g, mesh, [Shard(0)])
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            if device_type == "cuda":
                torch.cuda.synchronize()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank is done
            ns = torch.tensor([opt.metrics.get("muon/time_owner_compute_ms", 0.0)])
            dist.all_reduce(ns, op=dist.ReduceOp.MAX)
            if step > 0:
                step_ms.append(1e3 * float(elapsed))
                ns_ms.append(float(ns))
        results[mode] = {
            "step_ms_median": median(step_ms),
            "ns_ms_median_slowest_rank": median(ns_ms),
            "imbalance": opt.plans[0].imbalance,
            "bytes_sent_rank0": opt.metrics["muon/bytes_sent"],
        }
        finals[mode] = [p.full_tensor().cpu() for _, p in params]
    if rank == 0:
        reference = single_process(init, steps + 1)
        for mode in MODES:
            worst = 0.0
            for (_, start), final, ref in zip(init, finals[mode], reference):
                scale = (ref - start).abs().max().clamp(min=1e-30)
                worst = max(worst, ((final - ref).abs().max() / scale).item())
            results[mode]["max_rel_update_diff_vs_single"] = worst
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    exit_without_finalization()  # a spawned child finalizes CPython; gloo can abort it there (docs/limits.md)


def main() -> None:
    parser = benchmark_parser(__doc__, "exchange")
    parser.add_argument("--world-size", type=int, default=None, help="processes (default 4; quick: 2)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 4; quick: 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after one warm-up (default 6; quick: 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    defaults = (2, 1, 2) if args.quick else (4, 4, 6)
    for key, value in zip(("world_size", "layers", "steps"), defaults):
        if getattr(args, key) is None:
            setattr(args, key, value)
    shapes = QUICK_LAYER_SHAPES if args.quick else LAYER_SHAPES
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            worker,
            args=(args.world_size, os.path.join(tmp, "init"), tmp, args.layers, args.steps, args.device, shapes),
            nprocs=args.world_size,
            join=True,
        )
        with open(os.path.join(tmp, "result.json")) as f:
            results = json.load(f)
    rows = [{"mode": mode, **r, "mb_sent_rank0": r["bytes_sent_rank0"] / 1e6} for mode, r in results.items()]
    owner, gather = results["owner"], results["gather_all"]
    n_params = args.layers * sum(m * n for m, n in shapes)
    print(
        f"world size {args.world_size}, {args.layers * len(shapes)} matrices, {n_params / 1e6:.2f} M params, "
        f"device {args.device}, median of {args.steps} steps (slowest rank)"
    )
    print(
        markdown_table(
            rows,
            [
                ("mode", "mode", "{}"),
                ("step_ms_median", "step ms", "{:.1f}"),
                ("ns_ms_median_slowest_rank", "NS ms (slowest rank)", "{:.1f}"),
                ("imbalance", "imbalance", "{:.3f}"),
                ("mb_sent_rank0", "MB sent r0", "{:.2f}"),
                ("max_rel_update_diff_vs_single", "max rel diff vs 1 process", "{:.2e}"),
            ],
        )
    )
    step_ratio = gather["step_ms_median"] / owner["step_ms_median"]
    ns_ratio = gather["ns_ms_median_slowest_rank"] / max(owner["ns_ms_median_slowest_rank"], 1e-9)
    print(f"gather_all / owner: step {step_ratio:.2f}x, Newton–Schulz {ns_ratio:.2f}x")
    write_result(
        args,
        rows,
        matrices=args.layers * len(shapes),
        parameters=n_params,
        gather_all_over_owner_step=step_ratio,
        gather_all_over_owner_ns=ns_ratio,
    )


if __name__ == "__main__":
    main()
