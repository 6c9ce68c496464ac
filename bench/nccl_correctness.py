"""NCCL correctness: the engine's distributed result equals the single-GPU result on the same gradients.

    torchrun --nproc_per_node N bench/nccl_correctness.py [--json out.json]

Every rank holds the same full parameters and per-step gradients (seeded), sharded with ``Shard(0)`` over
all ranks (and a 3-D expert parameter, a 3×k matrix with empty shards, AdamW embeddings and norms). Rank 0
also runs the same optimizer on plain CUDA tensors. For the owner exchange, gather_all and overlap modes it
reports the max relative difference of every parameter after the steps; the tolerance is bf16 rounding
(the Newton–Schulz matmuls may take different cuBLAS kernels for a batch of another size): 1e-2 relative
on the update, checked as |Δθ_dist − Δθ_single| ≤ 1e-2·|Δθ_single|_max per parameter.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import Muon

SHAPES = [("tok_embeddings.weight", (1000, 256)), ("layers.0.wq", (256, 256)), ("layers.0.w1", (704, 256)),
          ("layers.0.w2", (256, 704)), ("layers.0.tiny", (3, 256)), ("layers.0.experts", (8, 256, 128)),
          ("layers.0.norm.weight", (256,)), ("layers.1.wq", (256, 256)), ("output.weight", (1000, 256))]


def run(params: list[tuple[str, torch.Tensor]], steps: int, mesh, **options) -> dict[str, torch.Tensor]:
    model = nn.Module()
    named = []
    for name, value in params:
        p = nn.Parameter(distribute_tensor(value, mesh, [Shard(0)]) if mesh is not None else value.clone())
        model.register_parameter(name.replace(".", "_"), p)
        named.append((name, p))
    opt = Muon(named, lr=0.02, **options)
    if options.get("overlap"):
        opt.attach(model)
    for step in range(steps):
        gen = torch.Generator(device="cuda").manual_seed(step)
        for _, p in named:
            g = torch.randn(p.shape, generator=gen, device="cuda")
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if mesh is not None else g
        opt.step()
    opt.flush()
    return {n: (p.full_tensor() if mesh is not None else p.detach()) for n, p in named}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    gen = torch.Generator(device="cuda").manual_seed(0)
    init = [(n, torch.randn(s, generator=gen, device="cuda")) for n, s in SHAPES]
    single = run(init, args.steps, None)
    rows = []
    for mode, options in [("owner", {}), ("gather_all", {"exchange": "gather_all"}), ("overlap", {"overlap": True})]:
        dist_result = run(init, args.steps, mesh, **options)
        worst = 0.0
        for name, start in init:
            delta_single = single[name] - start
            delta_dist = dist_result[name] - start
            rel = ((delta_dist - delta_single).abs().max() / delta_single.abs().max().clamp(min=1e-30)).item()
            worst = max(worst, rel)
        rows.append({"mode": mode, "world_size": world, "max_rel_update_diff": worst, "ok": worst <= 1e-2})
    if rank == 0:
        print(f"{'mode':<12}{'ranks':>6}{'max rel diff':>14}{'ok':>5}")
        for r in rows:
            print(f"{r['mode']:<12}{r['world_size']:>6}{r['max_rel_update_diff']:>14.2e}{str(r['ok']):>5}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
    dist.destroy_process_group()
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
