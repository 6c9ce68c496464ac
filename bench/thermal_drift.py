"""Whether do_bench's cache flush or the card's drift over a run explains the gap between a Newton–Schulz call
timed alone (do_bench) and the same call timed in a chain (chain_breakdown.py) (GPU only).

    PYTHONPATH=src python3 bench/thermal_drift.py --shapes 4096x4096,64x2048x1408

Per shape: five blocks of 40 back-to-back calls, each call between two CUDA events (median of the last 35),
with nothing, a 256 MB memset (do_bench's L2 flush) or a 1 kB memset before each call, in the order none,
flush, tiny, flush, none; then do_bench. Equal figures for flush and none within a pass, rising from the first
block to the last, mean the card's state, not the flush, moves the time.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from dtensor_muon.newton_schulz import newton_schulz

ORDER = ("none", "flush", "tiny", "flush", "none")


def blocks(shape: tuple[int, ...], calls: int = 40, skip: int = 5) -> list[tuple[str, float]]:
    g = torch.randn(shape, device="cuda")
    newton_schulz(g)
    torch.cuda.synchronize()
    before = {"none": None, "flush": torch.empty(256 << 20, dtype=torch.int8, device="cuda"),
              "tiny": torch.empty(1024, dtype=torch.int8, device="cuda")}
    rows = []
    for name in ORDER:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, end in events:
            if before[name] is not None:
                before[name].zero_()
            start.record()
            newton_schulz(g)
            end.record()
        torch.cuda.synchronize()
        rows.append((name, statistics.median(s.elapsed_time(e) for s, e in events[skip:])))
    rows.append(("do_bench", triton.testing.do_bench(lambda: newton_schulz(g), return_mode="median")))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x4096,64x2048x1408")
    args = parser.parse_args()
    for spec in args.shapes.split(","):
        rows = blocks(tuple(int(v) for v in spec.split("x")))
        print(f"{spec:>14}: " + ", ".join(f"{name} {ms:.3f}" for name, ms in rows), flush=True)


if __name__ == "__main__":
    main()
