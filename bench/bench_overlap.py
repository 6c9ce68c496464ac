"""Overlap on vs off: time inside ``optimizer.step()`` and per full training step, side by side in one run.

    python bench/bench_overlap.py --world-size 4 --device cpu          # bench/results/overlap.json
    python bench/bench_overlap.py --world-size 1 --device cuda --dim 2048 --hidden 5632 --blocks 8 --tokens 4096 \
        --json bench/results/overlap_cuda.json
    python bench/bench_overlap.py --quick                              # 2 gloo processes, tiny model

A residual MLP stack (embedding, ``blocks`` × [Linear(dim, hidden), GELU, Linear(hidden, dim)], head), each
block and the root given to ``fully_shard``. Each mode trains ``steps`` steps after ``warmup`` and reports
medians over steps of the slowest rank: full step (forward + backward + step) and ``step()`` alone, and
every step's loss: overlap changes when updates are applied, not what they are, so the losses must be equal.
"""

from __future__ import annotations

import argparse
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

from dtensor_muon import Muon, exit_without_finalization

QUICK = {
    "world_size": 2,
    "vocab": 64,
    "dim": 32,
    "hidden": 64,
    "blocks": 2,
    "tokens": 64,
    "seq": 16,
    "warmup": 1,
    "steps": 2,
}
DEFAULTS = {
    "world_size": 4,
    "vocab": 512,
    "dim": 256,
    "hidden": 768,
    "blocks": 4,
    "tokens": 512,
    "seq": 64,
    "warmup": 2,
    "steps": 6,
}


class Stack(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, blocks: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(dim, hidden, bias=False), nn.GELU(), nn.Linear(hidden, dim, bias=False))
                for _ in range(blocks)
            ]
        )
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.output(h)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return 1e3 * float(t)


def worker(rank: int, world: int, init: str, out: str, args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(max(1, torch.get_num_threads() // world) if args.device == "cpu" else 4)
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    dist.init_process_group(
        "nccl" if args.device == "cuda" else "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    # an explicit mesh of the chosen device: fully_shard without one takes the GPU wherever one is present
    mesh = init_device_mesh(device.type, (world,))
    results = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = Stack(args.vocab, args.dim, args.hidden, args.blocks).to(device)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = Muon(model.named_parameters(), lr=0.02, overlap=overlap)
        opt.attach(model)
        step_ms, total_ms, losses = [], [], []
        batch = args.tokens // args.seq
        for step in range(args.warmup + args.steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            tokens = torch.randint(0, args.vocab, (batch, args.seq), generator=gen).to(device)
            sync(device)
            dist.barrier()
            start = time.perf_counter()
            logits = model(tokens)
            targets = tokens.roll(-1, dims=1)
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab).float(), targets.reshape(-1))
            loss.backward()
            losses.append(loss.item())
            before_step = time.perf_counter()
            opt.step()
            after_step = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            sync(device)
            end = time.perf_counter()
            if step >= args.warmup:
                step_ms.append(slowest(after_step - before_step))
                total_ms.append(slowest(end - start))
        opt.flush()
        results["overlap" if overlap else "no_overlap"] = {
            "step_call_ms_median": median(step_ms),
            "full_step_ms_median": median(total_ms),
            "final_loss": losses[-1],
            "losses": losses,
        }
        del model, opt
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
    exit_without_finalization()  # a spawned child finalizes CPython; gloo can abort it there (docs/limits.md)


def main() -> None:
    parser = benchmark_parser(__doc__, "overlap")
    parser.add_argument("--world-size", type=int)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--dim", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--blocks", type=int)
    parser.add_argument("--tokens", type=int, help="tokens per rank per step")
    parser.add_argument("--seq", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--steps", type=int)
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(
            worker, args=(args.world_size, os.path.join(tmp, "init"), tmp, args), nprocs=args.world_size, join=True
        )
        with open(os.path.join(tmp, "result.json")) as f:
            results = json.load(f)
    print(
        f"world size {args.world_size} on {args.device}; dim {args.dim}, hidden {args.hidden}, {args.blocks} blocks, "
        f"{args.tokens} tokens/rank; median of {args.steps} steps (slowest rank)"
    )
    rows = [{"mode": mode, **r} for mode, r in results.items()]
    print(
        markdown_table(
            rows,
            [
                ("mode", "mode", "{}"),
                ("step_call_ms_median", "step() ms", "{:.2f}"),
                ("full_step_ms_median", "full step ms", "{:.2f}"),
                ("final_loss", "final loss", "{:.4f}"),
            ],
        )
    )
    off, on = results["no_overlap"], results["overlap"]
    step_ratio = on["step_call_ms_median"] / off["step_call_ms_median"]
    full_ratio = on["full_step_ms_median"] / off["full_step_ms_median"]
    same = on["losses"] == off["losses"]
    print(
        f"overlap / no overlap: step() {step_ratio:.2f}x, full step {full_ratio:.2f}x; "
        f"losses {'equal' if same else 'DIFFER'} at every step"
    )
    write_result(
        args,
        rows,
        overlap_over_no_overlap_step_call=step_ratio,
        overlap_over_no_overlap_full_step=full_ratio,
        losses_equal=same,
    )


if __name__ == "__main__":
    main()
