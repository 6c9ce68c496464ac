"""How fast Hopper's wgmma runs from shared memory alone, per instruction shape and warpgroup arrangement: the
ceiling a SYRK tile shape can reach before any TMA traffic, epilogue or synchronisation.

    PYTHONPATH=src python3 bench/wgmma_rate_probe.py --out bench/results/wgmma_rate_h200.json

Each program (one per SM) holds an A block [BM, 64] and a B block [BN, 64] in shared memory and issues
``iters`` back-to-back ``warpgroup_mma`` calls on them (4 k16 steps each, one group in flight, as the SYRK
kernel's main loop does), then stores its accumulator. Cases:

- ``one BMxBN``: one warpgroup, a BM×BN accumulator (BM/64 instructions m64nBNk16 per k16 step);
- ``two BMxBN``: two warpgroups (``warp_specialize``) issuing at once, each its own BM×BN accumulator on the
  same blocks: the SYRK kernel's two consumers if they never took turns;
- ``coop 128xBN``: eight warps, one 128×BN accumulator split 64 rows per warpgroup (a cooperative tile).

Columns: median ms of ``do_bench`` over ``--rounds`` interleaved rounds, multiply-adds, TFLOP/s, and the ratio
to cuBLAS's 8192³ bf16 matmul timed in the same rounds (the card's sustained ceiling). The shared-memory
bytes each multiply-add needs from the operand reads alone are (BM·16 + (BM/64)·BN·16)·2 / (BM·BN·16).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

BK = 64


@gluon.jit
def _issue(a_smem, b_smem, out_ptr, iters, ACC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """``iters`` wgmma calls acc += A·Bᵀ on the resident blocks, then acc into out (so nothing is dropped)."""
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    for _ in range(iters):
        acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))[:, None]
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))[None, :]
    gl.store(out_ptr + gl.program_id(0) * BM * BN + rows * BN + cols, acc)


@gluon.jit
def resident(ptr, ROWS: gl.constexpr, LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    """A [ROWS, BK] block of ``ptr`` copied into shared memory."""
    load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, load_layout))[:, None]
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, load_layout))[None, :]
    return gl.allocate_shared_memory(ptr.dtype.element_ty, [ROWS, 64], LAYOUT, gl.load(ptr + rows * 64 + cols))


@gluon.jit
def one_kernel(a_ptr, b_ptr, out_ptr, iters, ACC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    a_smem = resident(a_ptr, BM, A_LAYOUT, num_warps)
    b_smem = resident(b_ptr, BN, B_LAYOUT, num_warps)
    _issue(a_smem, b_smem, out_ptr, iters, ACC, BM, BN)


@gluon.jit
def two_kernel(a_ptr, b_ptr, out_ptr, out2_ptr, iters, ACC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, num_warps: gl.constexpr):
    a_smem = resident(a_ptr, BM, A_LAYOUT, num_warps)
    b_smem = resident(b_ptr, BN, B_LAYOUT, num_warps)
    gl.warp_specialize([(_issue, (a_smem, b_smem, out_ptr, iters, ACC, BM, BN)),
                        (_issue, (a_smem, b_smem, out2_ptr, iters, ACC, BM, BN))], [4], [232])


def layout(rows: int) -> object:
    return gl.NVMMASharedLayout.get_default_for([rows, BK], gl.bfloat16)


def case(kind: str, bm: int, bn: int, target_macs: float, programs: int):
    """(callable, multiply-adds per call) of one case, as many iterations as make about ``target_macs``."""
    warps = 8 if kind == "coop" else 4
    per_iteration = (2 if kind == "two" else 1) * programs * bm * bn * BK
    iters = max(1, int(target_macs / per_iteration))
    a = torch.randn(bm, BK, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(bn, BK, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(programs, bm, bn, device="cuda")
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bn, 16])
    shapes = (acc, bm, bn, layout(bm), layout(bn))
    if kind == "two":
        out2 = torch.empty_like(out)
        fn = lambda: two_kernel[(programs,)](a, b, out, out2, iters, *shapes, num_warps=warps)
    else:
        fn = lambda: one_kernel[(programs,)](a, b, out, iters, *shapes, num_warps=warps)
    return fn, iters * per_iteration


# Gluon's tensors have power-of-two shapes, so 128×176 or 128×192 accumulators (cuBLAS's 176-wide tiles)
# cannot be written; a "coop" BM of 256 gives each warpgroup 128 rows.
CASES = [("one", 128, 128), ("two", 128, 128), ("one", 64, 256), ("two", 64, 256), ("one", 64, 128),
         ("two", 64, 128), ("coop", 128, 256), ("coop", 128, 128), ("coop", 256, 128)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--macs", type=float, default=2.0**40, help="multiply-adds per timed call, about")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    cases = {}
    for kind, bm, bn in CASES:
        try:
            fn, macs = case(kind, bm, bn, args.macs, programs)
            fn()
            torch.cuda.synchronize()
            cases[f"{kind} {bm}x{bn}"] = (fn, macs)
        except Exception as error:  # a shape this Triton cannot build is reported, not fatal
            print(f"{kind} {bm}x{bn}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    cases["cuBLAS 8192^3"] = (lambda: x @ x, 8192**3)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (fn, _) in cases.items():
            times[name].append(triton.testing.do_bench(fn, warmup=50, rep=300))
    ceiling = 2 * cases["cuBLAS 8192^3"][1] / statistics.median(times["cuBLAS 8192^3"]) / 1e9
    rows = []
    print(f"{'case':<16} {'ms':>8} {'TFLOP/s':>8} {'/cuBLAS':>8} {'smem B/MAC':>10}")
    for name, (fn, macs) in cases.items():
        ms = statistics.median(times[name])
        tflops = 2 * macs / ms / 1e9
        shape = name.split()[-1]
        bm, bn = (int(v) for v in shape.split("x")) if "x" in shape and "^" not in shape else (0, 0)
        per_mac = (bm * 16 + (bm // 64) * bn * 16) * 2 / (bm * bn * 16) if bm else float("nan")
        rows.append({"case": name, "ms": ms, "macs": macs, "tflops": tflops, "ratio": tflops / ceiling,
                     "operand_smem_bytes_per_mac": per_mac, "rounds_ms": times[name]})
        print(f"{name:<16} {ms:8.3f} {tflops:8.1f} {tflops / ceiling:8.3f} {per_mac:10.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
