"""Muon's element-wise passes per shard size: the fused Triton kernels against torch's operations, as a rank
issues them (one call per shard, ``--tensors`` shards of one size back to back, the device synchronized once
after them), so that the host's launch cost shows where the shards are small.

    PYTHONPATH=src python bench/elementwise.py              # GPU: the table, bench/results/elementwise.json
    PYTHONPATH=src python bench/elementwise.py --quick      # anywhere: torch's operations on tiny sizes

Passes (see :mod:`dtensor_muon.kernels.elementwise`): ``momentum`` (B' = lerp(B, g, 1 − μ) written back, U =
lerp(g, B', μ) returned: one kernel, or torch's ``lerp_`` then ``lerp``) and ``apply`` (θ ← θ·(1 − γλ) − γ'·O
with O in bf16: one kernel, or ``mul_`` then ``add_``). Per size and path: median µs per call over
``--rounds`` rounds, the effective bandwidth (bytes the pass must move: 16 per fp32 entry for momentum, 10 for
apply, over the time), and which path :data:`MIN_KERNEL_NUMEL` picks for that size. fp32 tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from common import benchmark_parser, markdown_table, median, write_result

from dtensor_muon.kernels import elementwise as ew

MOMENTUM, NESTEROV, DECAY, ALPHA = 0.95, True, 0.998, -0.02
BYTES = {"momentum": 16, "apply": 10}


def passes(n: int, count: int, device: torch.device) -> dict[str, dict[str, Callable[[], None]]]:
    """Per pass, per path: one call over ``count`` fresh size-``n`` shards."""
    gen = torch.Generator(device=device).manual_seed(0)
    grads, bufs, params = ([torch.randn(n, generator=gen, device=device) for _ in range(count)] for _ in range(3))
    updates = [torch.randn(n, generator=gen, device=device).to(torch.bfloat16) for _ in range(count)]

    def kernel_momentum() -> None:
        for g, b in zip(grads, bufs):
            ew._launch_momentum(g, b, torch.empty_like(b), MOMENTUM, NESTEROV, True, True)

    def torch_momentum() -> None:
        for g, b in zip(grads, bufs):
            ew._momentum_step_torch(g, b, MOMENTUM, NESTEROV, True, True)

    def kernel_apply() -> None:
        for p, o in zip(params, updates):
            ew._launch_decay_and_add(p, o, DECAY, ALPHA)

    def torch_apply() -> None:
        for p, o in zip(params, updates):
            p.mul_(DECAY)
            p.add_(o, alpha=ALPHA)

    out: dict[str, dict[str, Callable[[], None]]] = {
        "momentum": {"torch": torch_momentum},
        "apply": {"torch": torch_apply},
    }
    if device.type == "cuda" and ew.triton is not None:
        out["momentum"]["kernel"], out["apply"]["kernel"] = kernel_momentum, kernel_apply
    return out


def time_call(fn: Callable[[], None], device: torch.device, rounds: int) -> float:
    """Median seconds of one ``fn()`` (the device synchronized before and after)."""
    times = []
    for i in range(rounds + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return median(times)


def main() -> None:
    parser = benchmark_parser(__doc__, "elementwise")
    parser.add_argument("--tensors", type=int, default=64, help="shards per call (a rank's Muon parameters)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    sizes = [1 << 10, 1 << 12] if args.quick else [1 << k for k in range(16, 27, 2)]
    rows = []
    for n in sizes:
        count = args.tensors if n * args.tensors <= 1 << 30 else max(1, (1 << 30) // n)
        for name, paths in passes(n, count, device).items():
            for path, fn in paths.items():
                seconds = time_call(fn, device, args.rounds) / count
                rows.append(
                    {
                        "pass": name,
                        "entries": n,
                        "path": path,
                        "calls": count,
                        "us_per_call": 1e6 * seconds,
                        "gb_s": BYTES[name] * n / seconds / 1e9,
                        "picked": path == ("kernel" if n >= ew.MIN_KERNEL_NUMEL and device.type == "cuda" else "torch"),
                    }
                )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    columns = [
        ("pass", "pass", "{}"),
        ("entries", "entries", "{:,}"),
        ("path", "path", "{}"),
        ("calls", "calls", "{}"),
        ("us_per_call", "µs per call", "{:.1f}"),
        ("gb_s", "GB/s", "{:.0f}"),
        ("picked", "picked", "{}"),
    ]
    print(f"{device}; MIN_KERNEL_NUMEL = {ew.MIN_KERNEL_NUMEL:,}")
    print(markdown_table(rows, columns))
    write_result(args, rows, min_kernel_numel=ew.MIN_KERNEL_NUMEL)


if __name__ == "__main__":
    main()
