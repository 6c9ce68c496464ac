"""The Gluon code of the warp-specialized Hopper SYRK kernel (:mod:`.ws_syrk` launches it and says how it
works). Imported only where Triton has Gluon's Hopper API.

    out_b = s_b^p·(alpha·X_b·Y_bᵀ + beta·C_b + d·I)

A K slice of an operand's panel arrives in its ring slot either as rows ([1, BM, BK] of [B, m, k]) or as columns
([1, BK, BM] of the [B, k, m] storage of a transposed view; the slot reinterpreted, both 16 KB). With LOWER_IN
the operands are symmetric [B, m, m] stacks of which only the lower BM×BM tiles are valid: slice k of panel i,
in tile column kt = k // BM, is read as rows where kt ≤ i and as the columns of tile (kt, i) above, X[i, k] =
X[k, i]ᵀ, so the consumer runs a tile's slices in three ranges, kt ≤ j, j < kt ≤ i and kt > i, in k order (the
fp32 sums are the same as from whole operands). With LOWER_OUT a tile below the diagonal is stored once, not
also transposed: only the lower tiles of the output are written.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

# The TMA copies by the names this Triton has: async_load/async_store in newer releases (3.9 removed the old
# names), async_copy_global_to_shared/async_copy_shared_to_global in older ones (3.6 has only those).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# Shared memory reinterpreted as another shape and layout: ``reinterpret`` in newer releases, ``_reinterpret``
# in 3.6.
PUBLIC_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _tile_of(t):
    """Row i ≥ column j of lower tile t, numbered row by row: i(i+1)/2 ≤ t < (i+1)(i+2)/2 (float estimate,
    then exact fix-ups)."""
    i = ((gl.sqrt((8 * t + 1).to(gl.float32)) - 1.0) * 0.5).to(gl.int32)
    i = gl.where((i + 1) * (i + 2) // 2 <= t, i + 1, i)
    i = gl.where(i * (i + 1) // 2 > t, i - 1, i)
    return i, t - i * (i + 1) // 2


@gluon.jit
def _load_c_tile(desc_c, staging3, c_bar, batch, row0, col0):
    """The C tile at (row0, col0) by TMA into the staging buffer, once earlier stores have read it: it arrives
    (``c_bar``) while the tile's products run."""
    tma.store_wait(0)
    mbarrier.expect(c_bar, desc_c.block_type.nbytes)
    tma_load(desc_c, [batch, row0, col0], c_bar, staging3)


@gluon.jit
def _finish_tile(
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
    SCALE_POWER: gl.constexpr,
    LOWER_OUT: gl.constexpr,
    BM: gl.constexpr,
):
    """A finished tile's epilogue: s^p·(alpha·acc + beta·C + d·I) in fp32 (C from the staging buffer once
    ``c_bar`` completes phase ``c_phase``), rounded once, stored by TMA through the staging buffer. A tile
    below the diagonal is stored as itself and (unless LOWER_OUT) transposed; a diagonal tile (row0 = col0) has
    its lower part mirrored into its upper part and is stored once."""
    staging = staging3.reshape([BM, BM])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))[:, None]
    cols = gl.arange(0, BM, layout=gl.SliceLayout(0, ACC))[None, :]
    result = acc * alpha
    if HAS_C:
        mbarrier.wait(c_bar, c_phase)
        result += beta * staging.load(ACC).to(gl.float32)
    if HAS_DIAG:
        result += gl.where(rows + row0 == cols + col0, diag, 0.0)
    if SCALE_POWER > 0:
        factor = gl.load(scale_ptr + batch)
        if SCALE_POWER == 2:
            factor = factor * factor
        result = result * factor
    tile = result.to(desc_out.dtype)
    tma.store_wait(0)  # the previous tile's stores have left the staging buffer
    if row0 == col0:
        staging.permute((1, 0)).store(tile)
        staging.store(gl.where(rows >= cols, tile, staging.load(ACC)))
        fence_async_shared()
        tma_store(desc_out, [batch, row0, col0], staging3)
    else:
        staging.store(tile)
        fence_async_shared()
        tma_store(desc_out, [batch, row0, col0], staging3)
        if not LOWER_OUT:
            tma.store_wait(0)
            staging.permute((1, 0)).store(tile)
            fence_async_shared()
            tma_store(desc_out, [batch, col0, row0], staging3)


@gluon.jit
def _load_slice(rows_desc, cols_desc, panel, k, batch, bar, panels, mirrored, index, AS_COLUMNS, BM: gl.constexpr):
    """Slice k of ``panel``'s BM rows into ring panel ``index`` by TMA (arriving on ``bar``): as rows of the
    [B, m, k] operand, or (AS_COLUMNS) as the [BK, BM] block at rows k, columns panel·BM of the [B, k, m]
    storage, the ring panel reinterpreted (``mirrored``)."""
    if AS_COLUMNS:
        tma_load(cols_desc, [batch, k, panel * BM], bar, mirrored.index(index))
    else:
        tma_load(rows_desc, [batch, panel * BM, k], bar, panels.index(index))


@gluon.jit
def _slice_operands(panels, mirrored, a_index, b_index, A_COLUMNS: gl.constexpr, B_COLUMNS: gl.constexpr,
                    BM: gl.constexpr, BK: gl.constexpr):  # fmt: skip
    """The wgmma operands A [BM, BK] and Bᵀ [BK, BM] of one K slice, from ring panels a_index and b_index, each
    held as rows or (A_COLUMNS, B_COLUMNS) as columns."""
    if A_COLUMNS:
        a_op = mirrored.index(a_index).reshape([BK, BM]).permute((1, 0))
    else:
        a_op = panels.index(a_index).reshape([BM, BK])
    if B_COLUMNS:
        b_op = mirrored.index(b_index).reshape([BK, BM])
    else:
        b_op = panels.index(b_index).reshape([BM, BK]).permute((1, 0))
    return a_op, b_op


@gluon.jit
def _produce(p, TRANSPOSED: gl.constexpr, LOWER_IN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr,
             STAGES: gl.constexpr):  # fmt: skip
    """The producer warp: every K slice of every tile of this program, in tile order, into the ring: slot s
    holds X's slice in ring panel 2s and Y's in 2s + 1 (as columns for a transposed view, or with LOWER_IN
    above the operand's diagonal tile)."""
    desc_a, desc_a_cols, desc_b, desc_b_cols, panels, mirrored, ready, empty, K, total, per_matrix = p
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
            mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes)
            k = ki * BK
            if TRANSPOSED:  # desc_a, desc_b read column blocks
                _load_slice(desc_a, desc_a, i, k, batch, bar, panels, mirrored, 2 * slot, True, BM)
                _load_slice(desc_b, desc_b, j, k, batch, bar, panels, mirrored, 2 * slot + 1, True, BM)
            elif LOWER_IN:
                kt = k // BM
                _load_slice(desc_a, desc_a_cols, i, k, batch, bar, panels, mirrored, 2 * slot, kt > i, BM)
                _load_slice(desc_b, desc_b_cols, j, k, batch, bar, panels, mirrored, 2 * slot + 1, kt > j, BM)
            else:
                _load_slice(desc_a, desc_a, i, k, batch, bar, panels, mirrored, 2 * slot, False, BM)
                _load_slice(desc_b, desc_b, j, k, batch, bar, panels, mirrored, 2 * slot + 1, False, BM)
            g += 1


@gluon.jit
def _mma_slices(
    acc,
    g,
    start,
    stop,
    handoff,
    ring,
    CONSUMER: gl.constexpr,
    A_COLUMNS: gl.constexpr,
    B_COLUMNS: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The wgmmas of a tile's K slices start..stop, one in flight: each slice's slot released once the next
    one's wgmma is issued, the turn passed to the other consumer at slice ``handoff``. Returns the
    accumulator and the ring position after the last slice."""
    panels, mirrored, ready, empty, turn = ring
    for ki in range(start, stop):
        slot = g % STAGES
        mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
        a_op, b_op = _slice_operands(panels, mirrored, 2 * slot, 2 * slot + 1, A_COLUMNS, B_COLUMNS, BM, BK)
        acc = warpgroup_mma(a_op, b_op, acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1, pred=ki > 0)
        mbarrier.arrive(turn.index(1 - CONSUMER), count=1, pred=ki == handoff)
        g += 1
    return acc, g


@gluon.jit
def _consume(
    p,
    CONSUMER: gl.constexpr,
    ACC: gl.constexpr,
    TRANSPOSED: gl.constexpr,
    LOWER_IN: gl.constexpr,
    LOWER_OUT: gl.constexpr,
    HAS_C: gl.constexpr,
    HAS_DIAG: gl.constexpr,
    SCALE_POWER: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TURN_LEAD: gl.constexpr,
):
    """Consumer warpgroup CONSUMER: this program's tiles l ≡ CONSUMER (mod 2), products (with LOWER_IN in the
    three ranges of the module docstring) then epilogue. The turn passes to the other consumer once the wgmma
    TURN_LEAD slices before the tile's last is issued."""
    (
        desc_out,
        desc_c,
        scale_ptr,
        panels,
        mirrored,
        staging_bufs,
        ready,
        empty,
        turn,
        c_ready,
        K,
        total,
        per_matrix,
        alpha,
        beta,
        diag,
    ) = p
    staging3 = staging_bufs.index(CONSUMER)  # [1, BM, BM], for TMA
    c_bar = c_ready.index(CONSUMER)
    programs = gl.num_programs(0)
    num_k = gl.cdiv(K, BK)
    local = CONSUMER
    for t in range(gl.program_id(0) + CONSUMER * programs, total, 2 * programs):
        batch = t // per_matrix
        i, j = _tile_of(t % per_matrix)
        row0 = i * BM
        col0 = j * BM
        # Our turn on the ring: the other consumer has issued its previous tile's products but its last TURN_LEAD.
        phase = (local // 2) & 1  # this consumer's tiles so far, mod 2
        mbarrier.wait(turn.index(CONSUMER), phase ^ (1 - CONSUMER))
        if HAS_C:
            _load_c_tile(desc_c, staging3, c_bar, batch, row0, col0)
        acc = gl.zeros([BM, BM], gl.float32, ACC)
        g = local * num_k
        handoff = gl.maximum(num_k - 1 - TURN_LEAD, 0)
        ring = (panels, mirrored, ready, empty, turn)
        if LOWER_IN:
            j_end = (j + 1) * (BM // BK)
            i_end = (i + 1) * (BM // BK)
            acc, g = _mma_slices(acc, g, 0, j_end, handoff, ring, CONSUMER, False, False, BM, BK, STAGES)
            acc, g = _mma_slices(acc, g, j_end, i_end, handoff, ring, CONSUMER, False, True, BM, BK, STAGES)
            acc, g = _mma_slices(acc, g, i_end, num_k, handoff, ring, CONSUMER, True, True, BM, BK, STAGES)
        else:
            acc, g = _mma_slices(acc, g, 0, num_k, handoff, ring, CONSUMER, TRANSPOSED, TRANSPOSED, BM, BK, STAGES)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), count=1)
        local += 2

        _finish_tile(
            acc,
            desc_out,
            staging3,
            c_bar,
            phase,
            scale_ptr,
            batch,
            row0,
            col0,
            alpha,
            beta,
            diag,
            ACC,
            HAS_C,
            HAS_DIAG,
            SCALE_POWER,
            LOWER_OUT,
            BM,
        )
    tma.store_wait(0)


# No specialization on the integers' values or the pointers' alignment: one compiled kernel serves every size,
# so the host launches it directly after the first call (``ws_syrk._launch``).
@gluon.jit(do_not_specialize=["K", "total", "per_matrix"], do_not_specialize_on_alignment=["scale_ptr"])
def ws_syrk_kernel(
    desc_a,
    desc_a_cols,
    desc_b,
    desc_b_cols,
    desc_out,
    desc_c,
    scale_ptr,
    K,
    total,
    per_matrix,
    alpha,
    beta,
    diag,
    TRANSPOSED: gl.constexpr,
    LOWER_IN: gl.constexpr,
    LOWER_OUT: gl.constexpr,
    HAS_C: gl.constexpr,
    HAS_DIAG: gl.constexpr,
    SCALE_POWER: gl.constexpr,
    ROWS_LAYOUT: gl.constexpr,
    COLUMNS_LAYOUT: gl.constexpr,
    ACC: gl.constexpr,
    BM: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    TURN_LEAD: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    PRODUCER_REGS: gl.constexpr,
):
    """One persistent program per SM over ``total`` lower tiles (``per_matrix`` per matrix): a producer
    warp and two consumer warpgroups sharing a TMA ring of STAGES K slices (two panels each, held as rows in
    ROWS_LAYOUT or as columns in COLUMNS_LAYOUT). ``desc_a``/``desc_b`` read [1, BM, BK] row blocks, or for a
    transposed view (TRANSPOSED) [1, BK, BM] column blocks of its storage; with LOWER_IN ``desc_a_cols``/
    ``desc_b_cols`` read the column blocks above the diagonal (None otherwise)."""
    dtype: gl.constexpr = desc_out.dtype
    panels = gl.allocate_shared_memory(dtype, [2 * STAGES, 1, BM, BK], ROWS_LAYOUT)
    if PUBLIC_REINTERPRET:
        mirrored = panels.reinterpret(dtype, [2 * STAGES, 1, BK, BM], COLUMNS_LAYOUT)
    else:
        mirrored = panels._reinterpret(dtype, [2 * STAGES, 1, BK, BM], COLUMNS_LAYOUT)
    staging = gl.allocate_shared_memory(dtype, [2] + desc_out.block_type.shape, desc_out.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    for s in gl.static_range(2):
        mbarrier.init(turn.index(s), count=1)
    c_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(c_ready.index(s), count=1)
    consumer = (
        desc_out,
        desc_c,
        scale_ptr,
        panels,
        mirrored,
        staging,
        ready,
        empty,
        turn,
        c_ready,
        K,
        total,
        per_matrix,
        alpha,
        beta,
        diag,
    )
    producer = (desc_a, desc_a_cols, desc_b, desc_b_cols, panels, mirrored, ready, empty, K, total, per_matrix)
    gl.warp_specialize(
        [
            (
                _consume,
                (
                    consumer,
                    0,
                    ACC,
                    TRANSPOSED,
                    LOWER_IN,
                    LOWER_OUT,
                    HAS_C,
                    HAS_DIAG,
                    SCALE_POWER,
                    BM,
                    BK,
                    STAGES,
                    TURN_LEAD,
                ),
            ),
            (
                _consume,
                (
                    consumer,
                    1,
                    ACC,
                    TRANSPOSED,
                    LOWER_IN,
                    LOWER_OUT,
                    HAS_C,
                    HAS_DIAG,
                    SCALE_POWER,
                    BM,
                    BK,
                    STAGES,
                    TURN_LEAD,
                ),
            ),
            (_produce, (producer, TRANSPOSED, LOWER_IN, BM, BK, STAGES)),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )
