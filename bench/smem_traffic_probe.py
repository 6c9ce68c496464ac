"""Does TMA traffic into shared memory slow wgmma down? wgmma on resident operands while a producer warp streams
K slices into a ring at a fixed number of bytes per wgmma step, as a SYRK kernel's main loop does, against the
same wgmma with no traffic.

    PYTHONPATH=src python3 bench/smem_traffic_probe.py --rounds 3 --out bench/results/smem_traffic_h200.json

Why: the warp-specialized SYRK kernel keeps the tensor pipe 81% busy where cuBLAS keeps it 97% (eleventh
session, Nsight Compute), and halving the operand loads of diagonal tiles barely moved it (twelfth). The
hypothesis tested: per SM and clock at the full wgmma rate (2048 multiply-adds), the ping-pong kernel's 128×128
tiles read 0.047 bytes of shared memory per multiply-add as wgmma operands (96 B/clk) and write 0.031 by TMA
(32 KB per 128·128·64 step, 62 B/clk), 158 B/clk against the 128 that shared memory serves, a cap of 81%;
cuBLAS's cooperative 128×256 tiles need 0.039 + 0.023 (127 B/clk). Measured on the H200 (BENCHMARKS.md, twelfth
session): the traffic costs 8% per clock for the 128×128 step and 3% for the 128×256 one, not 19%; the rest
of the gap was a per-tile cost (the SYRK kernel matches cuBLAS per clock at K = 14336, not at K = 1408).

Each program (one per SM) holds A [BM, 64] and B [BN, 64] in shared memory. The consumer (one warpgroup, or two
cooperating on 128 rows each 64) issues ``iters`` wgmma steps acc += A·Bᵀ, one group in flight; before step g
it waits for ring slot g mod STAGES to have landed and after it releases the slot of step g − 1, as the SYRK
kernel does. The producer warp fills each slot with ``panels`` TMA loads of a [128, 64] bf16 block (16 KB)
from an L2-resident source; the consumer never reads them. ``panels`` 0 runs the wgmma alone.

Columns: median ms over ``--rounds`` interleaved rounds, TFLOP/s, ratio to the same tile with no traffic, the
traffic in bytes per multiply-add, and the SM clock and board power read through NVML halfway through about a
second of the case's calls (a rate that falls with the clock is the power limiter's doing; one that
falls at the same clock is contention). ``--products`` adds, timed and read the same way, the library's SYRK
kernel and cuBLAS on the Gram form's 64×1408² products (K = 1408) and on 16 Gram matrices with K = 14336, where
a tile's epilogue and hand-over are a tenth as frequent, with their multiply-adds as run.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from wgmma_rate_probe import BK, layout, resident  # bench/ is on the path: this script runs as bench/...

PANEL_ROWS = 128
SOURCE_ROWS = 4096  # 512 KB of source panels: L2-resident, as the SYRK kernel's panels mostly are
STAGES = 5


@gluon.jit
def _consume(a_smem, b_smem, out_ptr, ready, empty, iters, ACC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
             STAGES: gl.constexpr, TRAFFIC: gl.constexpr):
    """``iters`` wgmma steps on the resident blocks; with traffic, each waits for its ring slot and releases the
    previous one. Then acc into out (so nothing is dropped)."""
    acc = gl.zeros([BM, BN], gl.float32, ACC)
    for g in range(iters):
        if TRAFFIC:
            mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
        acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        if TRAFFIC:
            mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1, pred=g > 0)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))[:, None]
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))[None, :]
    gl.store(out_ptr + gl.program_id(0) * BM * BN + rows * BN + cols, acc)


@gluon.jit
def _produce(desc, ring, ready, empty, iters, PANELS: gl.constexpr, STAGES: gl.constexpr, SOURCE: gl.constexpr):
    """Fills slot g mod STAGES with PANELS source blocks per step g (cycling through the SOURCE rows), once the
    consumer has released it."""
    for g in range(iters):
        slot = g % STAGES
        mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), PANELS * desc.block_type.nbytes)
        for p in gl.static_range(PANELS):
            row = ((g * PANELS + p) * 128) % SOURCE
            tma.async_copy_global_to_shared(desc, [row, 0], ready.index(slot), ring.index(slot * PANELS + p))


@gluon.jit
def traffic_kernel(a_ptr, b_ptr, out_ptr, desc, iters, ACC: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                   A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, PANELS: gl.constexpr, STAGES: gl.constexpr,
                   SOURCE: gl.constexpr, num_warps: gl.constexpr):
    a_smem = resident(a_ptr, BM, A_LAYOUT, num_warps)
    b_smem = resident(b_ptr, BN, B_LAYOUT, num_warps)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    if PANELS == 0:
        _consume(a_smem, b_smem, out_ptr, ready, empty, iters, ACC, BM, BN, STAGES, False)
    else:
        ring = gl.allocate_shared_memory(desc.dtype, [STAGES * PANELS] + desc.block_type.shape, desc.layout)
        gl.warp_specialize([(_consume, (a_smem, b_smem, out_ptr, ready, empty, iters, ACC, BM, BN, STAGES, True)),
                            (_produce, (desc, ring, ready, empty, iters, PANELS, STAGES, SOURCE))], [1], [24])


def under_load(fn, calls: int) -> tuple[int, float]:
    """(SM clock MHz, board power W) read through NVML once the first half of ``calls`` queued calls of ``fn``
    has run, while the second half keeps the GPU busy."""
    fn()
    torch.cuda.synchronize()
    halfway = torch.cuda.Event()
    for i in range(calls):
        fn()
        if i == calls // 2:
            halfway.record()
    while not halfway.query():
        pass
    clock, power = int(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1000
    torch.cuda.synchronize()
    return clock, power


def case(bm: int, bn: int, panels: int, target_macs: float, programs: int):
    """(callable, multiply-adds per call, traffic bytes per multiply-add): a BM×BN accumulator (two cooperating
    warpgroups for BM = 128 with BN = 256), ``panels`` 16 KB blocks streamed per 64-deep step."""
    warps = 8 if bn == 256 else 4
    per_iteration = programs * bm * bn * BK
    iters = max(1, int(target_macs / per_iteration))
    a = torch.randn(bm, BK, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(bn, BK, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(programs, bm, bn, device="cuda")
    source = torch.randn(SOURCE_ROWS, BK, device="cuda", dtype=torch.bfloat16)
    desc = TensorDescriptor.from_tensor(source, [PANEL_ROWS, BK], layout(PANEL_ROWS))
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, bn, 16])
    stages = STAGES if panels <= 2 else 3
    fn = lambda: traffic_kernel[(programs,)](a, b, out, desc, iters, acc, bm, bn, layout(bm), layout(bn), panels,
                                             stages, SOURCE_ROWS, num_warps=warps, maxnreg=232 if warps == 4 else 168)
    return fn, iters * per_iteration, panels * PANEL_ROWS * BK * 2 / (bm * bn * BK)


def products() -> dict[str, tuple]:
    """The Gluon SYRK kernel's poly (C term and diagonal) and plain X·Yᵀ on 64 symmetric 1408² matrices and
    cuBLAS's full X·Yᵀ on them, then both on X·Xᵀ of 16 matrices 1408×14336, as (callable, multiply-adds as
    run, no traffic figure, no tile)."""
    from dtensor_muon.kernels.ws_syrk import ws_syrk

    r = torch.randn(64, 1408, 1408, device="cuda", dtype=torch.bfloat16) / 38
    r = (r + r.mT) / 2
    q = torch.randn_like(r)
    long = torch.randn(16, 1408, 14336, device="cuda", dtype=torch.bfloat16) / 140
    tiles = 66 * 128 * 128  # 66 lower tiles of 128×128 per 1408² result
    none = float("nan")
    return {"SYRK poly 64x1408²": (lambda: ws_syrk(r, None, -4.7, 2.0, r, 3.4), 64 * tiles * 1408, none, ""),
            "SYRK X·Yᵀ 64x1408²": (lambda: ws_syrk(r, q), 64 * tiles * 1408, none, ""),
            "cuBLAS X·Yᵀ 64x1408²": (lambda: r @ q.mT, 64 * 1408**3, none, ""),
            "SYRK X·Xᵀ 16x1408x14336": (lambda: ws_syrk(long), 16 * tiles * 14336, none, ""),
            "cuBLAS X·Xᵀ 16x1408x14336": (lambda: long @ long.mT, 16 * 1408**2 * 14336, none, "")}


# (BM, BN, panels per step): the ping-pong kernel's 128×128 step with its two panels (32 KB) and with one (the
# paired kernel's share, 24 KB, lies between), and the cooperative 128×256 step alone and with the three panels
# (48 KB) it loads.
CASES = [(128, 128, 0), (128, 128, 1), (128, 128, 2), (128, 256, 0), (128, 256, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--macs", type=float, default=2.0**40, help="multiply-adds per timed call, about")
    parser.add_argument("--products", action="store_true", help="also the real products (K = 1408 and 14336)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    cases = {}
    for bm, bn, panels in CASES:
        name = f"{bm}x{bn} +{panels * 16} KB"
        try:
            fn, macs, per_mac = case(bm, bn, panels, args.macs, programs)
            fn()
            torch.cuda.synchronize()
            cases[name] = (fn, macs, per_mac, f"{bm}x{bn}")
        except Exception as error:  # a case this Triton cannot build is reported, not fatal
            print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    if args.products:
        cases.update(products())
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (fn, *_) in cases.items():
            times[name].append(triton.testing.do_bench(fn, warmup=50, rep=300))
    clocks = {name: under_load(fn, max(2, int(1000 / statistics.median(times[name]))))
              for name, (fn, *_) in cases.items()}
    alone = {tile: 2 * macs / statistics.median(times[name]) / 1e9
             for name, (_, macs, per_mac, tile) in cases.items() if per_mac == 0}
    rows = []
    print(f"{'case':<26} {'ms':>8} {'TFLOP/s':>8} {'/alone':>7} {'TMA B/MAC':>9} {'MHz':>6} {'W':>6}")
    for name, (_, macs, per_mac, tile) in cases.items():
        ms = statistics.median(times[name])
        tflops = 2 * macs / ms / 1e9
        ratio = tflops / alone[tile] if tile in alone else float("nan")
        clock, power = clocks[name]
        rows.append({"case": name, "ms": ms, "macs": macs, "tflops": tflops, "ratio_to_alone": ratio,
                     "tma_bytes_per_mac": per_mac, "sm_clock_mhz": clock, "power_w": power, "rounds_ms": times[name]})
        print(f"{name:<26} {ms:8.3f} {tflops:8.1f} {ratio:7.3f} {per_mac:9.4f} {clock:6d} {power:6.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
