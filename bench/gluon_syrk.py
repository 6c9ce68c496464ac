"""Experiment: a persistent Hopper SYRK kernel in Gluon, the products of ``kernels/triton_syrk.py`` hand-pipelined.

Not used by the library: measured by ``bench/gluon_syrk_probe.py`` on the H200 (BENCHMARKS.md, seventh
session) it is correct (exactly symmetric, deterministic, fp32-accurate) but slower than the Triton kernel
on the issue's shapes (4096² 0.130 vs 0.115 ms, 64×1408×2048 0.540 vs 0.498), faster only at 8192² (0.872
vs 0.908). Without warp specialization its epilogue stalls the tensor cores, which the Triton kernel's two
programs per SM hide. Kept as the measured starting point for a warp-specialized version.

    out_b = s_b^p·(alpha·X_b·Y_bᵀ + beta·C_b + d·I)     X, Y: [B, m, k] (or transposed views of
                                                         contiguous [B, k, m]), C: [B, m, m] symmetric

One program per SM walks the tiles that touch the lower triangle, over the whole batch. Tiles are 128 rows ×
256 columns (two warpgroups, each issuing 64×256 wgmma instructions, the largest Hopper has); 64-deep K
steps stream through a ring of ``STAGES`` shared-memory buffers filled by TMA, with one wgmma kept in flight
while the next loads land. When a tile's last product is issued the next tile's first loads are issued
before its epilogue, so the epilogue runs under them.

Tile row i (rows 128i..128i+127) holds the column tiles j = 0..⌊i/2⌋ (columns 256j..256j+255): the tiles
before row pair q = ⌊i/2⌋ number q(q+1). A tile with j < ⌊i/2⌋ lies strictly below the diagonal and is
stored twice by TMA, as itself and transposed into the upper triangle. The last tile of a row holds a 128×128
square on the diagonal (its left half for even i, its right half for odd i), stored as its lower part
mirrored into its upper part; for odd i its left half is a strictly-lower square, stored with its mirror.
Every output element is written once, so the result is exactly symmetric and deterministic.

Programs take their tiles from a host-built schedule (:func:`_schedule`) that gives each the same work.
``PROBE`` (module attribute, read at launch) times parts of the kernel: 1 skips the transposed stores, 2 the
whole epilogue (a store no element passes keeps the products alive); both give wrong results by design.
"""

from __future__ import annotations

import functools
import heapq

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 128
BLOCK_N = 256
BLOCK_K = 64
STAGES = 3
NUM_WARPS = 8
PROBE = 0


def lower_tile_count(m: int) -> int:
    """Tiles (128 rows × 256 columns) touching the lower triangle of an m×m matrix: Σ_i (⌊i/2⌋ + 1)."""
    rows = triton.cdiv(m, BLOCK_M)
    pairs = rows // 2
    return pairs * (pairs + 1) + (rows % 2) * (pairs + 1)


@gluon.jit
def _tile_of(t):
    """Row i and column j of lower tile t: q = ⌊i/2⌋ is the largest with q(q+1) <= t (float estimate, then
    exact fix-ups), r = t − q(q+1) counts the 2(q+1) tiles of rows 2q and 2q+1."""
    q = ((gl.sqrt((4 * t + 1).to(gl.float32)) - 1.0) * 0.5).to(gl.int32)
    q = gl.where((q + 1) * (q + 2) <= t, q + 1, q)
    q = gl.where(q * (q + 1) > t, q - 1, q)
    r = t - q * (q + 1)
    return 2 * q + r // (q + 1), r % (q + 1)


@gluon.jit
def _issue_load(desc_a, desc_b, a_bufs, b_bufs, bars, producer, batch, row0, col0, k,
                A_LAYOUT3: gl.constexpr, B_LAYOUT3: gl.constexpr, TRANSPOSED: gl.constexpr,
                STAGES: gl.constexpr, pred):
    """TMA loads of X's rows row0.. and Y's rows col0.. at depth k into ring slot ``producer`` % STAGES."""
    slot = producer % STAGES
    bar = bars.index(slot)
    a_buf = a_bufs.index(slot)
    b_buf = b_bufs.index(slot)
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes, pred=pred)
    if TRANSPOSED:
        tma.async_copy_global_to_shared(desc_a, [batch, k, row0], bar,
                                        a_buf._reinterpret(a_buf.dtype, desc_a.block_type.shape, A_LAYOUT3), pred)
        tma.async_copy_global_to_shared(desc_b, [batch, k, col0], bar,
                                        b_buf._reinterpret(b_buf.dtype, desc_b.block_type.shape, B_LAYOUT3), pred)
    else:
        tma.async_copy_global_to_shared(desc_a, [batch, row0, k], bar,
                                        a_buf._reinterpret(a_buf.dtype, desc_a.block_type.shape, A_LAYOUT3), pred)
        tma.async_copy_global_to_shared(desc_b, [batch, col0, k], bar,
                                        b_buf._reinterpret(b_buf.dtype, desc_b.block_type.shape, B_LAYOUT3), pred)
    return producer + 1


@gluon.jit
def _tile_at(schedule_ptr, n, tiles_per_matrix, BM: gl.constexpr, BN: gl.constexpr):
    """Entry n of the schedule: (batch, i, j, row0, col0) of the tile it names (batch·T + t)."""
    code = gl.load(schedule_ptr + n)
    batch = code // tiles_per_matrix
    i, j = _tile_of(code % tiles_per_matrix)
    return batch, i, j, i * BM, j * BN


@gluon.jit
def _store_square(out_ptr, base, square, dst_row, dst_col, M, SQUARE_LAYOUT: gl.constexpr, SIDE: gl.constexpr):
    """Masked pointer store of a SIDE×SIDE register square at (dst_row, dst_col) of the matrix at ``base``."""
    r = gl.arange(0, SIDE, layout=gl.SliceLayout(1, SQUARE_LAYOUT))[:, None] + dst_row
    c = gl.arange(0, SIDE, layout=gl.SliceLayout(0, SQUARE_LAYOUT))[None, :] + dst_col
    gl.store(out_ptr + base + r * M + c, square, mask=(r < M) & (c < M))


@gluon.jit
def _mirrored(lower, upper, SQUARE_LAYOUT: gl.constexpr, SIDE: gl.constexpr):
    """A diagonal square from itself (``lower``) and its transpose (``upper``): lower part mirrored up."""
    r = gl.arange(0, SIDE, layout=gl.SliceLayout(1, SQUARE_LAYOUT))[:, None]
    c = gl.arange(0, SIDE, layout=gl.SliceLayout(0, SQUARE_LAYOUT))[None, :]
    return gl.where(r >= c, lower, upper)


@gluon.jit
def _mainloop(acc, desc_a, desc_b, desc_c, a_bufs, b_bufs, bars, c_smem, c_bar, producer, consumer,
              batch, row0, col0, K, A_LAYOUT3: gl.constexpr, B_LAYOUT3: gl.constexpr, OUT_LAYOUT3: gl.constexpr,
              TRANSPOSED: gl.constexpr, HAS_C: gl.constexpr, HALF: gl.constexpr, BM: gl.constexpr,
              BK: gl.constexpr, STAGES: gl.constexpr):
    """acc += X[row0..]·Y[col0..]ᵀ over K (HALF: only Y's first BM rows), one wgmma in flight, the load
    STAGES − 1 steps ahead issued once the wgmma that read its slot has finished. With a C term, C's tile
    is fetched into ``c_smem`` halfway through (the previous tile's stores have long left it)."""
    num_k = gl.cdiv(K, BK)
    for ki in range(num_k):
        slot = consumer % STAGES
        mbarrier.wait(bars.index(slot), (consumer // STAGES) & 1)
        if TRANSPOSED:
            a_op = a_bufs.index(slot).permute((1, 0))
            b_op = b_bufs.index(slot)
            if HALF:
                b_op = b_op.slice(0, BM, dim=1)
        else:
            a_op = a_bufs.index(slot)
            b_op = b_bufs.index(slot)
            if HALF:
                b_op = b_op.slice(0, BM, dim=0)
            b_op = b_op.permute((1, 0))
        acc = warpgroup_mma(a_op, b_op, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        consumer += 1
        if HAS_C:  # noqa: SIM102 (a compile-time test around a run-time one)
            if ki == num_k // 2:
                tma.store_wait(0)
                mbarrier.expect(c_bar, desc_c.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_c, [batch, row0, col0], c_bar,
                                                c_smem._reinterpret(c_smem.dtype, desc_c.block_type.shape,
                                                                    OUT_LAYOUT3))
        kn = (ki + STAGES - 1) * BK
        if kn < K:
            producer = _issue_load(desc_a, desc_b, a_bufs, b_bufs, bars, producer, batch, row0, col0, kn,
                                   A_LAYOUT3, B_LAYOUT3, TRANSPOSED, STAGES, True)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    return acc, producer, consumer


@gluon.jit
def _epilogue_values(acc, c_view, c_bar, c_phase, scale_ptr, batch, row0, col0, alpha, beta, diag,
                     LAYOUT: gl.constexpr, HAS_C: gl.constexpr, HAS_DIAG: gl.constexpr, SCALE_POWER: gl.constexpr,
                     BM: gl.constexpr, WIDTH: gl.constexpr):
    """s^p·(alpha·acc + beta·C + diag·I) of the tile at (row0, col0), rounded to the output's dtype."""
    result = acc * alpha
    if HAS_C:
        mbarrier.wait(c_bar, c_phase)
        result += beta * c_view.load(LAYOUT).to(gl.float32)
    if HAS_DIAG:
        rows = gl.arange(0, BM, layout=gl.SliceLayout(1, LAYOUT))[:, None] + row0
        cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, LAYOUT))[None, :] + col0
        result += gl.where(rows == cols, diag, 0.0)
    if SCALE_POWER > 0:
        factor = gl.load(scale_ptr + batch)
        if SCALE_POWER == 2:
            factor = factor * factor
        result = result * factor
    return result.to(c_view.dtype)


@gluon.jit
def _gluon_syrk_kernel(
    desc_a, desc_b, desc_out, desc_out_t, desc_c, out_ptr, scale_ptr, schedule_ptr, offsets_ptr,
    M, K, alpha, beta, diag,
    A_LAYOUT: gl.constexpr, B_LAYOUT: gl.constexpr, A_LAYOUT3: gl.constexpr, B_LAYOUT3: gl.constexpr,
    OUT_LAYOUT: gl.constexpr, OUT_T_LAYOUT: gl.constexpr, OUT_LAYOUT3: gl.constexpr,
    OUT_T_LAYOUT3: gl.constexpr, ACC_LAYOUT: gl.constexpr, HALF_LAYOUT: gl.constexpr,
    SQUARE_LAYOUT: gl.constexpr,
    TRANSPOSED: gl.constexpr, HAS_C: gl.constexpr, HAS_DIAG: gl.constexpr, SCALE_POWER: gl.constexpr,
    BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, PROBE: gl.constexpr = 0,
):
    dtype: gl.constexpr = desc_out.dtype
    if TRANSPOSED:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BM], A_LAYOUT)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BK, BN], B_LAYOUT)
    else:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], A_LAYOUT)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], B_LAYOUT)
    c_smem = gl.allocate_shared_memory(dtype, [BM, BN], OUT_LAYOUT)
    c_t = c_smem._reinterpret(dtype, [BN, BM], OUT_T_LAYOUT)  # the same bytes, for transposed tiles
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    c_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(bars.index(stage), count=1)
    mbarrier.init(c_bar, count=1)

    row_tiles = gl.cdiv(M, BM)
    tiles_per_matrix = (row_tiles // 2) * (row_tiles // 2 + 1) + (row_tiles % 2) * (row_tiles // 2 + 1)
    n = gl.load(offsets_ptr + gl.program_id(0))
    end = gl.load(offsets_ptr + gl.program_id(0) + 1)
    producer = 0
    consumer = 0
    c_phase = 0

    batch, i, j, row0, col0 = _tile_at(schedule_ptr, gl.minimum(n, end - 1), tiles_per_matrix, BM, BN)
    for kk in gl.static_range(STAGES - 1):
        producer = _issue_load(desc_a, desc_b, a_bufs, b_bufs, bars, producer, batch, row0, col0, kk * BK,
                               A_LAYOUT3, B_LAYOUT3, TRANSPOSED, STAGES, n < end)

    while n < end:
        tile_batch = batch
        tile_i = i
        tile_j = j
        tile_row0 = row0
        tile_col0 = col0
        base = tile_batch.to(gl.int64) * M * M
        if (tile_i % 2 == 0) & (tile_j == tile_i // 2):
            # Diagonal square on the left, nothing below the diagonal on the right: 128-wide products only.
            acc_half = gl.zeros((BM, BM), dtype=gl.float32, layout=HALF_LAYOUT)
            acc_half, producer, consumer = _mainloop(
                acc_half, desc_a, desc_b, desc_c, a_bufs, b_bufs, bars, c_smem, c_bar, producer, consumer,
                tile_batch, tile_row0, tile_col0, K, A_LAYOUT3, B_LAYOUT3, OUT_LAYOUT3, TRANSPOSED, HAS_C, True,
                BM, BK, STAGES)
            n += 1
            batch, i, j, row0, col0 = _tile_at(schedule_ptr, gl.minimum(n, end - 1), tiles_per_matrix, BM, BN)
            for kk in gl.static_range(STAGES - 1):
                producer = _issue_load(desc_a, desc_b, a_bufs, b_bufs, bars, producer, batch, row0, col0,
                                       kk * BK, A_LAYOUT3, B_LAYOUT3, TRANSPOSED, STAGES, n < end)
            tma.store_wait(0)
            if PROBE == 2:  # keep the products alive: a store no element passes
                prh = gl.arange(0, BM, layout=gl.SliceLayout(1, HALF_LAYOUT))[:, None] + tile_row0
                pch = gl.arange(0, BM, layout=gl.SliceLayout(0, HALF_LAYOUT))[None, :]
                gl.store(out_ptr + prh * M + pch, acc_half.to(dtype), mask=prh < tile_row0 * 0 - 1)
            else:
                tile_half = _epilogue_values(acc_half, c_smem.slice(0, BM, dim=1), c_bar, c_phase, scale_ptr,
                                             tile_batch, tile_row0, tile_col0, alpha, beta, diag, HALF_LAYOUT,
                                             HAS_C, HAS_DIAG, SCALE_POWER, BM, BM)
                square = c_t.slice(0, BM, dim=0)
                square.store(tile_half)
                lower = square.load(SQUARE_LAYOUT)
                square.permute((1, 0)).store(tile_half)
                upper = square.load(SQUARE_LAYOUT)
                _store_square(out_ptr, base, _mirrored(lower, upper, SQUARE_LAYOUT, BM), tile_row0, tile_row0, M,
                              SQUARE_LAYOUT, BM)
        else:
            acc_full = gl.zeros((BM, BN), dtype=gl.float32, layout=ACC_LAYOUT)
            acc_full, producer, consumer = _mainloop(
                acc_full, desc_a, desc_b, desc_c, a_bufs, b_bufs, bars, c_smem, c_bar, producer, consumer,
                tile_batch, tile_row0, tile_col0, K, A_LAYOUT3, B_LAYOUT3, OUT_LAYOUT3, TRANSPOSED, HAS_C, False,
                BM, BK, STAGES)
            n += 1
            batch, i, j, row0, col0 = _tile_at(schedule_ptr, gl.minimum(n, end - 1), tiles_per_matrix, BM, BN)
            for kk in gl.static_range(STAGES - 1):
                producer = _issue_load(desc_a, desc_b, a_bufs, b_bufs, bars, producer, batch, row0, col0,
                                       kk * BK, A_LAYOUT3, B_LAYOUT3, TRANSPOSED, STAGES, n < end)
            tma.store_wait(0)
            if PROBE == 2:  # keep the products alive: a store no element passes
                prf = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC_LAYOUT))[:, None] + tile_row0
                pcf = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC_LAYOUT))[None, :]
                gl.store(out_ptr + prf * M + pcf, acc_full.to(dtype), mask=prf < tile_row0 * 0 - 1)
            else:
                tile_full = _epilogue_values(acc_full, c_smem, c_bar, c_phase, scale_ptr, tile_batch, tile_row0,
                                             tile_col0, alpha, beta, diag, ACC_LAYOUT, HAS_C, HAS_DIAG,
                                             SCALE_POWER, BM, BN)
                c_smem.store(tile_full)
                if tile_j < tile_i // 2:  # strictly below the diagonal: the tile and its transpose, by TMA
                    fence_async_shared()
                    tma.async_copy_shared_to_global(desc_out, [tile_batch, tile_row0, tile_col0],
                                                    c_smem._reinterpret(dtype, desc_out.block_type.shape, OUT_LAYOUT3))
                    if PROBE != 1:
                        tma.store_wait(0)
                        c_t.permute((1, 0)).store(tile_full)
                        fence_async_shared()
                        tma.async_copy_shared_to_global(desc_out_t, [tile_batch, tile_col0, tile_row0],
                                                        c_t._reinterpret(dtype, desc_out_t.block_type.shape,
                                                                         OUT_T_LAYOUT3))
                else:  # odd i: a strictly-lower square on the left, the diagonal square on the right
                    left = c_smem.slice(0, BM, dim=1).load(SQUARE_LAYOUT)
                    diagonal = c_smem.slice(BM, BM, dim=1).load(SQUARE_LAYOUT)
                    _store_square(out_ptr, base, left, tile_row0, tile_col0, M, SQUARE_LAYOUT, BM)
                    c_t.permute((1, 0)).store(tile_full)
                    left_t = c_t.slice(0, BM, dim=0).load(SQUARE_LAYOUT)
                    diagonal_t = c_t.slice(BM, BM, dim=0).load(SQUARE_LAYOUT)
                    _store_square(out_ptr, base, left_t, tile_col0, tile_row0, M, SQUARE_LAYOUT, BM)
                    _store_square(out_ptr, base, _mirrored(diagonal, diagonal_t, SQUARE_LAYOUT, BM), tile_row0,
                                  tile_row0, M, SQUARE_LAYOUT, BM)
        if HAS_C:
            c_phase ^= 1
    tma.store_wait(0)


def _nvmma(shape: list[int]) -> object:
    return gl.NVMMASharedLayout.get_default_for(shape, gl.bfloat16)


def _acc_layout(width: int) -> object:
    """wgmma accumulator layout: 8 warps stacked along the 128 rows, 64×``width`` instructions per warpgroup."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, width, 16])


def _square_layout() -> object:
    """Coalesced register layout for the diagonal squares' pointer stores: 16-byte vectors along rows."""
    return gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[NUM_WARPS, 1],
                            order=[1, 0])


def is_half_tile(t: int) -> bool:
    """Whether lower tile t (numbered as in ``_tile_of``) is a diagonal tile of an even row, whose right half
    lies above the diagonal: r = t − q(q+1) equals q."""
    q = int(((4 * t + 1) ** 0.5 - 1) / 2)
    while (q + 1) * (q + 2) <= t:
        q += 1
    while q * (q + 1) > t:
        q -= 1
    return t - q * (q + 1) == q


@functools.cache
def _schedule(m: int, batch: int, programs: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Which tiles each persistent program runs: whole tiles (cost 2) in their natural order, then the half
    tiles (cost 1), each to the program with the least work so far (the lowest index among equals). Whole
    tiles thus go round-robin, neighbours running side by side (they share row panels in L2), and the half
    tiles fill the programs one whole tile short: at m = 4096, 256 whole and 16 half tiles give every one of
    132 programs exactly 4 units. Returns the tile codes (batch·T + t) grouped by program, and each
    program's [start, end) offsets."""
    per_matrix = lower_tile_count(m)
    codes = [b * per_matrix + t for b in range(batch) for t in range(per_matrix)]
    whole = [c for c in codes if not is_half_tile(c % per_matrix)]
    half = [c for c in codes if is_half_tile(c % per_matrix)]
    work = [(0, p) for p in range(programs)]
    assigned: list[list[int]] = [[] for _ in range(programs)]
    for cost, group in ((2, whole), (1, half)):
        for code in group:
            load, p = heapq.heappop(work)
            assigned[p].append(code)
            heapq.heappush(work, (load + cost, p))
    offsets = [0]
    for tiles in assigned:
        offsets.append(offsets[-1] + len(tiles))
    flat = [code for tiles in assigned for code in tiles]
    return (torch.tensor(flat, dtype=torch.int32, device=device),
            torch.tensor(offsets, dtype=torch.int32, device=device))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gluon_syrk(
    x: Tensor,
    y: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Tensor | None = None,
    diag: float = 0.0,
    scale: Tensor | None = None,
    scale_power: int = 1,
) -> Tensor:
    """``s^p·(alpha·X·Yᵀ + beta·C + diag·I)`` for bf16 X (and Y, default X) [m, k] or [B, m, k], row-major or
    a transposed view of a row-major [.., k, m]; returns a new exactly symmetric [.., m, m] bf16 tensor."""
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    y3 = x3 if y is None else (y if y.ndim == 3 else y.unsqueeze(0))
    batch, m, k = x3.shape
    transposed = x3.stride(-2) == 1 and x3.stride(-1) != 1
    storage_a = x3.mT if transposed else x3
    storage_b = y3.mT if transposed else y3
    a_block = [1, BLOCK_K, BLOCK_M] if transposed else [1, BLOCK_M, BLOCK_K]
    b_block = [1, BLOCK_K, BLOCK_N] if transposed else [1, BLOCK_N, BLOCK_K]
    out = torch.empty((batch, m, m), device=x.device, dtype=x.dtype)
    desc_a = TensorDescriptor.from_tensor(storage_a, a_block, _nvmma(a_block))
    desc_b = TensorDescriptor.from_tensor(storage_b, b_block, _nvmma(b_block))
    out_block = [1, BLOCK_M, BLOCK_N]
    out_t_block = [1, BLOCK_N, BLOCK_M]
    desc_out = TensorDescriptor.from_tensor(out, out_block, _nvmma(out_block))
    desc_out_t = TensorDescriptor.from_tensor(out, out_t_block, _nvmma(out_t_block))
    c3 = out if c is None else (c if c.ndim == 3 else c.unsqueeze(0))
    desc_c = TensorDescriptor.from_tensor(c3, out_block, _nvmma(out_block))
    programs = min(_sm_count(x.device), lower_tile_count(m) * batch)
    schedule, offsets = _schedule(m, batch, programs, x.device)
    _gluon_syrk_kernel[(programs,)](
        desc_a, desc_b, desc_out, desc_out_t, desc_c, out, out if scale is None else scale, schedule, offsets,
        m, k, float(alpha), float(beta), float(diag),
        A_LAYOUT=_nvmma(a_block[1:]), B_LAYOUT=_nvmma(b_block[1:]),
        A_LAYOUT3=_nvmma(a_block), B_LAYOUT3=_nvmma(b_block),
        OUT_LAYOUT=_nvmma(out_block[1:]), OUT_T_LAYOUT=_nvmma(out_t_block[1:]),
        OUT_LAYOUT3=_nvmma(out_block), OUT_T_LAYOUT3=_nvmma(out_t_block),
        ACC_LAYOUT=_acc_layout(BLOCK_N), HALF_LAYOUT=_acc_layout(BLOCK_M), SQUARE_LAYOUT=_square_layout(),
        TRANSPOSED=transposed, HAS_C=c is not None, HAS_DIAG=diag != 0.0,
        SCALE_POWER=0 if scale is None else scale_power,
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, STAGES=STAGES, num_warps=NUM_WARPS, PROBE=PROBE,
    )
    return out if x.ndim == 3 else out.squeeze(0)
