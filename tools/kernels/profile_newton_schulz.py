"""Where one Newton–Schulz call spends its GPU time: per-kernel CUDA time from torch.profiler.

    PYTHONPATH=src python tools/kernels/profile_newton_schulz.py --shapes 4096x4096,64x2048x1408 --algorithms standard,gram

For each shape and algorithm: a warm-up call (autotuning, compilation), then ``--calls`` profiled calls on a
fresh fp32 Gaussian gradient; prints the kernels by total CUDA time (per call) and the sum, and writes the
rows as JSON to ``--out``. The sum against the do_bench median of ``bench/bench_newton_schulz.py`` is the time
the GPU sits idle between kernels.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dtensor_muon.linalg.newton_schulz import newton_schulz


def kernel_times(shape: tuple[int, ...], algorithm: str, calls: int) -> list[dict]:
    """[{kernel, calls, us_per_ns_call}] sorted by time, for ``calls`` Newton–Schulz calls on ``shape``."""
    g = torch.randn(shape, device="cuda")
    newton_schulz(g, algorithm=algorithm)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            newton_schulz(g, algorithm=algorithm)
        torch.cuda.synchronize()
    rows = [
        {"kernel": e.key[:90], "launches": e.count // calls, "us": e.device_time_total / calls}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["us"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x4096,4096x14336,64x2048x1408")
    parser.add_argument("--algorithms", default="standard,gram")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "profiles": []}
    for spec in args.shapes.split(","):
        shape = tuple(int(v) for v in spec.split("x"))
        for algorithm in args.algorithms.split(","):
            rows = kernel_times(shape, algorithm, args.calls)
            total = sum(r["us"] for r in rows)
            print(f"\n{spec} {algorithm}: {total / 1e3:.3f} ms of kernels per call")
            for r in rows:
                print(f"  {r['us']:9.1f} us  {r['launches']:3d}×  {r['kernel']}")
            result["profiles"].append({"shape": spec, "algorithm": algorithm, "kernel_ms": total / 1e3, "rows": rows})
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
