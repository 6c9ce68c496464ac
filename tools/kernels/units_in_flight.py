"""Expert stacks computed in units: one unit after another (as the optimizer runs them), several units in flight
on side streams, and the whole stack as one call; the dispatch's kernels against forced SYRK kernels, each
Newton–Schulz form; and whether a matrix's bits depend on how many matrices share its call (GPU).

    PYTHONPATH=src python tools/kernels/units_in_flight.py --shapes 768x2048,2048x768 --total 128 --unit 8 \\
        --streams 2,4,8 --out units.json

Per shape, ``--total`` matrices split into units of ``--unit``; each unit is one ``NewtonSchulzGraphs`` call
(bf16, 5 steps, replayed from its CUDA graph):

- ``serial``: the units one after another on one stream, one graph per signature (today's order);
- ``streams K``: unit i on side stream i mod K, one ``NewtonSchulzGraphs`` (its own graph and buffers) per
  stream, every stream waiting for the inputs once and the main stream for every stream at the end; the row also
  says whether each unit's result is bitwise the serial one. Each runner's graphs are captured on a capture
  stream of its own; with ``--shared-capture-stream`` all on torch's default capture stream, whose cuBLAS
  workspace they then share and race on when replayed together (other bits: docs/kernels.md);
- ``stack``: the ``--total`` matrices as one call, and whether its result is bitwise the units' results.

Times are medians of the whole set's replays, timed as ``bench/bench_newton_schulz.py`` times (its ``time_ms``;
the recorded run took the median of 15 CUDA-event timings), against the symmetric floor 5·(3m²n + m³) FLOPs per
matrix (m ≤ n) at the bf16 8192³ rate measured the same way in the same run. The last table says, per
shape, whether the Triton SYRK kernel's Gram product and polynomial, and cuBLAS's ``bmm`` apply, give a matrix
the same bits alone, in a batch of ``--unit`` and in one of ``--total``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_newton_schulz import matmul_ceiling_tflops, time_ms

from dtensor_muon.kernels import use_backend
from dtensor_muon.kernels.triton_matmuls import symmetric_kernel
from dtensor_muon.linalg.ns_graphs import NewtonSchulzGraphs


def symmetric_floor_flops(matrices: int, m: int, n: int) -> int:
    """5 Newton–Schulz iterations with symmetric products: 5·(3m²n + m³) FLOPs per matrix, m ≤ n."""
    m, n = min(m, n), max(m, n)
    return matrices * 5 * (3 * m * m * n + m**3)


def in_flight(
    units: list[Tensor], runners: list[NewtonSchulzGraphs], algorithm: str, shared_capture: bool
) -> Callable[[], list[Tensor]]:
    """A call that runs unit i on side stream i mod K (K = len(runners)) and returns the units' results. Each
    runner captures its graphs first, one after another, on a capture stream of its own (``torch.cuda.graph``'s
    default capture stream replaced for it) unless ``shared_capture``."""
    streams = [torch.cuda.Stream() for _ in runners]
    default_capture = torch.cuda.graph.default_capture_stream
    for runner, stream, unit in zip(runners, streams, units):
        if not shared_capture:
            torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            runner(unit, algorithm=algorithm)
        torch.cuda.synchronize()
    torch.cuda.graph.default_capture_stream = default_capture

    def call() -> list[Tensor]:
        main = torch.cuda.current_stream()
        ready = main.record_event()
        outs = []
        for stream in streams:
            stream.wait_event(ready)
        for i, unit in enumerate(units):
            with torch.cuda.stream(streams[i % len(streams)]):
                outs.append(runners[i % len(runners)](unit, algorithm=algorithm))
        for stream in streams:
            main.wait_event(stream.record_event())
        return outs

    return call


def measure(
    g: Tensor, unit: int, streams: list[int], backend: str | None, algorithm: str, floor_ms: float, shared: bool
) -> dict:
    """One row: serial units, units in flight on each stream count, the whole stack."""
    units = [g[i : i + unit].contiguous() for i in range(0, g.size(0), unit)]
    row: dict = {"backend": backend or "dispatch", "algorithm": algorithm, "floor_ms": floor_ms}
    with use_backend(backend) if backend else contextlib.nullcontext():
        runner = NewtonSchulzGraphs()
        serial = [runner(u, algorithm=algorithm) for u in units]
        row["serial_ms"] = time_ms(lambda: [runner(u, algorithm=algorithm) for u in units], True)
        for k in streams:
            call = in_flight(units, [NewtonSchulzGraphs() for _ in range(k)], algorithm, shared)
            outs = call()
            torch.cuda.synchronize()
            row[f"streams{k}_same_bits"] = all(torch.equal(a, b) for a, b in zip(serial, outs))
            row[f"streams{k}_ms"] = time_ms(call, True)
        whole = NewtonSchulzGraphs()
        row["stack_same_bits"] = torch.equal(whole(g, algorithm=algorithm), torch.cat(serial))
        row["stack_ms"] = time_ms(lambda: whole(g, algorithm=algorithm), True)
    for key in [k for k in row if k.endswith("_ms") and k != "floor_ms"]:
        row[key.removesuffix("_ms") + "_x_floor"] = row[key] / floor_ms
    return row


def batch_count_bits(g: Tensor, unit: int) -> dict:
    """Whether the SYRK Gram product and polynomial, and cuBLAS's bmm apply, give a matrix the same bits alone, in
    a batch of ``unit`` and in the whole batch."""
    x = g.to(torch.bfloat16)
    x = x if x.size(-2) <= x.size(-1) else x.mT
    total = x.size(0)
    chunks = range(0, total, unit)
    gram = symmetric_kernel(x)
    a = gram / gram.norm(dim=(-2, -1), keepdim=True)
    poly = symmetric_kernel(a, alpha=2.0, beta=-4.0, c=a, diag=3.4)
    apply = torch.bmm(poly, x)
    return {
        "syrk_gram_unit": torch.equal(gram, torch.cat([symmetric_kernel(x[i : i + unit]) for i in chunks])),
        "syrk_gram_alone": torch.equal(gram, torch.stack([symmetric_kernel(x[i]) for i in range(total)])),
        "syrk_poly_alone": torch.equal(
            poly, torch.stack([symmetric_kernel(a[i], alpha=2.0, beta=-4.0, c=a[i], diag=3.4) for i in range(total)])
        ),
        "bmm_apply_unit": torch.equal(
            apply, torch.cat([torch.bmm(poly[i : i + unit], x[i : i + unit]) for i in chunks])
        ),
        "bmm_apply_alone": torch.equal(apply, torch.stack([poly[i] @ x[i] for i in range(total)])),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="768x2048,2048x768,1408x2048,2048x1408")
    parser.add_argument("--total", type=int, default=128)
    parser.add_argument("--unit", type=int, default=8)
    parser.add_argument("--streams", default="2,4,8")
    parser.add_argument("--backends", default="dispatch,syrk", help="dispatch (the optimizer's) and/or syrk (forced)")
    parser.add_argument("--algorithms", default="auto,standard,gram")
    parser.add_argument(
        "--shared-capture-stream", action="store_true", help="capture every runner's graphs on torch's one stream"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    streams = [int(k) for k in args.streams.split(",")]
    rate = matmul_ceiling_tflops(True)
    print(f"bf16 8192^3: {rate:.0f} TFLOP/s; {args.total} matrices per shape in units of {args.unit}", flush=True)
    rows, bits = [], []
    for spec in args.shapes.split(","):
        m, n = (int(v) for v in spec.split("x"))
        torch.manual_seed(0)
        g = torch.randn(args.total, m, n, device="cuda")
        floor_ms = symmetric_floor_flops(args.total, m, n) / rate / 1e9
        for backend in args.backends.split(","):
            for algorithm in args.algorithms.split(","):
                forced = None if backend == "dispatch" else backend
                measured = measure(g, args.unit, streams, forced, algorithm, floor_ms, args.shared_capture_stream)
                row = {"shape": f"{args.total}x{m}x{n}", **measured}
                rows.append(row)
                cells = " ".join(
                    f"{k.removesuffix('_x_floor')} {v:.2f}" for k, v in row.items() if k.endswith("_x_floor")
                )
                same = all(v for k, v in row.items() if k.endswith("same_bits") and not k.startswith("stack"))
                print(
                    f"{row['shape']} {row['backend']:8} {algorithm:8} floor {floor_ms:.3f} ms | x floor: {cells} | streams same bits {same}, stack same bits {row['stack_same_bits']}",
                    flush=True,
                )
                torch.cuda.empty_cache()
        bits.append({"shape": f"{m}x{n}", **batch_count_bits(g, args.unit)})
        print(json.dumps(bits[-1]), flush=True)
        del g
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"matmul_tflops": rate, "rows": rows, "bits": bits}, indent=1))


if __name__ == "__main__":
    main()
