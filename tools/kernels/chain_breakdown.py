"""Where a Newton–Schulz call's time goes when its products run back to back, against the same products
timed alone.

    PYTHONPATH=src:bench python tools/kernels/chain_breakdown.py --shapes 4096x4096,64x2048x1408 --out chain.json
    ... --shapes 128x768x2048 --algorithms gram --keep-lower-tiles 0     (then 1: the chain on lower tiles)

For each shape and form ("standard", "gram"): the whole call timed by ``triton.testing.do_bench`` (median);
the same call ``--calls`` times back to back with a CUDA event after every product (gram, poly,
symmetric_product, apply, and the start), each product's time the gap between its event and the one
before (so launch gaps count), median over the calls; and each distinct product timed alone by
``do_bench`` on the inputs it saw in the chain. "chain − alone" per product is what running in a chain
costs (clock under sustained load, caches, launch gaps). Beside them each kind's roofline
(``bench/ns_roofline.py``: max(FLOPs / rate, bytes / copy rate) per product, at the bf16 8192³ matmul rate and
the copy rate measured in the same run) and "chain / roofline", how far each kind runs from what the card allows
it. Also prints the config the autotuner chose for each SYRK key.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from ns_roofline import roofline
from optimizer_step import device_copy_gbps, matmul_ceiling
from torch import Tensor

from dtensor_muon.kernels import triton_matmuls, triton_syrk, ws_syrk
from dtensor_muon.kernels.triton_matmuls import TritonMatmuls
from dtensor_muon.linalg.newton_schulz import (
    KELLER_COEFFICIENTS,
    in_layout_of,
    iterate,
    newton_schulz,
)


class TimedMatmuls(TritonMatmuls):
    """The GPU backend with a CUDA event recorded after every product, and the last inputs of each kind kept."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, torch.cuda.Event]] = []
        self.inputs: dict[str, Callable[[], object]] = {}

    def _mark(self, kind: str, fn: Callable[[], Any]) -> Any:
        out = fn()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append((kind, event))
        self.inputs[kind] = fn
        return out

    def start_into(
        self, g: Tensor, out: Tensor, x: Tensor, eps: float, scale_out: Tensor | None = None
    ) -> Tensor | None:
        return self._mark("start", lambda: super(TimedMatmuls, self).start_into(g, out, x, eps, scale_out))

    def gram(self, x: Tensor, scale: Tensor | None = None, lower_out: bool = False) -> Tensor:
        return self._mark("gram", lambda: super(TimedMatmuls, self).gram(x, scale, lower_out))

    def poly(
        self,
        gram: Tensor,
        a: float,
        b: float,
        c: float,
        scale: Tensor | None = None,
        lower_in: bool = False,
        lower_out: bool = False,
    ) -> Tensor:
        return self._mark("poly", lambda: super(TimedMatmuls, self).poly(gram, a, b, c, scale, lower_in, lower_out))

    def symmetric_product(
        self, x: Tensor, y: Tensor, scale: Tensor | None = None, lower_in: bool = False, lower_out: bool = False
    ) -> Tensor:
        return self._mark(
            "product", lambda: super(TimedMatmuls, self).symmetric_product(x, y, scale, lower_in, lower_out)
        )

    def apply(self, p: Tensor, x: Tensor) -> Tensor:
        return self._mark("apply", lambda: super(TimedMatmuls, self).apply(p, x))


def timed_call(g: Tensor, backend: TimedMatmuls, algorithm: str) -> None:
    """One newton_schulz call through ``backend`` (same steps as newton_schulz, events after each product)."""
    start = torch.empty_like(g, dtype=torch.bfloat16)
    x = in_layout_of(start, g)
    first = torch.cuda.Event(enable_timing=True)
    first.record()
    backend.events.append(("begin", first))
    scale = backend.start_into(g, start, x, 1e-7)
    in_layout_of(iterate(x, (KELLER_COEFFICIENTS,) * 5, backend, algorithm, scale), g)


def breakdown(shape: tuple[int, ...], algorithm: str, calls: int, tflops: float, gbps: float) -> dict:
    g = torch.randn(shape, device="cuda")
    whole = lambda: newton_schulz(g, algorithm=algorithm)
    whole()
    torch.cuda.synchronize()
    backend = TimedMatmuls()
    timed_call(g, backend, algorithm)  # warm: tuning, compilation
    torch.cuda.synchronize()
    backend.events.clear()
    for _ in range(calls):
        timed_call(g, backend, algorithm)
    torch.cuda.synchronize()
    per_call: list[list[tuple[str, float]]] = []
    previous = None
    for kind, event in backend.events:
        if kind == "begin":
            per_call.append([])
        elif previous is not None:
            per_call[-1].append((kind, previous.elapsed_time(event)))
        previous = event
    kinds = [k for k, _ in per_call[0]]
    chain_ms = [statistics.median(c[i][1] for c in per_call) for i in range(len(kinds))]
    totals = [sum(t for _, t in c) for c in per_call]
    chain_by_kind: dict[str, list[float]] = {}
    for kind, ms in zip(kinds, chain_ms):
        chain_by_kind.setdefault(kind, []).append(ms)
    alone = {kind: triton.testing.do_bench(fn) for kind, fn in backend.inputs.items()}
    whole_ms = triton.testing.do_bench(whole)
    bounds = roofline(shape, algorithm, tflops, gbps)
    rows = [
        {
            "product": kind,
            "count": len(times),
            "chain_ms_each": statistics.mean(times),
            "alone_ms": alone[kind],
            "chain_total_ms": sum(times),
            "roofline_ms": bounds["kinds"][kind]["roofline_ms"] if kind in bounds["kinds"] else None,
        }
        for kind, times in chain_by_kind.items()
    ]
    return {
        "shape": "x".join(map(str, shape)),
        "algorithm": algorithm,
        "whole_do_bench_ms": whole_ms,
        "roofline_ms": bounds["roofline_ms"],
        "floor_ms": bounds["floor_ms"],
        "chain_sum_ms": statistics.median(totals),
        "alone_sum_ms": sum(r["count"] * r["alone_ms"] for r in rows),
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x4096,64x2048x1408")
    parser.add_argument("--algorithms", default="standard,gram")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument(
        "--ws-min-work",
        type=float,
        default=None,
        help="override ws_syrk.WS_MIN_WORK (fewest multiply-adds for the Gluon kernel; 0: every product it supports)",
    )
    parser.add_argument(
        "--keep-lower-tiles",
        type=int,
        choices=(0, 1),
        default=None,
        help="set triton_matmuls.KEEP_LOWER_TILES (Gram chains on lower tiles where they can; 0: whole matrices)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.ws_min_work is not None:
        ws_syrk.WS_MIN_WORK = args.ws_min_work
    if args.keep_lower_tiles is not None:
        triton_matmuls.KEEP_LOWER_TILES = args.keep_lower_tiles
    tflops = matmul_ceiling(torch.device("cuda"))["tflops"]
    gbps = device_copy_gbps(torch.device("cuda"))
    print(f"bf16 8192³ matmul {tflops:.0f} TFLOP/s, copy rate {gbps:.0f} GB/s")
    results = []
    for spec in args.shapes.split(","):
        shape = tuple(int(v) for v in spec.split("x"))
        for algorithm in args.algorithms.split(","):
            print(f"[{time.strftime('%H:%M:%S')}] {spec} {algorithm}", flush=True)
            r = breakdown(shape, algorithm, args.calls, tflops, gbps)
            results.append(r)
            print(
                f"{spec} {algorithm}: whole (do_bench) {r['whole_do_bench_ms']:.3f} ms, chain sum "
                f"{r['chain_sum_ms']:.3f}, products alone summed {r['alone_sum_ms']:.3f}; roofline "
                f"{r['roofline_ms']:.3f} ({r['whole_do_bench_ms'] / r['roofline_ms']:.2f}x), symmetric floor "
                f"{r['floor_ms']:.3f} ({r['whole_do_bench_ms'] / r['floor_ms']:.2f}x)"
            )
            print(
                f"  {'product':8} {'n':>3} {'chain ms':>9} {'alone ms':>9} {'chain-alone':>11} {'roofline ms':>11} "
                f"{'chain/roofline':>14}"
            )
            for row in r["rows"]:
                bound = row["roofline_ms"]
                ratio = f"{row['chain_total_ms'] / bound:14.2f}" if bound else f"{'':14}"
                print(
                    f"  {row['product']:8} {row['count']:3d} {row['chain_ms_each']:9.4f} {row['alone_ms']:9.4f} "
                    f"{row['chain_ms_each'] - row['alone_ms']:+11.4f} {bound or 0:11.4f} {ratio}"
                )
    tuned = {str(k[:7]): v for k, v in triton_syrk._TUNED.items()}
    print("autotuner's choices (m, k, batch, transposed, mode, epilogue, has_c):")
    for key, config in tuned.items():
        print(f"  {key}: {config}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "device": torch.cuda.get_device_name(),
            "matmul_tflops": tflops,
            "copy_gbps": gbps,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "results": results,
            "tuned": tuned,
        }
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
