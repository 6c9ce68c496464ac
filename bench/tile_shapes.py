"""Which tile shape a plain Triton product X·Yᵀ (TMA host descriptors, ``tl.dot``, non-persistent) runs
fastest at on this GPU, against cuBLAS: the question behind the SYRK kernel's tiles, without the
triangle (so wave quantization is the same for every shape).

    python bench/tile_shapes.py --rounds 5 --out bench/results/tile_shapes_h200.json

For each case (m, k): C = X·Yᵀ with X, Y [m, k] bf16, checked against an fp32 product (relative error
< 1e-2), then every config and cuBLAS timed ``--rounds`` times interleaved by
``triton.testing.do_bench_cudagraph``; median ms and TFLOP/s (2m²k).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, maxnreg)
CONFIGS: dict[str, tuple[int, int, int, int, int, int | None]] = {
    "128x128x64 w8 s3 r128": (128, 128, 64, 8, 3, 128),
    "128x128x64 w4 s3": (128, 128, 64, 4, 3, None),
    "128x256x64 w8 s3": (128, 256, 64, 8, 3, None),
    "128x256x64 w8 s4": (128, 256, 64, 8, 4, None),
    "256x128x64 w8 s3": (256, 128, 64, 8, 3, None),
}
CASES = ((4096, 4096), (8192, 8192), (1408 * 8, 1408))


@triton.jit
def _product_kernel(a_desc, b_desc, c_desc, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    GROUP: tl.constexpr):
    """C tile (pm, pn) = Σ_k X[pm, k]·Y[pn, k]ᵀ, programs grouped GROUP tile rows at a time."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(a_desc.shape[0], BM)
    num_n = tl.cdiv(b_desc.shape[0], BN)
    group = pid // (GROUP * num_n)
    first_m = group * GROUP
    size = min(num_m - first_m, GROUP)
    pm = first_m + (pid % size)
    pn = (pid % (GROUP * num_n)) // size
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = a_desc.load([pm * BM, k])
        b = b_desc.load([pn * BN, k])
        acc = tl.dot(a, tl.trans(b), acc)
    c_desc.store([pm * BM, pn * BN], acc.to(tl.bfloat16))


def product(x: Tensor, y: Tensor, out: Tensor, config: tuple[int, int, int, int, int, int | None]) -> None:
    """out = x·yᵀ with one fixed config."""
    bm, bn, bk, warps, stages, regs = config
    a = TensorDescriptor.from_tensor(x, [bm, bk])
    b = TensorDescriptor.from_tensor(y, [bn, bk])
    c = TensorDescriptor.from_tensor(out, [bm, bn])
    grid = (triton.cdiv(x.shape[0], bm) * triton.cdiv(y.shape[0], bn),)
    options = {"num_warps": warps, "num_stages": stages} | ({"maxnreg": regs} if regs else {})
    _product_kernel[grid](a, b, c, x.shape[1], BM=bm, BN=bn, BK=bk, GROUP=8, **options)


def methods_for(x: Tensor, y: Tensor, out: Tensor) -> dict[str, Callable[[], object]]:
    """Each config of CONFIGS, and cuBLAS, writing x·yᵀ into ``out``."""
    methods: dict[str, Callable[[], object]] = {
        name: (lambda config=config: product(x, y, out, config)) for name, config in CONFIGS.items()
    }
    methods["cuBLAS"] = lambda: torch.matmul(x, y.T, out=out)
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows = []
    for m, k in CASES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, m, device="cuda", dtype=torch.bfloat16)
        reference = x.float() @ y.float().T
        methods = methods_for(x, y, out)
        for name, fn in methods.items():
            fn()
            error = ((out.float() - reference).norm() / reference.norm()).item()
            if error >= 1e-2:
                raise RuntimeError(f"{name} on {m}x{k}: relative error {error:.2e}")
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                torch.cuda.synchronize()
                times[name].append(triton.testing.do_bench_cudagraph(fn, rep=100))
                torch.cuda.synchronize()
        print(f"m={m} k={k}")
        for name, ms_rounds in times.items():
            ms = statistics.median(ms_rounds)
            tflops = 2 * m * m * k / ms / 1e9
            rows.append({"m": m, "k": k, "impl": name, "ms": ms, "tflops": tflops, "ms_rounds": ms_rounds})
            print(f"  {name:24} {ms:8.4f} ms {tflops:7.1f} TFLOP/s")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                   "rows": rows}
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
