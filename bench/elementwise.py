"""Muon's element-wise passes per shard size: the fused Triton kernels (one launch per shard, and one launch for
the whole list of shards) against torch's multi-tensor operations, as a rank issues them (``--tensors``
shards of one size in one call, the device synchronized before and after it), so that the host's launch cost
shows where the shards are small.

    PYTHONPATH=src python bench/elementwise.py              # GPU: the table, bench/results/elementwise.json
    PYTHONPATH=src python bench/elementwise.py --quick      # anywhere: torch's operations on tiny sizes

Passes (see :mod:`dtensor_muon.kernels.elementwise`): ``momentum`` (B' = lerp(B, g, 1 − μ) written back, U =
lerp(g, B', μ) returned in fp32) and ``apply`` (θ ← θ·(1 − γλ) − γ'·O with O in bf16). Paths: ``foreach``
(torch's ``_foreach_lerp_`` and ``_foreach_lerp``, or ``_foreach_mul_`` and ``_foreach_add_``), ``kernel`` (the
one-shard kernel on each shard) and ``list`` (:mod:`dtensor_muon.kernels.shard_lists`: every shard in one
launch). Per size and path: median µs per shard over ``--rounds`` rounds, the effective bandwidth (bytes the
pass must move: 16 per fp32 entry for momentum, 10 for apply, over the time), and the path the library picks
there (:data:`MIN_KERNEL_NUMEL` per shard, then :data:`MIN_LIST_MEAN_NUMEL` a shard on average). fp32 tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from common import benchmark_parser, markdown_table, median, write_result

from dtensor_muon.kernels import elementwise as ew
from dtensor_muon.kernels import shard_lists

MOMENTUM, NESTEROV, DECAY, ALPHA = 0.95, True, 0.998, -0.02
BYTES = {"momentum": 16, "apply": 10}


def passes(n: int, count: int, device: torch.device) -> dict[str, dict[str, Callable[[], None]]]:
    """Per pass, per path: one call over ``count`` fresh size-``n`` shards."""
    gen = torch.Generator(device=device).manual_seed(0)
    grads, bufs, params = ([torch.randn(n, generator=gen, device=device) for _ in range(count)] for _ in range(3))
    updates = [torch.randn(n, generator=gen, device=device).to(torch.bfloat16) for _ in range(count)]

    def foreach_momentum() -> None:
        torch._foreach_lerp_(bufs, grads, 1 - MOMENTUM)
        torch._foreach_lerp(grads, bufs, MOMENTUM)

    def kernel_momentum() -> None:
        for g, b in zip(grads, bufs):
            ew._launch_momentum(g, b, torch.empty_like(b), MOMENTUM, NESTEROV, True, True)

    def list_momentum() -> None:
        shard_lists.momentum_list(grads, bufs, MOMENTUM, NESTEROV, write_buffer=True, want_input=True)

    def foreach_apply() -> None:
        torch._foreach_mul_(params, DECAY)
        torch._foreach_add_(params, updates, alpha=ALPHA)

    def kernel_apply() -> None:
        for p, o in zip(params, updates):
            ew._launch_decay_and_add(p, o, DECAY, ALPHA)

    def list_apply() -> None:
        shard_lists.decay_and_add_list(params, updates, [DECAY] * count, [ALPHA] * count)

    out: dict[str, dict[str, Callable[[], None]]] = {
        "momentum": {"foreach": foreach_momentum},
        "apply": {"foreach": foreach_apply},
    }
    if device.type == "cuda" and ew.triton is not None:
        out["momentum"].update(kernel=kernel_momentum, list=list_momentum)
        out["apply"].update(kernel=kernel_apply, list=list_apply)
    return out


def picked(n: int, count: int, device: torch.device) -> str:
    """The path the library takes for ``count`` shards of ``n`` entries."""
    if device.type != "cuda" or ew.triton is None:
        return "foreach"
    if n >= ew.MIN_KERNEL_NUMEL:
        return "kernel"
    return "list" if n >= shard_lists.MIN_LIST_MEAN_NUMEL else "foreach"


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
    sizes = (
        [1 << 10, 1 << 12] if args.quick else [1 << 14, 1 << 16, 1 << 18, 1 << 20, 3 << 20, 1 << 22, 1 << 24, 1 << 26]
    )
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
                        "shards": count,
                        "us_per_shard": 1e6 * seconds,
                        "gb_s": BYTES[name] * n / seconds / 1e9,
                        "picked": path == picked(n, count, device),
                    }
                )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    columns = [
        ("pass", "pass", "{}"),
        ("entries", "entries", "{:,}"),
        ("path", "path", "{}"),
        ("shards", "shards", "{}"),
        ("us_per_shard", "µs per shard", "{:.1f}"),
        ("gb_s", "GB/s", "{:.0f}"),
        ("picked", "picked", "{}"),
    ]
    print(
        f"{device}; MIN_KERNEL_NUMEL = {ew.MIN_KERNEL_NUMEL:,}, MIN_LIST_MEAN_NUMEL = {shard_lists.MIN_LIST_MEAN_NUMEL:,}"
    )
    print(markdown_table(rows, columns))
    write_result(args, rows, min_kernel_numel=ew.MIN_KERNEL_NUMEL, min_list_mean_numel=shard_lists.MIN_LIST_MEAN_NUMEL)


if __name__ == "__main__":
    main()
