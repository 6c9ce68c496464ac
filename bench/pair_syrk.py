"""Experiment (not used by the library): a paired Hopper SYRK kernel in Gluon, the products of
``dtensor_muon.kernels.ws_syrk`` with the two consumer warpgroups working at the same time on two tiles that
share an operand panel. ``bench/gluon_syrk_probe.py --kernel pairs --compare ws`` checks and times it.

    out_b = s_b^p·(alpha·X_b·Y_bᵀ + beta·C_b + d·I)

Why: Nsight Compute on the H200 put the ping-pong kernel's tensor pipe at 82–84% of its peak per clock,
cuBLAS's full products at 97% on the same matrices, while wgmma alone from shared memory runs at cuBLAS's
rate or above for every instruction shape (``bench/wgmma_rate_probe.py``). The ping-pong kernel's 128×128
tiles need 64 bytes of operand panels from L2 per SM per clock at the full wgmma rate (two 128×64 panels per
128·128·64 multiply-adds at 2048 a clock); it reaches about 52, where cuBLAS's 128×176 tiles also draw about
53. Two tiles that share a panel need three panels for twice the work, 48 bytes per clock at the full rate.

Units: the lower triangle's 128×128 tiles (i, j), j ≤ i, in pairs sharing a row panel (i, j) + (i, j + 1),
or sharing column panel 0: row i has i + 1 tiles; odd rows pair all of theirs along the row, even rows all but
(i, 0), and those are paired down column 0 ((0, 0) + (2, 0), (4, 0) + (6, 0), ...). At most one tile per
matrix is left single, when the number of even rows is odd. The host builds the table of units once per
size; unit u goes to program u mod P.

Each K slice of a unit fills one ring slot with three panels (two for a single): X rows a0, Y rows b0, and
X rows a1 or Y rows b1. Consumer 0 computes tile (a0, b0), consumer 1 tile (a1, b1), both at once; the
epilogue (scale, C term, diagonal, stores, as in ``ws_syrk``) then runs on both while the producer fills
the ring for the next unit, so the tensor cores wait for it (in the ping-pong kernel the other consumer's
products hide it).

Result on the H200 (BENCHMARKS.md, eleventh session, three runs against the ping-pong kernel): correct, and
the same bits as the ping-pong kernel where compared; faster where K is long (X·Xᵀ 4096² 1.6–5.5%,
64×1408×2048 2.2–4.6%, 8192² 5–9%), slower on the K = 1408 products (2–5% plain, 4–7% with the C term), where
the exposed epilogue costs more than the shared panel saves: under 1% on Newton–Schulz either way. Keeping the
finished tile in registers to store it under the next unit's first products spilled it (and ran up to 36%
slower), so the library keeps the ping-pong kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from dtensor_muon.kernels.ws_syrk import (
    BLOCK,
    CONSUMER_REGS,
    MAX_REGS,
    PRODUCER_REGS,
    _accumulator_layout,
    _sm_count,
    launch_operands,
    require_ws_syrk_support,
)
from dtensor_muon.kernels.ws_syrk_kernel import finish_tile, load_c_tile, load_panel, slice_operands

BLOCK_K = 64  # the K slice and ring depth (gluon_syrk_probe.py --compare pairs:BKxSTAGES varies them)
STAGES = 3  # three panels of 128×64 per slot: 3 · 48 KB ring + 2 · 32 KB staging = 208 KB of shared memory
NO_TILE = 255  # a unit's second tile row/column when the unit has one tile
SINGLE = gl.constexpr(NO_TILE)


@gluon.jit
def _unit_of(units_ptr, u, per_matrix):
    """Unit u over the batch: (batch, a0, b0, a1, b1), tile 0 = (a0, b0), tile 1 = (a1, b1) or a1 = SINGLE.
    The table packs a0 | b0 << 8 | a1 << 16 | b1 << 24 per unit of one matrix."""
    code = gl.load(units_ptr + u % per_matrix)
    return u // per_matrix, code & 255, (code >> 8) & 255, (code >> 16) & 255, (code >> 24) & 255


@gluon.jit
def _produce(p, TRANSPOSED: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: per K slice of each unit, the panels its tiles read, each once, into a ring slot:
    slot panel 0 = X rows a0, 1 = Y rows b0, 2 = X rows a1 (a column pair, b1 = b0) or Y rows b1 (a row
    pair, a1 = a0); nothing in panel 2 for a single tile."""
    desc_a, desc_b, bufs, ready, empty, K, total, per_matrix, units_ptr = p
    panel_bytes: gl.constexpr = desc_a.block_type.nbytes
    num_k = gl.cdiv(K, BK)
    g = 0
    for u in range(gl.program_id(0), total, gl.num_programs(0)):
        batch, a0, b0, a1, b1 = _unit_of(units_ptr, u, per_matrix)
        single = a1 == SINGLE
        for ki in range(num_k):
            slot = g % STAGES
            mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            k = ki * BK
            if single:
                mbarrier.expect(bar, 2 * panel_bytes)
            else:
                mbarrier.expect(bar, 3 * panel_bytes)
            load_panel(desc_a, a0, k, batch, bar, bufs.index(3 * slot), TRANSPOSED, BM)
            load_panel(desc_b, b0, k, batch, bar, bufs.index(3 * slot + 1), TRANSPOSED, BM)
            if not single:
                if a1 == a0:
                    load_panel(desc_b, b1, k, batch, bar, bufs.index(3 * slot + 2), TRANSPOSED, BM)
                else:
                    load_panel(desc_a, a1, k, batch, bar, bufs.index(3 * slot + 2), TRANSPOSED, BM)
            g += 1


@gluon.jit
def _tile(p, staging3, c_bar, batch, i, j, a_index, b_index, for_both, g, phase, ACC: gl.constexpr,
          TRANSPOSED: gl.constexpr, HAS_C: gl.constexpr, HAS_DIAG: gl.constexpr, SCALE_POWER: gl.constexpr,
          BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """One consumer's tile (i, j) of a unit: its products from the slots' panels a_index and b_index, then
    the ping-pong kernel's epilogue. Releases each slot once, twice when ``for_both`` (the unit's only tile).
    Returns the slice counter and the C barrier's phase after it."""
    (desc_out, desc_c, scale_ptr, bufs, staging_bufs, ready, empty, c_ready, K, total, per_matrix, units_ptr,
     alpha, beta, diag) = p
    row0 = i * BM
    col0 = j * BM
    if HAS_C:
        load_c_tile(desc_c, staging3, c_bar, batch, row0, col0)
    acc = gl.zeros([BM, BM], gl.float32, ACC)
    for ki in range(gl.cdiv(K, BK)):
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        a_op, b_op = slice_operands(bufs, 3 * slot + a_index, 3 * slot + b_index, TRANSPOSED, BM, BK)
        acc = warpgroup_mma(a_op, b_op, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        released = empty.index((g + STAGES - 1) % STAGES)
        mbarrier.arrive(released, count=1, pred=ki > 0)
        mbarrier.arrive(released, count=1, pred=(ki > 0) & for_both)
        g += 1
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    released = empty.index((g + STAGES - 1) % STAGES)
    mbarrier.arrive(released, count=1)
    mbarrier.arrive(released, count=1, pred=for_both)
    finish_tile(acc, desc_out, staging3, c_bar, phase, scale_ptr, batch, row0, col0, alpha, beta, diag, ACC, HAS_C,
                HAS_DIAG, SCALE_POWER, BM)
    if HAS_C:
        phase ^= 1
    return g, phase


@gluon.jit
def _consume(p, CONSUMER: gl.constexpr, ACC: gl.constexpr, TRANSPOSED: gl.constexpr, HAS_C: gl.constexpr,
             HAS_DIAG: gl.constexpr, SCALE_POWER: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
             STAGES: gl.constexpr):
    """Consumer warpgroup CONSUMER: tile CONSUMER of every unit of this program. Both consumers read each
    slot and release it (the ``empty`` barriers count two arrivals); for a single-tile unit consumer 1 skips
    the unit and consumer 0 releases its slots for both."""
    (desc_out, desc_c, scale_ptr, bufs, staging_bufs, ready, empty, c_ready, K, total, per_matrix, units_ptr,
     alpha, beta, diag) = p
    staging3 = staging_bufs.index(CONSUMER)  # [1, BM, BM], for TMA
    c_bar = c_ready.index(CONSUMER)
    num_k = gl.cdiv(K, BK)
    g = 0
    phase = 0
    for u in range(gl.program_id(0), total, gl.num_programs(0)):
        batch, a0, b0, a1, b1 = _unit_of(units_ptr, u, per_matrix)
        single = a1 == SINGLE
        if CONSUMER == 0:
            g, phase = _tile(p, staging3, c_bar, batch, a0, b0, 0, 1, single, g, phase, ACC, TRANSPOSED, HAS_C,
                             HAS_DIAG, SCALE_POWER, BM, BK, STAGES)
        else:
            if single:
                g += num_k
            else:
                row_pair = a1 == a0  # tile 1 shares tile 0's X panel (slot panel 0), Y from panel 2
                g, phase = _tile(p, staging3, c_bar, batch, a1, b1, gl.where(row_pair, 0, 2),
                                 gl.where(row_pair, 2, 1), single, g, phase, ACC, TRANSPOSED, HAS_C, HAS_DIAG,
                                 SCALE_POWER, BM, BK, STAGES)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["K", "total", "per_matrix"], do_not_specialize_on_alignment=["scale_ptr"])
def pair_syrk_kernel(
    desc_a, desc_b, desc_out, desc_c, scale_ptr, units_ptr, K, total, per_matrix, alpha, beta, diag,
    TRANSPOSED: gl.constexpr, HAS_C: gl.constexpr, HAS_DIAG: gl.constexpr, SCALE_POWER: gl.constexpr,
    ACC: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """One persistent program per SM over ``total`` units (``per_matrix`` per matrix, from the table at
    ``units_ptr``): a producer warp and two consumer warpgroups, each consumer one tile of every unit, sharing
    a TMA ring of STAGES K slices of three panels."""
    dtype: gl.constexpr = desc_out.dtype
    bufs = gl.allocate_shared_memory(dtype, [3 * STAGES] + desc_a.block_type.shape, desc_a.layout)
    staging = gl.allocate_shared_memory(dtype, [2] + desc_out.block_type.shape, desc_out.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(c_ready.index(s), count=1)
    consumer = (desc_out, desc_c, scale_ptr, bufs, staging, ready, empty, c_ready, K, total, per_matrix,
                units_ptr, alpha, beta, diag)
    producer = (desc_a, desc_b, bufs, ready, empty, K, total, per_matrix, units_ptr)
    gl.warp_specialize([(_consume, (consumer, 0, ACC, TRANSPOSED, HAS_C, HAS_DIAG, SCALE_POWER, BM, BK, STAGES)),
                        (_consume, (consumer, 1, ACC, TRANSPOSED, HAS_C, HAS_DIAG, SCALE_POWER, BM, BK, STAGES)),
                        (_produce, (producer, TRANSPOSED, BM, BK, STAGES))],
                       [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def pair_units(tiles: int) -> list[tuple[int, int, int, int]]:
    """The units (a0, b0, a1, b1) covering the lower triangle of ``tiles``×``tiles`` tiles once: two tiles
    sharing a row (a1 = a0) or column 0 (b0 = b1 = 0), or one tile (a1 = b1 = NO_TILE), in row order."""
    if tiles >= NO_TILE:
        raise ValueError(f"pair_units: at most {NO_TILE - 1} tiles a side, got {tiles}")
    units = []
    leftover: list[int] = []
    for i in range(tiles):
        first = 1 if i % 2 == 0 else 0
        units.extend((i, j, i, j + 1) for j in range(first, i + 1, 2))
        if i % 2 == 0:
            leftover.append(i)
        if len(leftover) == 2:
            units.append((leftover[0], 0, leftover[1], 0))
            leftover = []
    if leftover:
        units.append((leftover[0], 0, NO_TILE, NO_TILE))
    return units


@functools.cache
def _unit_table(tiles: int, device_index: int) -> Tensor:
    """:func:`pair_units` packed a0 | b0 << 8 | a1 << 16 | b1 << 24 into int32, on the device."""
    packed = [a0 | b0 << 8 | a1 << 16 | b1 << 24 for a0, b0, a1, b1 in pair_units(tiles)]
    signed = [v - 2**32 if v >= 2**31 else v for v in packed]
    return torch.tensor(signed, dtype=torch.int32, device=torch.device("cuda", device_index))


def pair_syrk(
    x: Tensor,
    y: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Tensor | None = None,
    diag: float = 0.0,
    scale: Tensor | None = None,
    scale_power: int = 1,
) -> Tensor:
    """``s^p·(alpha·X·Yᵀ + beta·C + diag·I)`` like ``ws_syrk.ws_syrk``, on the paired kernel."""
    require_ws_syrk_support(x, y, "pair_syrk")
    out, operands, transposed = launch_operands(x, y, c, scale, scale_power, "pair_syrk", BLOCK_K)
    units = _unit_table(triton.cdiv(out.size(1), BLOCK), x.device.index or 0)
    per_matrix = units.numel()
    total = per_matrix * out.size(0)
    programs = min(_sm_count(x.device.index or 0), total)
    desc_a, desc_b, desc_out, desc_c, scale_arg = operands
    pair_syrk_kernel[(programs,)](
        desc_a, desc_b, desc_out, desc_c, scale_arg, units, x.size(-1), total, per_matrix, float(alpha), float(beta),
        float(diag), TRANSPOSED=transposed, HAS_C=c is not None, HAS_DIAG=diag != 0.0,
        SCALE_POWER=0 if scale is None else scale_power, ACC=_accumulator_layout(), BM=BLOCK, BK=BLOCK_K,
        STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAX_REGS,
    )
    return out if x.ndim == 3 else out.squeeze(0)
