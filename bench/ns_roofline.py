"""The roofline of one Newton–Schulz call: each product's least time, max(FLOPs / matmul rate, bytes / copy rate),
summed over the products the library's iteration runs.

    PYTHONPATH=src:bench python bench/ns_roofline.py --shapes 128x768x2048,8x1408x2048 --tflops 680 --gbps 3000

The products are recorded from the library's own iteration (:func:`products`: ``linalg.newton_schulz.iterate``
through the torch backend on meta tensors, nothing computed), so their count follows the code: in Gram form, per
segment of L iterations one Gram matrix, L polynomials, 3(L − 1) products of symmetric m×m matrices and one
apply; in the standard form per iteration one Gram matrix, one polynomial and one apply. Per matrix of a wide
[m, n] call (m ≤ n; a tall one runs transposed), bf16 operands (2 bytes), every operand read once from memory and
every result written once, symmetric results whole (the SYRK kernels mirror their lower tiles):

    kind      computes                     FLOPs (symmetric outputs count their lower half)   bytes
    gram      R = X·Xᵀ                     m²n                                                2(mn + m²)
    poly      Z = a·I + b·R + c·R²         m³ (R is both factors and the added matrix)        2(m² + m²)
    product   Y = S·T, S, T symmetric      m³                                                 2(2m² + m²)
    apply     X' = Q·X (+ a·X)             2m²n                                               2(m² + 2mn)

A product is memory-bound when its FLOPs per byte fall below the card's ridge, rate / copy rate: the m×m
products do m³ FLOPs on 6m² bytes, m/6 FLOPs a byte, 128 at m = 768, against a ridge of about 680/3.0 = 227 on
an H100 and 680/4.3 = 158 on an H200. Their operands stay in the L2 cache only where a call's m×m matrices
fit there (128 matrices of 768² bf16 are 151 MB a factor; an H100's L2 holds 50 MB), so that bound holds for
stacked expert calls. The symmetric floor the benchmarks quote, 5·(3m²n + m³) FLOPs at the matmul rate,
counts FLOPs only and is the standard form's count; the Gram form does fewer FLOPs (0.78× at 768×2048) but
moves more bytes in its m×m products.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from optimizer_step import NS_STEPS, ns_flops
from torch import Tensor

from dtensor_muon.kernels.torch_matmuls import TorchMatmuls
from dtensor_muon.linalg.newton_schulz import KELLER_COEFFICIENTS, iterate

BF16_BYTES = 2
KINDS = ("gram", "poly", "product", "apply")


@dataclass(frozen=True)
class Product:
    """One product of a call, per matrix: its kind (:data:`KINDS`), the wide matrix's m ≤ n, FLOPs and bytes."""

    kind: str
    m: int
    n: int

    @property
    def flops(self) -> int:
        m, n = self.m, self.n
        return {"gram": m * m * n, "poly": m**3, "product": m**3, "apply": 2 * m * m * n}[self.kind]

    @property
    def bytes(self) -> int:
        m, n = self.m, self.n
        elements = {"gram": m * n + m * m, "poly": 2 * m * m, "product": 3 * m * m, "apply": m * m + 2 * m * n}
        return BF16_BYTES * elements[self.kind]

    def least_seconds(self, tflops: float, gbps: float) -> float:
        """max(FLOPs / rate, bytes / copy rate)."""
        return max(self.flops / (tflops * 1e12), self.bytes / (gbps * 1e9))


class RecordingMatmuls(TorchMatmuls):
    """The torch backend, recording each product the iteration asks for (calls made inside another are its
    parts, not recorded again)."""

    def __init__(self) -> None:
        super().__init__()
        self.products: list[Product] = []
        self._depth = 0

    def _record(self, kind: str, m: int, n: int, compute: Any) -> Tensor:
        if self._depth == 0:
            self.products.append(Product(kind, m, n))
        self._depth += 1
        try:
            return compute()
        finally:
            self._depth -= 1

    def gram(self, x: Tensor, scale: Tensor | None = None, lower_out: bool = False) -> Tensor:
        return self._record("gram", x.shape[-2], x.shape[-1], lambda: super(RecordingMatmuls, self).gram(x, scale))

    def gram_poly(self, a: Tensor, b: float, c: float) -> Tensor:
        m = a.shape[-1]
        return self._record("poly", m, m, lambda: super(RecordingMatmuls, self).gram_poly(a, b, c))

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
        m = gram.shape[-1]
        return self._record("poly", m, m, lambda: super(RecordingMatmuls, self).poly(gram, a, b, c, scale))

    def symmetric_product(
        self, x: Tensor, y: Tensor, scale: Tensor | None = None, lower_in: bool = False, lower_out: bool = False
    ) -> Tensor:
        m = x.shape[-1]
        return self._record("product", m, m, lambda: super(RecordingMatmuls, self).symmetric_product(x, y, scale))

    def combine(self, x: Tensor, bmat: Tensor, a: float) -> Tensor:
        m, n = x.shape[-2:]
        return self._record("apply", m, n, lambda: super(RecordingMatmuls, self).combine(x, bmat, a))

    def apply(self, p: Tensor, x: Tensor) -> Tensor:
        m, n = x.shape[-2:]
        return self._record("apply", m, n, lambda: super(RecordingMatmuls, self).apply(p, x))


def products(rows: int, cols: int, algorithm: str, steps: int = NS_STEPS) -> list[Product]:
    """The products of one ``steps``-iteration call on a ``rows``×``cols`` matrix in ``algorithm`` ("gram" or
    "standard"), per matrix, as the library runs them (on meta tensors: shapes only)."""
    if algorithm not in ("gram", "standard"):
        raise ValueError(f"ns_roofline: algorithm must be 'gram' or 'standard', got {algorithm!r}")
    m, n = min(rows, cols), max(rows, cols)
    backend = RecordingMatmuls()
    iterate(torch.empty(m, n, device="meta", dtype=torch.bfloat16), (KELLER_COEFFICIENTS,) * steps, backend, algorithm)
    return backend.products


def roofline(shape: tuple[int, ...], algorithm: str, tflops: float, gbps: float) -> dict[str, Any]:
    """Per kind and in all, for a [B, rows, cols] (or [rows, cols]) call: the count, FLOPs, bytes, the least
    time in ms (``kinds``, ``roofline_ms``), that time with every product at the matmul rate (``compute_ms``),
    and the symmetric floor at the same rate (``floor_ms``: :func:`optimizer_step.ns_flops`)."""
    batch = shape[0] if len(shape) == 3 else 1
    rows, cols = shape[-2:]
    found = products(rows, cols, algorithm)
    kinds: dict[str, dict[str, float]] = {}
    for p in found:
        row = kinds.setdefault(p.kind, {"count": 0, "flops": 0.0, "bytes": 0.0, "roofline_ms": 0.0, "memory_ms": 0.0})
        row["count"] += 1
        row["flops"] += batch * p.flops
        row["bytes"] += batch * p.bytes
        row["roofline_ms"] += 1e3 * batch * p.least_seconds(tflops, gbps)
        row["memory_ms"] += 1e3 * batch * p.bytes / (gbps * 1e9)
    for row in kinds.values():
        row["memory_bound"] = row["memory_ms"] > 1e3 * row["flops"] / (tflops * 1e12)
    return {
        "shape": "x".join(map(str, shape)),
        "algorithm": algorithm,
        "tflops": tflops,
        "gbps": gbps,
        "kinds": kinds,
        "roofline_ms": sum(row["roofline_ms"] for row in kinds.values()),
        "compute_ms": 1e3 * sum(row["flops"] for row in kinds.values()) / (tflops * 1e12),
        "floor_ms": 1e3 * ns_flops(shape)[0] / (tflops * 1e12),
    }


def table(result: dict[str, Any]) -> str:
    """A result of :func:`roofline` as printed lines."""
    floor = result["floor_ms"]
    lines = [
        f"{result['shape']} {result['algorithm']} at {result['tflops']:.0f} TFLOP/s, {result['gbps']:.0f} GB/s: "
        f"roofline {result['roofline_ms']:.3f} ms ({result['roofline_ms'] / floor:.2f}x the symmetric floor "
        f"{floor:.3f} ms), FLOPs alone {result['compute_ms']:.3f} ms ({result['compute_ms'] / floor:.2f}x)",
        f"  {'kind':8} {'n':>3} {'GFLOP':>9} {'MB':>9} {'FLOP/B':>7} {'roofline ms':>12}  bound by",
    ]
    for kind in KINDS:
        row = result["kinds"].get(kind)
        if row is None:
            continue
        lines.append(
            f"  {kind:8} {row['count']:3d} {row['flops'] / 1e9:9.1f} {row['bytes'] / 1e6:9.1f} "
            f"{row['flops'] / row['bytes']:7.0f} {row['roofline_ms']:12.3f}  "
            f"{'memory' if row['memory_bound'] else 'FLOPs'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="128x768x2048,128x1024x2048,8x1408x2048,4x2048x7168")
    parser.add_argument("--algorithms", default="gram,standard")
    parser.add_argument("--tflops", type=float, default=680.0, help="the card's bf16 8192³ matmul rate")
    parser.add_argument("--gbps", type=float, default=3000.0, help="the card's copy rate, bytes read + written")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "ns_roofline.json")
    args = parser.parse_args()
    results = []
    for spec in args.shapes.split(","):
        shape = tuple(int(v) for v in spec.split("x"))
        for algorithm in args.algorithms.split(","):
            result = roofline(shape, algorithm, args.tflops, args.gbps)
            results.append(result)
            print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"computed": "no device: arithmetic only", "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
