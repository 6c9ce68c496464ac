"""Owner exchange vs gather_all: optimizer step time on gloo (CPU) or NCCL, side by side in one run.

    python bench/bench_exchange.py --world-size 4 --steps 6 --json bench/results/exchange_gloo_ws4.json

A stack of transformer-like layers whose matrices hold a few hundred thousand parameters each, sharded
with ``Shard(0)`` over all ranks. For each exchange mode it times ``optimizer.step()`` (median over steps
after one warm-up, the slowest rank per step) and the Newton–Schulz phase, and prints the plan's imbalance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import Muon

LAYER_SHAPES = [(512, 512), (512, 512), (128, 512), (512, 512), (1024, 512), (512, 1024)]


def build_params(layers: int, mesh) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for layer in range(layers):
        for i, shape in enumerate(LAYER_SHAPES):
            full = torch.randn(shape, generator=gen) * 0.02
            out.append((f"layers.{layer}.w{i}", nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))))
    return out


def worker(rank: int, world: int, init: str, out_dir: str, layers: int, steps: int, device_type: str) -> None:
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh(device_type, (world,))
    results = {}
    for mode in ("owner", "gather_all"):
        params = build_params(layers, mesh)
        opt = Muon(params, lr=0.02, exchange=mode)
        step_ms, ns_ms = [], []
        for step in range(steps + 1):
            gen = torch.Generator().manual_seed(step)
            for _, p in params:
                p.grad = distribute_tensor(torch.randn(p.shape, generator=gen), mesh, [Shard(0)])
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
            "step_ms_median": statistics.median(step_ms),
            "ns_ms_median_slowest_rank": statistics.median(ns_ms),
            "imbalance": opt.plans[0].imbalance,
            "bytes_sent_rank0": opt.metrics["muon/bytes_sent"],
        }
    if rank == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.world_size, os.path.join(tmp, "init"), tmp, args.layers, args.steps, args.device),
                 nprocs=args.world_size, join=True)
        with open(os.path.join(tmp, "result.json")) as f:
            results = json.load(f)
    owner, gather = results["owner"], results["gather_all"]
    n_params = args.layers * sum(m * n for m, n in LAYER_SHAPES)
    print(f"world size {args.world_size}, {args.layers * len(LAYER_SHAPES)} matrices, {n_params / 1e6:.2f} M params, "
          f"device {args.device}, median of {args.steps} steps (slowest rank)")
    print(f"{'mode':<12}{'step ms':>10}{'NS ms':>10}{'imbalance':>11}{'MB sent r0':>12}")
    for mode, r in results.items():
        print(f"{mode:<12}{r['step_ms_median']:>10.1f}{r['ns_ms_median_slowest_rank']:>10.1f}{r['imbalance']:>11.3f}"
              f"{r['bytes_sent_rank0'] / 1e6:>12.2f}")
    print(f"gather_all / owner: step {gather['step_ms_median'] / owner['step_ms_median']:.2f}x, "
          f"Newton–Schulz {gather['ns_ms_median_slowest_rank'] / owner['ns_ms_median_slowest_rank']:.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "python": sys.version}, f, indent=2)


if __name__ == "__main__":
    main()
