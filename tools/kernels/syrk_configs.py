"""Every tile configuration of the Newton–Schulz product kernels, each timed with a fixed config (no
autotuning), on GPU.

    PYTHONPATH=src python tools/kernels/syrk_configs.py --rounds 3 --cases 4096x4096 --out configs.json

Rows: the product (gram A = X·Xᵀ, poly P = a·I + b·A + c·A·A, product R·Z of two commuting symmetric
matrices as Gram Newton–Schulz needs it, combine X' = a·X + B·X), the shape and layout, the implementation
(our kernel with one fixed config and one way of reading tiles: pointers, descriptors built per program on
the device, or built once on the host; or cuBLAS), the median ms over ``--rounds`` interleaved rounds of
triton.testing.do_bench, TFLOP/s on the FLOPs the product needs (SYRK m²k per matrix, a full product 2mkn),
and the relative error against float64. The autotuner's configs are chosen from these; BENCHMARKS.md
quotes the winners.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing
from torch import Tensor

from dtensor_muon.kernels.triton_syrk import SYRK_SHAPES, symmetric_product, syrk

# The autotuner's configs (SYRK_SHAPES), then candidates outside it: K steps of 128 (half the barriers per
# FLOP, two stages) and two-stage or 32-deep pipelines small enough for three programs per SM.
EXTRA_SHAPES = [
    (1, 128, 128, 4, 2, None),
    (1, 128, 128, 8, 2, None),
    (1, 128, 64, 4, 2, None),
    (1, 128, 32, 4, 4, None),
]
SYRK_CANDIDATES = [
    {"RATIO": r, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "num_stages": st, "TMA_EPILOGUE": True}
    | ({"maxnreg": regs} if regs else {})
    for r, bn, bk, w, st, regs in (*SYRK_SHAPES, *EXTRA_SHAPES)
]


def name_of(cfg: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in cfg.items())


def rel_err(out: Tensor, ref: Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


class Measurements:
    """Collects (product, case, implementation, fn, FLOPs, reference) entries, checks each once, then times
    them all ``rounds`` times, interleaved (the card runs power-capped and its clock drifts: configs timed
    one after the other would compare clocks), and keeps each one's median."""

    def __init__(self) -> None:
        self.entries: list[dict] = []

    def add(
        self, product: str, case: str, impl: str, fn: Callable[[], Tensor], flops: float, ref: Tensor | None
    ) -> None:
        try:
            out = fn()
        except Exception as exc:  # a config that does not fit (shared memory, registers) is a result too
            print(f"{product:8} {case:34} {impl:70} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            self.entries.append({"product": product, "case": case, "impl": impl, "error": type(exc).__name__})
            return
        err = rel_err(out, ref) if ref is not None else float("nan")
        self.entries.append(
            {"product": product, "case": case, "impl": impl, "fn": fn, "flops": flops, "rel_err": err, "ms_rounds": []}
        )

    def time_all(self, rounds: int) -> list[dict]:
        """Times every entry that ran, ``rounds`` times interleaved; returns the rows (fn dropped)."""
        timed = [e for e in self.entries if "fn" in e]
        for _ in range(rounds):
            for e in timed:
                e["ms_rounds"].append(float(triton.testing.do_bench(e["fn"], warmup=10, rep=60)))
        rows = []
        for e in self.entries:
            row = {k: v for k, v in e.items() if k != "fn"}
            if "fn" in e:
                row["ms"] = statistics.median(e["ms_rounds"])
                row["tflops"] = e["flops"] / row["ms"] / 1e9
                print(
                    f"{row['product']:8} {row['case']:34} {row['impl']:70} {row['ms']:8.4f} ms "
                    f"{row['tflops']:6.1f} TFLOP/s err {row['rel_err']:.1e}",
                    flush=True,
                )
            rows.append(row)
        return rows


def normalized(*shape: int, transposed: bool) -> Tensor:
    """A bf16 X with σ ≤ 1 (Frobenius-normalized Gaussian); ``transposed``: a view of contiguous storage
    whose last two dims are swapped (how a tall gradient reaches the iteration)."""
    store = (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
    g = torch.randn(store, device="cuda")
    g = g / torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)
    g = g.to(torch.bfloat16)
    return g.mT if transposed else g


def run_case(
    measurements: Measurements, label: str, x: Tensor, coeffs: tuple[float, float, float], modes: list[str]
) -> None:
    a, b, c = coeffs
    batch = x.size(0) if x.ndim == 3 else 1
    m, k = x.shape[-2:]
    x64 = x.double()
    gram_ref = x64 @ x64.mT
    gram = syrk(x, config=SYRK_CANDIDATES[0])
    g64 = gram.double()
    eye = torch.eye(m, device="cuda", dtype=torch.float64)
    poly_ref = a * eye + b * g64 + c * g64 @ g64
    bmat = syrk(gram, c, b, gram, config=SYRK_CANDIDATES[0])
    pmat = syrk(gram, c, b, gram, diag=a, config=SYRK_CANDIDATES[0])
    comb_ref = a * x64 + bmat.double() @ x64
    sy_flops = batch * m * m * k
    poly_flops = batch * m**3
    full = 2 * batch * m * m * k
    for cfg in SYRK_CANDIDATES:
        for mode in modes:
            measurements.add(
                "gram",
                label,
                f"syrk tma={mode} " + name_of(cfg),
                lambda cfg=cfg, mode=mode: syrk(x, config=cfg, tma=mode),
                sy_flops,
                gram_ref,
            )
    measurements.add("gram", label, "cuBLAS x@x.mT", lambda: x @ x.mT, full, gram_ref)
    product_ref = g64 @ pmat.double()
    for cfg in SYRK_CANDIDATES:
        for mode in modes:
            measurements.add(
                "product",
                label,
                f"syrk tma={mode} " + name_of(cfg),
                lambda cfg=cfg, mode=mode: symmetric_product(gram, pmat, config=cfg, tma=mode),
                poly_flops,
                product_ref,
            )
    measurements.add("product", label, "cuBLAS R@Z", lambda: gram @ pmat, 2 * batch * m**3, product_ref)
    for cfg in SYRK_CANDIDATES:
        for mode in modes:
            measurements.add(
                "poly",
                label,
                f"syrk tma={mode} " + name_of(cfg),
                lambda cfg=cfg, mode=mode: syrk(gram, c, b, gram, diag=a, config=cfg, tma=mode),
                poly_flops,
                poly_ref,
            )
    if gram.ndim == 2:
        measurements.add(
            "poly",
            label,
            "cuBLAS addmm (no a·I)",
            lambda: torch.addmm(gram, gram, gram, beta=b, alpha=c),
            2 * m**3,
            None,
        )
    else:
        measurements.add(
            "poly",
            label,
            "cuBLAS baddbmm (no a·I)",
            lambda: torch.baddbmm(gram, gram, gram, beta=b, alpha=c),
            2 * batch * m**3,
            None,
        )
    transposed = x.stride(-2) == 1 and x.stride(-1) != 1
    if transposed:
        xt = x.mT  # contiguous [.., k, m]: X'ᵀ = a·Xᵀ + Xᵀ·B
        add = (
            (lambda: torch.addmm(xt, xt, bmat, beta=a))
            if x.ndim == 2
            else (lambda: torch.baddbmm(xt, xt, bmat, beta=a))
        )
        measurements.add("combine", label, "cuBLAS addmm a·Xᵀ + Xᵀ·B", lambda: add().mT, full, comb_ref)
        measurements.add("combine", label, "cuBLAS mm Xᵀ·P", lambda: (xt @ pmat).mT, full, comb_ref)
    else:
        add = (lambda: torch.addmm(x, bmat, x, beta=a)) if x.ndim == 2 else (lambda: torch.baddbmm(x, bmat, x, beta=a))
        measurements.add("combine", label, "cuBLAS addmm a·X + B·X", add, full, comb_ref)
        measurements.add("combine", label, "cuBLAS mm P·X", lambda: pmat @ x, full, comb_ref)


CASES = {
    "4096x14336": ((4096, 14336), False),
    "14336x4096 (transposed view)": ((4096, 14336), True),
    "4096x4096": ((4096, 4096), False),
    "64x2048x1408 (transposed view)": ((64, 1408, 2048), True),
    "8x1024x4096": ((8, 1024, 4096), False),
    "8192x8192": ((8192, 8192), False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated keys of CASES")
    parser.add_argument("--modes", default="host", help="comma-separated ways of reading tiles: off,device,host")
    parser.add_argument("--rounds", type=int, default=1, help="timings per entry, interleaved; median kept")
    args = parser.parse_args()
    torch.manual_seed(0)
    measurements = Measurements()
    for label in args.cases.split(","):
        shape, transposed = CASES[label]
        run_case(
            measurements,
            label,
            normalized(*shape, transposed=transposed),
            (3.4445, -4.775, 2.0315),
            args.modes.split(","),
        )
    rows = measurements.time_all(args.rounds)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "rounds": args.rounds,
                    "rows": rows,
                },
                indent=1,
            )
        )
    best: dict[tuple[str, str], dict] = {}
    for row in rows:
        key = (row["product"], row["case"])
        if "ms" in row and (key not in best or row["ms"] < best[key]["ms"]):
            best[key] = row
    print("\nfastest per product and case:")
    for (product, case), row in best.items():
        print(f"{product:8} {case:34} {row['ms']:8.4f} ms {row['tflops']:6.1f} TFLOP/s  {row['impl']}")


if __name__ == "__main__":
    main()
