"""bf16 and int8 momentum on many small shards: the torch operations against the one-launch kernel (GPU).

    PYTHONPATH=src python tools/kernels/stored_momentum_shards.py --shards 64 --rows 192 --columns 2048

A rank's FSDP shards of the expert matrices are small at scale (Qwen3-30B-A3B's 128×768×2048 experts over 64
ranks: 3.1 M entries, 1536 rows of 2048 per shard). Per format, the same ``--shards`` shards (a momentum step with
Nesterov that writes the buffer and returns U) through ``_stored_momentum_step_torch`` and through the kernel:
host ms to enqueue them all, wall ms until the device is done, device ms (CUDA events), and whether U, the
buffer and int8's scales are the same bits.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dtensor_muon.kernels.low_precision import encode_int8
from dtensor_muon.kernels.stored_momentum import _launch_stored_momentum, _stored_momentum_step_torch

MOMENTUM = 0.95


def device_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def host_and_wall_ms(fn: Callable[[], object]) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host * 1e3, (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--rows", type=int, default=1536)
    parser.add_argument("--columns", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    shape = (args.rows, args.columns)
    grads = [torch.randn(shape, device="cuda") for _ in range(args.shards)]
    rows = []
    for fmt in ("bfloat16", "int8"):
        starts = [torch.randn(shape, device="cuda") for _ in range(args.shards)]

        def stored(b: torch.Tensor, fmt: str = fmt) -> tuple[torch.Tensor, torch.Tensor | None]:
            return (b.to(torch.bfloat16), None) if fmt == "bfloat16" else encode_int8(b)

        by_torch = [stored(b) for b in starts]
        by_kernel = [stored(b) for b in starts]
        u_torch = [
            _stored_momentum_step_torch(g, q, s, MOMENTUM, True, True, True) for g, (q, s) in zip(grads, by_torch)
        ]
        u_kernel = []
        for g, (q, s) in zip(grads, by_kernel):
            u_kernel.append(torch.empty_like(g))
            _launch_stored_momentum(g, q, s, u_kernel[-1], MOMENTUM, True, True, True)
        same = all(torch.equal(a, b) for a, b in zip(u_torch, u_kernel)) and all(
            torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1])) for a, b in zip(by_torch, by_kernel)
        )

        def torch_pass(states: list = by_torch) -> None:
            for g, (q, s) in zip(grads, states):
                _stored_momentum_step_torch(g, q, s, MOMENTUM, True, True, True)

        def kernel_pass(states: list = by_kernel) -> None:
            for g, (q, s) in zip(grads, states):
                _launch_stored_momentum(g, q, s, torch.empty_like(g), MOMENTUM, True, True, True)

        row = {"format": fmt, "shards": args.shards, "entries": args.rows * args.columns, "same_bits": same}
        for name, fn in (("torch", torch_pass), ("kernel", kernel_pass)):
            row[f"{name}_host_ms"], row[f"{name}_wall_ms"] = host_and_wall_ms(fn)
            row[f"{name}_device_ms"] = device_ms(fn)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
