"""Where a whole optimizer step's device time goes: one profiled ``step()`` on a model's shapes, its CUDA kernels
summed by kind and by name, and the device's idle time inside the step.

    PYTHONPATH=src:bench python tools/kernels/step_kernels.py --model qwen3_30b_a3b --layers 8 --out k.json

The parameters and optimizers are ``bench/optimizer_step.py``'s (``--kinds`` takes its optimizer keys, e.g.
``dtensor_muon``, ``dtensor_muon_stacks_1`` for units alone, ``adamw``). After ``--warmup`` steps one step runs
are timed (``--steps``, the device synchronized around each: the median is "step ms"), then one runs under
torch.profiler; from it:

- each kernel's device time, summed over its launches, grouped by the kind its name tells (:data:`KINDS`);
- busy ms: the union of the kernels' intervals on the device; idle ms: the step's device span (first kernel's
  start to last kernel's end) less busy; lead ms: from ``step()``'s call to the first kernel (the host's work
  before the device has any); the longest idle gaps, each with the kernels on either side.

A kernel replayed inside a CUDA graph counts where the profiler reports it. The floor, as optimizer_step.py's:
the Muon matrices' Newton–Schulz FLOPs with symmetric products at the bf16 8192³ matmul rate measured first in the
same process; each step's "× floor" is its median over it.

The step's floor, as optimizer_step.py's: that floor plus the state traffic no step can avoid (20 bytes a Muon
parameter, 28 an AdamW one) at the device-to-device copy rate measured in the same process; "× step floor" is the
median over it.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from optimizer_step import (
    MODELS,
    ParameterSet,
    build_optimizer,
    device_copy_gbps,
    matmul_ceiling,
    median_ms,
    model_shapes,
    step_all,
    step_floors,
    sync,
)
from torch.autograd import DeviceType

KINDS = (  # (kind, substrings of the kernel's name, in order: the first match names it)
    ("Gluon SYRK products", ("ws_syrk",)),
    ("Triton SYRK products", ("_syrk_kernel",)),
    ("cuBLAS products", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_")),
    ("momentum (fused kernel)", ("_momentum_kernel",)),
    ("apply θ·(1−γλ) − γ'·O (fused kernel)", ("_decay_and_add",)),
    ("NS input norm and scale (fused kernel)", ("_scale_cast", "_sum_squares")),
    ("fused AdamW", ("fused_adam", "FusedAdam")),
    ("multi-tensor (foreach) passes", ("multi_tensor_apply",)),
    ("reductions (norms, sums)", ("reduce_kernel", "norm")),
    ("copies and casts", ("copy", "Memcpy", "Memset", "memcpy", "memset")),
    ("other element-wise (torch)", ("elementwise", "vectorized")),
)


GAPS = 6  # idle gaps listed per profiled step


def idle_gaps(kernels: list, count: int) -> list[dict]:
    """The ``count`` longest stretches of the step's device span with no kernel running, each with its length
    (ms), its start from the first kernel (ms) and the names of the kernels that end before and start after it."""
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    first = ordered[0].time_range.start
    gaps, end, before = [], ordered[0].time_range.end, ordered[0]
    for e in ordered[1:]:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, end, before.name, e.name))
        if e.time_range.end >= end:
            end, before = e.time_range.end, e
    gaps.sort(reverse=True)
    return [
        {"ms": g / 1e3, "at_ms": (at - first) / 1e3, "after": a[:80], "before": b[:80]} for g, at, a, b in gaps[:count]
    ]


def kernel_kind(name: str) -> str:
    """The first :data:`KINDS` entry whose substrings occur in ``name``, else "other"."""
    for kind, parts in KINDS:
        if any(part in name for part in parts):
            return kind
    return "other"


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals given in µs, in ms."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e3


def profile_step(optimizers: list[torch.optim.Optimizer], device: torch.device) -> dict:
    """One profiled ``step()``: kernels by kind and name, busy, idle and lead ms, and the host's ms."""
    sync(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("whole_step"):
            start = time.perf_counter()
            step_all(optimizers)
            host_ms = 1e3 * (time.perf_counter() - start)
        sync(device)
    events = prof.events()
    step_start = min(e.time_range.start for e in events if e.name == "whole_step" and e.device_type == DeviceType.CPU)
    kernels = [
        e
        for e in events
        if e.device_type == DeviceType.CUDA and e.name != "whole_step" and not e.name.startswith("Optimizer.")
    ]
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e.name][0] += 1
        by_name[e.name][1] += e.time_range.elapsed_us() / 1e3
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for name, (count, ms) in by_name.items():
        by_kind[kernel_kind(name)][0] += count
        by_kind[kernel_kind(name)][1] += ms
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    first, last = min(s for s, _ in intervals), max(e for _, e in intervals)
    busy = union_ms(intervals)
    return {
        "host_ms": host_ms,
        "span_ms": (last - first) / 1e3,
        "busy_ms": busy,
        "idle_ms": (last - first) / 1e3 - busy,
        "lead_ms": (first - step_start) / 1e3,
        "kernels": len(kernels),
        "gaps": idle_gaps(kernels, GAPS),
        "by_kind": {k: {"launches": c, "ms": ms} for k, (c, ms) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])},
        "by_name": {k: {"launches": c, "ms": ms} for k, (c, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])},
    }


def print_profile(kind: str, result: dict, top: int) -> None:
    print(
        f"\n{kind}: step {result['step_ms']:.1f} ms (median, {result['vs_floor']:.2f}× the NS floor, "
        f"{result['vs_step_floor']:.2f}× the step floor); profiled step: "
        f"host {result['host_ms']:.1f} ms; device span {result['span_ms']:.1f} ms = busy "
        f"{result['busy_ms']:.1f} + idle {result['idle_ms']:.1f}; first kernel {result['lead_ms']:.1f} ms after "
        f"step() was called; {result['kernels']} kernels"
    )
    print("| kind | kernels | ms | share of busy |\n|---|---:|---:|---:|")
    for name, row in result["by_kind"].items():
        print(f"| {name} | {row['launches']} | {row['ms']:.2f} | {row['ms'] / result['busy_ms']:.1%} |")
    print("\n| idle gap ms | at ms | after | before |\n|---:|---:|---|---|")
    for gap in result["gaps"]:
        print(f"| {gap['ms']:.2f} | {gap['at_ms']:.1f} | {gap['after']} | {gap['before']} |")
    print(f"\n| top {top} kernels | launches | ms |\n|---|---:|---:|")
    for name, row in list(result["by_name"].items())[:top]:
        print(f"| {name[:110]} | {row['launches']} | {row['ms']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3_30b_a3b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--kinds", default="dtensor_muon", help="comma-separated optimizer_step optimizer keys")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (median) before the profiled one")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("step_kernels.py profiles CUDA kernels: it needs a CUDA GPU")
    device = torch.device("cuda")
    shapes, _ = model_shapes(args.model, args.layers, False, args.experts)
    params = ParameterSet(shapes, device)
    ceiling = matmul_ceiling(device)
    floors = step_floors(shapes, params.muon_names, ceiling["tflops"], device_copy_gbps(device))
    print(
        f"bf16 8192³ matmul: {ceiling['tflops']:.0f} TFLOP/s; Newton–Schulz floor of the Muon matrices "
        f"{floors['syrk_ms']:.1f} ms; copy rate {floors['copy_gbps']:.0f} GB/s; state traffic {floors['state_gb']:.1f} "
        f"GB, floor {floors['traffic_ms']:.1f} ms; step floor {floors['step_ms']:.1f} ms"
    )
    results = {}
    for kind in args.kinds.split(","):
        params.reset()
        optimizers = build_optimizer(kind, params)
        step_ms = median_ms(functools.partial(step_all, optimizers), device, args.warmup, args.steps)
        results[kind] = {
            "step_ms": step_ms,
            "vs_floor": step_ms / floors["syrk_ms"],
            "vs_step_floor": step_ms / floors["step_ms"],
            **profile_step(optimizers, device),
        }
        print_profile(kind, results[kind], args.top)
        del optimizers
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(device),
                    "torch": torch.__version__,
                    "model": args.model,
                    "layers": args.layers,
                    "experts": args.experts,
                    "matmul_tflops": ceiling["tflops"],
                    "floors": floors,
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
