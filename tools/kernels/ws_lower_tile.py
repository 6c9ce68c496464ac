"""Products of symmetric stacks stored as lower tiles, by a warp-specialized Gluon kernel (Hopper, Triton 3.6's
Gluon API): the library's Gluon SYRK kernel (``kernels/ws_syrk_kernel.py``) taught to read and write lower tiles.

    out_b = s_b·(alpha·A_b·B_b + beta·A_b + d·I)     A, B: [B, m, m] symmetric, stored as their 128×128 lower tiles

``lower_tile_products.py`` says why (a product then moves 58% of the bytes at m = 768) and holds the plain Triton
prototypes; this is the same math on the library's kernel structure: one persistent program per SM, a producer
warp streaming 64-deep K slices of the two operands' 128-row panels into a shared-memory ring by TMA, two
consumer warpgroups taking the program's lower output tiles (i, j), i ≥ j, in turn.

The kernel computes the library's form acc = Σ_k A[i, k]·B[j, k]ᵀ (= (A·B)[i, j], B symmetric). Slice k of
tile column kt = k // 128 is stored below the diagonal or not:

    kt ≤ j        A[i, k] direct,               B[j, k] direct
    j < kt ≤ i    A[i, k] direct,               B[j, k] = B[k, j]ᵀ (a [64, 128] block of tile (kt, j))
    kt > i        A[i, k] = A[k, i]ᵀ,           B[j, k] = B[k, j]ᵀ

A direct slice arrives as a [1, 128, 64] TMA block, a mirrored one as [1, 64, 128] into the same ring slot
reinterpreted (both 16 KB), and the consumer hands wgmma the transposed shared-memory view where the operand
is mirrored, as the library's kernel does for a transposed X. The consumer runs the three ranges as three
loops, in k order, so every element's fp32 sum is the library's. The epilogue is the library's, C = A's tile
(i, j) (a lower tile); a tile below the diagonal is stored once, a diagonal tile with its lower part mirrored
into its upper part (as the library stores it); the upper tiles of the output are never written.
"""

from __future__ import annotations

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

# The library's tile, ring and register constants, layouts, tile numbering and TMA copies, so that this kernel
# differs from ws_syrk_kernel only where lower tiles need it.
from dtensor_muon.kernels.ws_syrk import (
    BLOCK,
    BLOCK_K,
    CONSUMER_REGS,
    MAX_REGS,
    PRODUCER_REGS,
    STAGES,
    TURN_LEAD,
    _accumulator_layout,
    _nvmma,
)
from dtensor_muon.kernels.ws_syrk_kernel import _tile_of, tma_load, tma_store


@gluon.jit
def _produce(p, BM: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """The producer warp: every K slice of every tile of this program, in tile order, into the ring: slot s
    holds A's slice in ring panel 2s and B's in 2s + 1, each direct ([1, BM, BK]) or mirrored ([1, BK, BM])."""
    desc_ar, desc_ac, desc_br, desc_bc, panels, mirrored, ready, empty, K, total, per_matrix = p
    programs = gl.num_programs(0)
    num_k = gl.cdiv(K, BK)
    g = 0
    for t in range(gl.program_id(0), total, programs):
        batch = t // per_matrix
        i, j = _tile_of(t % per_matrix)
        for ki in range(num_k):
            slot = g % STAGES
            mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * desc_ar.block_type.nbytes)
            k = ki * BK
            kt = k // BM
            if kt <= i:
                tma_load(desc_ar, [batch, i * BM, k], bar, panels.index(2 * slot))
            else:
                tma_load(desc_ac, [batch, k, i * BM], bar, mirrored.index(2 * slot))
            if kt <= j:
                tma_load(desc_br, [batch, j * BM, k], bar, panels.index(2 * slot + 1))
            else:
                tma_load(desc_bc, [batch, k, j * BM], bar, mirrored.index(2 * slot + 1))
            g += 1


@gluon.jit
def _mma_range(
    acc,
    g,
    start,
    stop,
    handoff,
    panels,
    mirrored,
    ready,
    empty,
    turn,
    CONSUMER: gl.constexpr,
    A_MIRRORED: gl.constexpr,
    B_MIRRORED: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The wgmmas of the tile's K slices start..stop (one of the three ranges), one in flight; each slice's
    slot released once the next one's wgmma is issued, the turn passed on at slice ``handoff``."""
    for ki in range(start, stop):
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        if A_MIRRORED:
            a_op = mirrored.index(2 * slot).reshape([BK, BM]).permute((1, 0))
        else:
            a_op = panels.index(2 * slot).reshape([BM, BK])
        if B_MIRRORED:
            b_op = mirrored.index(2 * slot + 1).reshape([BK, BM])
        else:
            b_op = panels.index(2 * slot + 1).reshape([BM, BK]).permute((1, 0))
        acc = warpgroup_mma(a_op, b_op, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1, pred=ki > 0)
        mbarrier.arrive(turn.index(1 - CONSUMER), count=1, pred=ki == handoff)
        g += 1
    return acc, g


@gluon.jit
def _finish_lower_tile(
    acc,
    desc_out,
    staging3,
    c_bar,
    c_phase,
    scale_ptr,
    batch,
    row0,
    col0,
    alpha,
    beta,
    diag,
    ACC: gl.constexpr,
    HAS_C: gl.constexpr,
    HAS_DIAG: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    BM: gl.constexpr,
):
    """s·(alpha·acc + beta·C + d·I) in fp32, rounded once, stored by TMA: a tile below the diagonal once, a
    diagonal tile with its lower part mirrored into its upper part."""
    staging = staging3.reshape([BM, BM])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))[:, None]
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))[None, :]
    result = acc * alpha
    if HAS_C:
        mbarrier.wait(c_bar, c_phase)
        result += beta * staging.load(ACC).to(gl.float32)
    if HAS_DIAG:
        result += gl.where(rows + row0 == cols + col0, diag, 0.0)
    if HAS_SCALE:
        result = result * gl.load(scale_ptr + batch)
    tile = result.to(desc_out.dtype)
    tma.store_wait(0)  # the previous tile's store has left the staging buffer
    if row0 == col0:
        staging.permute((1, 0)).store(tile)
        staging.store(gl.where(rows >= cols, tile, staging.load(ACC)))
    else:
        staging.store(tile)
    fence_async_shared()
    tma_store(desc_out, [batch, row0, col0], staging3)


@gluon.jit
def _consume(
    p,
    CONSUMER: gl.constexpr,
    ACC: gl.constexpr,
    HAS_C: gl.constexpr,
    HAS_DIAG: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TURN_LEAD: gl.constexpr,
):
    """Consumer warpgroup CONSUMER: this program's tiles l ≡ CONSUMER (mod 2), the three K ranges then the
    epilogue; the turn passes to the other consumer TURN_LEAD slices before the tile's last."""
    (desc_out, desc_c, scale_ptr, panels, mirrored, staging_bufs, ready, empty, turn, c_ready, K, total,
     per_matrix, alpha, beta, diag) = p  # fmt: skip
    staging3 = staging_bufs.index(CONSUMER)
    c_bar = c_ready.index(CONSUMER)
    programs = gl.num_programs(0)
    num_k = gl.cdiv(K, BK)
    slices_per_tile: gl.constexpr = BM // BK
    local = CONSUMER
    for t in range(gl.program_id(0) + CONSUMER * programs, total, 2 * programs):
        batch = t // per_matrix
        i, j = _tile_of(t % per_matrix)
        row0 = i * BM
        col0 = j * BM
        phase = (local // 2) & 1
        mbarrier.wait(turn.index(CONSUMER), phase ^ (1 - CONSUMER))
        if HAS_C:
            tma.store_wait(0)
            mbarrier.expect(c_bar, desc_c.block_type.nbytes)
            tma_load(desc_c, [batch, row0, col0], c_bar, staging3)
        acc = gl.zeros([BM, BM], gl.float32, ACC)
        g = local * num_k
        handoff = gl.maximum(num_k - 1 - TURN_LEAD, 0)
        j_end = (j + 1) * slices_per_tile
        i_end = (i + 1) * slices_per_tile
        acc, g = _mma_range(
            acc, g, 0, j_end, handoff, panels, mirrored, ready, empty, turn, CONSUMER, False, False, BM, BK, STAGES
        )
        acc, g = _mma_range(
            acc, g, j_end, i_end, handoff, panels, mirrored, ready, empty, turn, CONSUMER, False, True, BM, BK, STAGES
        )
        acc, g = _mma_range(
            acc, g, i_end, num_k, handoff, panels, mirrored, ready, empty, turn, CONSUMER, True, True, BM, BK, STAGES
        )
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1)
        local += 2
        _finish_lower_tile(
            acc, desc_out, staging3, c_bar, phase, scale_ptr, batch, row0, col0, alpha, beta, diag,
            ACC, HAS_C, HAS_DIAG, HAS_SCALE, BM,
        )  # fmt: skip
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["K", "total", "per_matrix"], do_not_specialize_on_alignment=["scale_ptr"])
def ws_lower_tile_kernel(
    desc_ar,  # A, block [1, BM, BK]: A[i, k] direct
    desc_ac,  # A, block [1, BK, BM]: A[k, i], for A[i, k] mirrored
    desc_br,  # B, block [1, BM, BK]
    desc_bc,  # B, block [1, BK, BM]
    desc_out,  # the output, block [1, BM, BM]
    desc_c,  # HAS_C: A, block [1, BM, BM] (else the output's)
    scale_ptr,
    K,
    total,
    per_matrix,
    alpha,
    beta,
    diag,
    HAS_C: gl.constexpr,
    HAS_DIAG: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    ACC: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TURN_LEAD: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """One persistent program per SM over ``total`` lower tiles (``per_matrix`` per matrix): a producer warp and
    two consumer warpgroups sharing a TMA ring of STAGES K slices (two panels each, direct or mirrored)."""
    dtype: gl.constexpr = desc_out.dtype
    panels = gl.allocate_shared_memory(dtype, [2 * STAGES] + desc_ar.block_type.shape, desc_ar.layout)
    mirrored = panels._reinterpret(dtype, [2 * STAGES] + desc_ac.block_type.shape, desc_ac.layout)
    staging = gl.allocate_shared_memory(dtype, [2] + desc_out.block_type.shape, desc_out.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(2):
        mbarrier.init(turn.index(s), count=1)
        mbarrier.init(c_ready.index(s), count=1)
    consumer = (desc_out, desc_c, scale_ptr, panels, mirrored, staging, ready, empty, turn, c_ready, K, total,
                per_matrix, alpha, beta, diag)  # fmt: skip
    producer = (desc_ar, desc_ac, desc_br, desc_bc, panels, mirrored, ready, empty, K, total, per_matrix)
    gl.warp_specialize(
        [
            (_consume, (consumer, 0, ACC, HAS_C, HAS_DIAG, HAS_SCALE, BM, BK, STAGES, TURN_LEAD)),
            (_consume, (consumer, 1, ACC, HAS_C, HAS_DIAG, HAS_SCALE, BM, BK, STAGES, TURN_LEAD)),
            (_produce, (producer, BM, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def descriptors(t: Tensor) -> tuple[object, object, object]:
    """TMA descriptors over the [B, m, m] stack ``t``: direct slices [1, 128, 64], mirrored [1, 64, 128], tiles
    [1, 128, 128]."""
    return tuple(
        TensorDescriptor.from_tensor(t, list(block), _nvmma(block, t.dtype))
        for block in ((1, BLOCK, BLOCK_K), (1, BLOCK_K, BLOCK), (1, BLOCK, BLOCK))
    )


def lower_tile_product_gluon(
    a: Tensor,
    b: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    scale: Tensor | None = None,
    out: Tensor | None = None,
    tile: int = BLOCK,
    block_k: int = BLOCK_K,
    num_warps: int = 4,
    num_stages: int = STAGES,
) -> Tensor:
    """``lower_tile_products.lower_tile_product`` by the Gluon kernel: A, B (A when None) bf16/fp16 [B, m, m]
    contiguous CUDA stacks on a compute-capability-9 GPU, 128 | m; T = 128, BLOCK_K = 64 and 4 warps per
    partition are the kernel's (anything else is refused); ``num_stages`` is the ring's depth."""
    if (tile, block_k, num_warps) != (BLOCK, BLOCK_K, 4):
        raise ValueError(
            f"lower_tile_product_gluon: the kernel runs T {BLOCK}, BLOCK_K {BLOCK_K}, 4 warps, got T {tile}, "
            f"BLOCK_K {block_k}, {num_warps} warps"
        )
    bmat = a if b is None else b
    if out is None:
        out = torch.empty_like(a, memory_format=torch.contiguous_format)
    for name, t in (("A", a), ("B", bmat), ("out", out)):
        if (
            t.ndim != 3
            or t.shape != a.shape
            or t.size(-1) != t.size(-2)
            or t.size(-1) % BLOCK
            or t.dtype not in (torch.bfloat16, torch.float16)
            or t.dtype != a.dtype
            or not t.is_cuda
            or not t.is_contiguous()
            or t.data_ptr() % 16
        ):
            raise ValueError(
                f"lower_tile_product_gluon: {name} must be a contiguous, 16-byte aligned bf16/fp16 CUDA stack "
                f"[B, m, m] like A with 128 | m, got {tuple(t.shape)} {t.dtype} on {t.device}"
            )
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != a.size(0)):
        raise ValueError("lower_tile_product_gluon: scale must be fp32 with one entry per matrix")
    batch, m, _ = a.shape
    a_rows, a_cols, a_tiles = descriptors(a)
    b_rows, b_cols, _ = (a_rows, a_cols, None) if bmat is a else descriptors(bmat)
    (out_tiles,) = descriptors(out)[2:]
    sides = m // BLOCK
    per_matrix = sides * (sides + 1) // 2
    total = per_matrix * batch
    programs = min(torch.cuda.get_device_properties(a.device).multi_processor_count, triton.cdiv(total, 2))
    ws_lower_tile_kernel[(programs,)](
        a_rows,
        a_cols,
        b_rows,
        b_cols,
        out_tiles,
        a_tiles if beta != 0.0 else out_tiles,
        out if scale is None else scale,
        m,
        total,
        per_matrix,
        float(alpha),
        float(beta),
        float(diag),
        HAS_C=beta != 0.0,
        HAS_DIAG=diag != 0.0,
        HAS_SCALE=scale is not None,
        ACC=_accumulator_layout(),
        BM=BLOCK,
        BK=BLOCK_K,
        STAGES=num_stages,
        TURN_LEAD=TURN_LEAD,
        CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
    return out
