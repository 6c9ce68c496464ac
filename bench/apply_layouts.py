"""Newton–Schulz's third product X' = P·X (P symmetric) through cuBLAS, in each layout that gives the same
values: which operand cuBLAS sees transposed, and whether X' comes out in X's storage layout.

    PYTHONPATH=src python3 bench/apply_layouts.py --rounds 5 --out bench/results/apply_layouts_h200.json

For each shape X (wide view [.., m, n], m ≤ n; "tall" when X is the transposed view of a contiguous [.., n, m]
buffer, as the library holds a tall gradient) the variants are:

- ``P·X``: ``P @ X`` (X's own layout in, a contiguous wide X' out);
- ``Pᵀ·X``: ``P.mT @ X`` (the same values since P = Pᵀ; cuBLAS reads P transposed);
- ``(Xᵀ·P)ᵀ`` and ``(Xᵀ·Pᵀ)ᵀ``: the product on Xᵀ's storage (X' comes out in the tall layout, what the library
  runs for a tall X).

Also, for the batched shape, the Gram matrix X·Xᵀ by the warp-specialized SYRK kernel from either layout.
Each is timed by ``triton.testing.do_bench`` (median ms), the variants interleaved, ``--rounds`` rounds; the
table gives the median over rounds, TFLOP/s (2·m²·n per matrix) and the ratio to the library's variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import triton

from dtensor_muon.kernels.ws_syrk import ws_syrk

SHAPES = {"64x2048x1408": (64, 2048, 1408), "4096x4096": (1, 4096, 4096), "4096x14336": (1, 4096, 14336),
          "14336x4096": (1, 14336, 4096)}


def variants(batch: int, rows: int, cols: int) -> tuple[dict[str, Callable[[], object]], str, int]:
    """The variants for a gradient [batch, rows, cols] (2-D when batch is 1), the library's one, multiply-adds."""
    m, n = min(rows, cols), max(rows, cols)
    tall = rows > cols
    shape = (batch, rows, cols) if batch > 1 else (rows, cols)
    storage = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x = storage.mT if tall else storage  # the wide working view
    p = torch.randn(*shape[:-2], m, m, device="cuda", dtype=torch.bfloat16)
    p = (p + p.mT) / 2
    cases: dict[str, Callable[[], object]] = {
        "P·X": lambda: p @ x,
        "Pᵀ·X": lambda: p.mT @ x,
        "(Xᵀ·P)ᵀ": lambda: x.mT @ p,
        "(Xᵀ·Pᵀ)ᵀ": lambda: x.mT @ p.mT,
    }
    if batch > 1:
        wide = x.contiguous()
        cases["gram, X transposed view"] = lambda: ws_syrk(x)
        cases["gram, X contiguous"] = lambda: ws_syrk(wide)
    return cases, "(Xᵀ·P)ᵀ" if tall else "P·X", batch * m * m * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for name in args.shapes.split(","):
        cases, library, macs = variants(*SHAPES[name])
        times: dict[str, list[float]] = {case: [] for case in cases}
        for _ in range(args.rounds):
            for case, fn in cases.items():
                times[case].append(triton.testing.do_bench(fn, warmup=25, rep=100))
        base = statistics.median(times[library])
        print(f"\n{name} (library: {library})")
        print(f"{'variant':<26} {'ms':>8} {'TFLOP/s':>8} {'/library':>8}")
        for case, ts in times.items():
            ms = statistics.median(ts)
            work = macs // 2 if case.startswith("gram") else macs
            print(f"{case:<26} {ms:8.4f} {2 * work / ms / 1e9:8.1f} {ms / base:8.3f}")
            results.append({"shape": name, "variant": case, "library": case == library, "ms": ms,
                            "rounds_ms": ts})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
