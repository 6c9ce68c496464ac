"""Warp-specialized Hopper SYRK kernel (Gluon, code in :mod:`.ws_syrk_kernel`): the products of
:mod:`.triton_syrk`, as fast as that kernel or faster for products of at least 2³³ multiply-adds with Gram
side m ≤ 4096, where the GPU backend takes it (:func:`ws_syrk_pays`).

    out_b = s_b^p·(alpha·X_b·Y_bᵀ + beta·C_b + d·I)     X, Y: [B, m, k] (or transposed views of
                                                         contiguous [B, k, m]), C: [B, m, m] symmetric

Each SM runs one persistent program of three partitions:

- a producer warp walks the program's tiles and streams 64-deep K slices of X's and Y's 128-row panels into
  a ring of ``STAGES`` shared-memory slots by TMA (``ready`` barriers), refilling a slot once the consumer
  that read it releases it (``empty`` barriers);
- two consumer warpgroups take the program's tiles in turn (its l-th tile goes to consumer l mod 2), each
  with a 128×128 fp32 accumulator in registers. A ``turn`` barrier hands the ring from one to the other once
  it has issued its tile's second-to-last wgmma (``TURN_LEAD``), so the other's first products are queued
  before the tensor cores run dry, and one consumer's epilogue (scale, C term, diagonal, rounding, stores)
  runs while the other's products keep the tensor cores busy. The C tile is loaded by TMA into the
  consumer's staging buffer when its turn starts, so it has arrived by the epilogue (``c_ready`` barriers).

Tiles are the 128×128 squares (i, j), j ≤ i, of the lower triangle, numbered row by row over the batch;
tile t goes to program t mod P, so at any moment the programs work on neighbouring tiles that share panels
in L2. A tile below the diagonal is stored by TMA twice, as itself and transposed (through the consumer's
staging buffer); a diagonal tile has its lower part mirrored into its upper part in shared memory and is
stored once. Every element is written once: the result is exactly symmetric and deterministic, and equals
the Triton kernel's up to the order of the fp32 sums.

For Gram Newton–Schulz's chain of symmetric products the kernel also reads and writes lower tiles only
(``lower_in``: operands valid in their 128×128 lower tiles, a K slice above an operand's diagonal tile read as
the columns of its mirror; ``lower_out``: a tile below the diagonal stored once): the same tiles, the same sums,
21 of 36 tiles' bytes at m = 768 (:meth:`.triton_matmuls.TritonMatmuls.keeps_lower_tiles`).

Why it is built this way, and where it still loses to cuBLAS per clock: docs/kernels.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch
import triton
from torch import Tensor

from .normalize import require_scale
from .shapes import decision_count, decision_work
from .triton_syrk import capability_major, is_transposed_view, lower_tile_count, tma_aligned

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .ws_syrk_kernel import ws_syrk_kernel
except ImportError:  # a Triton without Gluon's Hopper API: the Triton kernel runs every product
    ws_syrk_kernel = None

# 128×128 tiles, 64-deep K slices: two fp32 accumulators of 128×128 fill the consumers' registers.
BLOCK = 128
BLOCK_K = 64
# Ring slots (STAGES), turn lead in K slices (TURN_LEAD), registers per thread of a consumer and of the producer
# (the consumers take what the producer leaves).
# Chosen by measurement: docs/kernels.md "Measured constants" (re-measure: tools/kernels/ws_syrk_tuning.py)
STAGES = 5
TURN_LEAD = 1
CONSUMER_REGS = 240
PRODUCER_REGS = 24
MAX_REGS = 168  # 12 warps (two consumer warpgroups, the producer's warpgroup) · 32 · 168 ≤ 65536 registers
# Largest Gram side (the Triton kernel's 256×128 tiles win above it) and fewest multiply-adds B·m²·k per product
# (2³¹: a unit of 8 768-wide experts' m×m products, 8·768³, run here too).
# Chosen by measurement: docs/kernels.md "Measured constants" (re-measure: tools/kernels/ws_min_work.py, and
# tools/kernels/ns_variants.py for whole calls below 2³³)
WS_MAX_DIM = 4096
WS_MIN_WORK = 2**31
_enabled = os.environ.get("DTENSOR_MUON_WS_SYRK", "1") != "0"


@contextlib.contextmanager
def ws_syrk_enabled(enabled: bool) -> Iterator[None]:
    """Turns the warp-specialized kernel on or off inside the block (benchmarks compare both; the
    environment variable DTENSOR_MUON_WS_SYRK=0 turns it off for a whole run)."""
    global _enabled
    before, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = before


def _tma_storage(x3: Tensor) -> Tensor:
    """The row-major storage TMA reads: x itself, or [B, k, m] for a transposed view."""
    return x3.mT if is_transposed_view(x3) else x3


def _tma_readable(t3: Tensor) -> bool:
    """Whether TMA reads [B, m, k] ``t3`` in place: its storage's last stride 1, the base and other strides
    16-byte aligned."""
    return _tma_storage(t3).stride(-1) == 1 and tma_aligned(t3, is_transposed_view(t3))


def _kernel_runs_on(x: Tensor) -> bool:
    """Gluon's Hopper API present and x bf16/fp16 on a compute-capability-9 GPU."""
    return (
        ws_syrk_kernel is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and capability_major(x.device.index or 0) == 9
    )


def ws_syrk_supports(x: Tensor, y: Tensor | None = None) -> bool:
    """Whether :func:`ws_syrk` can run the products on ``x`` ([m, k] or [B, m, k]) and ``y``: Gluon's Hopper
    API present, x bf16/fp16 on a compute-capability-9 GPU, 8 | m, x readable by TMA, and y (when given) of
    x's shape, strides and dtype; not empty."""
    if x.ndim not in (2, 3) or x.numel() == 0 or x.size(-2) % 8 or not _kernel_runs_on(x):
        return False
    if y is not None and (y.shape != x.shape or y.stride() != x.stride() or y.dtype != x.dtype):
        return False
    return all(_tma_readable(t if t.ndim == 3 else t.unsqueeze(0)) for t in (x, x if y is None else y))


def ws_syrk_runs_products(x: Tensor) -> bool:
    """Whether :func:`ws_syrk_pays` holds for the m×m products of Newton–Schulz on the wide ``x`` ([m, n] or
    [B, m, n]): enabled, Gluon's Hopper API present, x bf16/fp16 on a compute-capability-9 GPU, 8 | m ≤
    WS_MAX_DIM and B·m³ ≥ WS_MIN_WORK, B counted as the dispatch counts it (:func:`.shapes.decision_count`; the
    products are new contiguous [B, m, m] tensors, which TMA reads)."""
    m = x.size(-2)
    return (
        _enabled and m <= WS_MAX_DIM and m % 8 == 0 and decision_count(x) * m**3 >= WS_MIN_WORK and _kernel_runs_on(x)
    )


def _tma_reads_c(c: Tensor, x: Tensor) -> bool:
    """Whether the kernel's TMA descriptor reads C in place: contiguous, 16-byte aligned, in x's dtype."""
    return c.dtype == x.dtype and c.is_contiguous() and c.data_ptr() % 16 == 0


def ws_syrk_pays(x: Tensor, y: Tensor | None = None, c: Tensor | None = None) -> bool:
    """Whether the backend should run the products on ``x``, ``y`` and ``c`` with this kernel rather than the
    Triton one: enabled, m ≤ WS_MAX_DIM, at least WS_MIN_WORK multiply-adds (B·m²·k, B as
    :func:`.shapes.decision_count` counts it), supported, and C (if any) contiguous, 16-byte aligned and in x's
    dtype, as its TMA reads need."""
    return (
        _enabled
        and x.size(-2) <= WS_MAX_DIM
        and decision_work(x) >= WS_MIN_WORK
        and (c is None or _tma_reads_c(c, x))
        and ws_syrk_supports(x, y)
    )


@functools.cache
def _nvmma(shape: tuple[int, ...], dtype: torch.dtype) -> object:
    """The shared-memory layout of a TMA block (cached: launches are on the host's critical path)."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


@functools.cache
def _accumulator_layout() -> object:
    """wgmma accumulator of one warpgroup: 4 warps along the 128 rows, 64×128 instructions."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK, 16])


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _operand_descriptors(t3: Tensor, transposed: bool, lower_in: bool) -> tuple[object, object | None]:
    """The TMA descriptors the kernel reads [B, m, k] ``t3`` through: row blocks [1, BLOCK, BLOCK_K] (column
    blocks [1, BLOCK_K, BLOCK] of the storage for a transposed view), and for a symmetric operand stored as
    lower tiles (``lower_in``) also column blocks, for the slices above the diagonal (else None)."""
    cols = None
    if transposed or lower_in:
        cols = TensorDescriptor.from_tensor(
            _tma_storage(t3), [1, BLOCK_K, BLOCK], _nvmma((1, BLOCK_K, BLOCK), t3.dtype)
        )
        if transposed:
            return cols, None
    rows = TensorDescriptor.from_tensor(t3, [1, BLOCK, BLOCK_K], _nvmma((1, BLOCK, BLOCK_K), t3.dtype))
    return rows, cols


def _launch_operands(
    x: Tensor, y: Tensor | None, c: Tensor | None, scale: Tensor | None, scale_power: int, lower_in: bool
) -> tuple[Tensor, tuple, bool]:
    """What a launch needs, after checking C and the scale: the new [B, m, m] output, the TMA descriptors of X
    and Y (row and column blocks of 128-row panels, BLOCK_K deep: :func:`_operand_descriptors`), the output
    and C (the output's when no C), the scale argument (the output when none), and whether X is a transposed
    view."""
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    y3 = x3 if y is None else (y if y.ndim == 3 else y.unsqueeze(0))
    batch, m, _ = x3.shape
    if scale is not None:
        require_scale(scale, batch, x.device, "ws_syrk")
        if scale_power not in (1, 2):
            raise ValueError(f"ws_syrk: scale_power must be 1 or 2, got {scale_power}")
    c3 = None if c is None else (c if c.ndim == 3 else c.unsqueeze(0)).contiguous()
    if c3 is not None and (tuple(c3.shape) != (batch, m, m) or not _tma_reads_c(c3, x)):
        raise ValueError(
            f"ws_syrk: C must have X's batch, be {m}×{m} in X's dtype {x.dtype} and 16-byte "
            f"aligned, got {tuple(c.shape)} {c.dtype}"
        )
    transposed = is_transposed_view(x3)
    if lower_in and (transposed or m % BLOCK or x3.size(-1) != m or not x3.is_contiguous() or not y3.is_contiguous()):
        raise ValueError(
            f"ws_syrk: lower-tile operands must be contiguous [B, m, m] stacks with {BLOCK} | m, got X "
            f"{tuple(x3.shape)} {x3.stride()}, Y {tuple(y3.shape)} {y3.stride()}"
        )
    out = torch.empty((batch, m, m), device=x.device, dtype=x.dtype)
    desc_a, desc_a_cols = _operand_descriptors(x3, transposed, lower_in)
    desc_b, desc_b_cols = (desc_a, desc_a_cols) if y is None else _operand_descriptors(y3, transposed, lower_in)
    out_block = (1, BLOCK, BLOCK)
    out_layout = _nvmma(out_block, x.dtype)
    desc_out = TensorDescriptor.from_tensor(out, list(out_block), out_layout)
    desc_c = desc_out if c3 is None else TensorDescriptor.from_tensor(c3, list(out_block), out_layout)
    descriptors = (desc_a, desc_a_cols, desc_b, desc_b_cols, desc_out, desc_c)
    return out, (*descriptors, out if scale is None else scale), transposed


def ws_syrk(
    x: Tensor,
    y: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Tensor | None = None,
    diag: float = 0.0,
    scale: Tensor | None = None,
    scale_power: int = 1,
) -> Tensor:
    """``s^p·(alpha·X·Yᵀ + beta·C + diag·I)`` for X and Y (default X) where :func:`ws_syrk_supports` (x, y);
    C symmetric [.., m, m] in x's dtype; ``scale`` s fp32 with one entry per matrix, p = ``scale_power`` 1 or
    2. Returns a new, exactly symmetric [.., m, m] tensor in x's dtype."""
    if not ws_syrk_supports(x, y):
        raise ValueError(
            "ws_syrk: X and Y must meet ws_syrk_supports (a Hopper GPU, bf16/fp16, 8 | m, "
            f"TMA-aligned, Y like X), got X {tuple(x.shape)} {x.stride()} {x.dtype}"
        )
    return ws_syrk_supported(x, y, alpha, beta, c, diag, scale, scale_power)


def ws_syrk_supported(
    x: Tensor,
    y: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Tensor | None = None,
    diag: float = 0.0,
    scale: Tensor | None = None,
    scale_power: int = 1,
    lower_in: bool = False,
    lower_out: bool = False,
) -> Tensor:
    """:func:`ws_syrk` for a caller that has established ``ws_syrk_supports(x, y)`` (the dispatch, through
    :func:`ws_syrk_pays`): the same checks of C and the scale, without that one's host cost again.
    ``lower_in``: X, Y and C are symmetric [B, m, m] stacks (128 | m) of which only the 128×128 lower tiles
    are read; ``lower_out``: only the output's lower tiles are written (its upper tiles left as allocated)."""
    out, operands, transposed = _launch_operands(x, y, c, scale, scale_power, lower_in)
    batch, m, k = out.size(0), out.size(1), x.size(-1)
    per_matrix = lower_tile_count(m, BLOCK, 1)  # 128×128 squares on or below the diagonal
    total = per_matrix * batch
    programs = min(_sm_count(x.device.index or 0), triton.cdiv(total, 2))
    flags = (transposed, lower_in, lower_out, c is not None, diag != 0.0, 0 if scale is None else scale_power)
    # Triton types the integers i32 or i64 by value, so their range is part of the compiled kernel's key.
    types = (x.dtype, operands[-1].dtype, x.device.index, max(k, total) >= 2**31)
    _launch(programs, (*operands, k, total, per_matrix, float(alpha), float(beta), float(diag)), flags, types)
    return out if x.ndim == 3 else out.squeeze(0)


# The compiled kernel for each set of constexprs and compile options (the flags and the module's tunables, which
# tools/kernels/ws_syrk_tuning.py varies) and argument types, from its first launch through Triton's JIT. The
# kernel specializes on nothing else (no integer values, no alignments), so later launches skip the JIT's
# argument binding and specialization, and cost the host less than the Triton kernel's launches (docs/kernels.md
# "Why this shape").
_COMPILED: dict[tuple, object] = {}


def _launch(programs: int, args: tuple, flags: tuple[bool, bool, bool, bool, bool, int], types: tuple) -> None:
    acc = _accumulator_layout()
    dtype = types[0]
    layouts = (_nvmma((1, BLOCK, BLOCK_K), dtype), _nvmma((1, BLOCK_K, BLOCK), dtype))
    constexprs = (*flags, *layouts, acc, BLOCK, BLOCK_K, STAGES, TURN_LEAD, CONSUMER_REGS, PRODUCER_REGS)
    key = (constexprs, MAX_REGS, types)
    compiled = _COMPILED.get(key)
    if compiled is not None:
        compiled[(programs, 1, 1)](*args, *constexprs)
        return
    transposed, lower_in, lower_out, has_c, has_diag, scale_power = flags
    _COMPILED[key] = ws_syrk_kernel[(programs,)](
        *args,
        TRANSPOSED=transposed,
        LOWER_IN=lower_in,
        LOWER_OUT=lower_out,
        HAS_C=has_c,
        HAS_DIAG=has_diag,
        SCALE_POWER=scale_power,
        ROWS_LAYOUT=layouts[0],
        COLUMNS_LAYOUT=layouts[1],
        ACC=acc,
        BM=BLOCK,
        BK=BLOCK_K,
        STAGES=STAGES,
        TURN_LEAD=TURN_LEAD,
        CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4,
        maxnreg=MAX_REGS,
    )
