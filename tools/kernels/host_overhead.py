"""Host (CPU) time to launch each piece of Newton–Schulz on the GPU, in microseconds per call.

    PYTHONPATH=src python tools/kernels/host_overhead.py --profile 8x1024x4096 --out host.json

Each piece is called n times back to back after a warm-up, without synchronizing, on inputs small enough
(1024²) that the GPU keeps up: the wall time over n is what Python, the autotuner, Triton's launcher and
the TMA descriptors cost per launch. The last row is one whole ``newton_schulz`` call on 4096² (there the
GPU work, about 2.2 ms on an H200, may bound it instead).

``--profile 8x1024x4096,4096x4096`` then times whole eager calls on those shapes (20 calls after two warm-ups)
and profiles them (cProfile, 20 more calls), printing the functions that hold the host longest, by own time per
call.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dtensor_muon.kernels.normalize import normalize_into
from dtensor_muon.kernels.triton_syrk import _host_descriptors, symmetric_product, syrk
from dtensor_muon.linalg.newton_schulz import newton_schulz

FIXED_CONFIG = {"RATIO": 1, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def host_us(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per call of ``fn``: ``calls`` calls enqueued without a synchronization."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def profile_call(shape: tuple[int, ...], calls: int = 20, top: int = 25) -> list[dict]:
    """The ``top`` functions by own host time per eager ``newton_schulz`` call on an fp32 input of ``shape``."""
    g = torch.randn(shape, device="cuda")
    newton_schulz(g)  # the first call tunes and compiles; host_us's own warm-up call then compiles the chosen configs
    print(
        f"newton_schulz {'x'.join(map(str, shape))}: {host_us(lambda: newton_schulz(g), calls):.0f} us of host "
        "time per call (no profiler)"
    )
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        newton_schulz(g)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    rows = [
        {
            "function": f"{path.rsplit('/', 1)[-1]}:{line} {name}",
            "calls": calls_made / calls,
            "own_us": own / calls * 1e6,
            "cumulative_us": cumulative / calls * 1e6,
        }
        for (path, line, name), (_, calls_made, own, cumulative, _) in stats.items()
    ]
    rows.sort(key=lambda row: -row["own_us"])
    total = sum(row["own_us"] for row in rows)
    print(f"newton_schulz {'x'.join(map(str, shape))}: {total:.0f} us of host time per call (cProfile)")
    for row in rows[:top]:
        print(
            f"{row['own_us']:9.1f} us own {row['cumulative_us']:9.1f} cumulative {row['calls']:6.1f}x  "
            f"{row['function']}"
        )
    return rows[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--profile", default="", help="shapes to profile whole calls on, e.g. 8x1024x4096")
    args = parser.parse_args()
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    a = syrk(x)
    x3, out = x.unsqueeze(0), torch.empty(1, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1024, 1024, device="cuda")
    start = torch.empty_like(g, dtype=torch.bfloat16)
    g4096 = torch.randn(4096, 4096, device="cuda")
    pieces: dict[str, Callable[[], object]] = {
        "syrk autotuned (gram)": lambda: syrk(x),
        "syrk autotuned (poly, with C)": lambda: syrk(a, 2.0, -4.7, a, diag=3.4),
        "syrk fixed config (no autotuner)": lambda: syrk(x, config=FIXED_CONFIG),
        "symmetric_product": lambda: symmetric_product(a, a),
        "5 host TMA descriptors (Python objects only)": lambda: _host_descriptors(x3, x3, out, out, False, True, None),
        "cuBLAS x @ x.mT": lambda: x @ x.mT,
        "normalize_into (norm + one-pass kernel)": lambda: normalize_into(g, start, 1e-7),
        "newton_schulz 4096² (whole call)": lambda: newton_schulz(g4096),
    }
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "host_us": {}}
    for name, fn in pieces.items():
        us = host_us(fn, 20 if "whole" in name else 200)
        result["host_us"][name] = us
        print(f"{us:9.1f} us  {name}", flush=True)
    for spec in filter(None, args.profile.split(",")):
        result.setdefault("profiles", {})[spec] = profile_call(tuple(int(v) for v in spec.split("x")))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
