"""Products of symmetric m×m matrices stored as their lower tiles only: a prototype kernel, checked and timed.

    TRITON_INTERPRET=1 PYTHONPATH=src python tools/kernels/lower_tile_products.py --check      (CPU, interpreter)
    PYTHONPATH=src python tools/kernels/lower_tile_products.py --check                          (GPU)
    PYTHONPATH=src python tools/kernels/lower_tile_products.py --time --out lower_tiles.json    (GPU)
    ... --kernel pointers|tma|both|gluon|all (default both) --tma-layout 3d|flat|both (default both)

Gram Newton–Schulz runs a chain of products of symmetric m×m matrices (R·Z, Z·(R·Z), Q·Z, the poly
a·I + b·R + c·R·R). The library's SYRK kernels compute only the lower tiles of a product (m³ FLOPs) but read
both operands in full and write the result mirrored, so a product moves 3·2m² bytes (bf16); at m = 768 on
expert stacks it is bound by memory. Here every symmetric matrix lives in the ordinary [B, m, m] buffer as its
lower tiles only at tile size T: element (r, c) is valid iff r//T ≥ c//T (diagonal tiles whole), the upper tiles
are never read or written. With t = m/T tiles a side a matrix holds t(t+1)/2 of the t² tiles (21 of 36 at
T = 128, m = 768: 58%), and a product moves 3·2·t(t+1)/2·T² bytes: 58% of the mirrored product's (2 operands
read, 1 written; the poly A·A reads one operand: 2·2·t(t+1)/2·T²).

The kernel (one program per lower output tile (i, j), i ≥ j, and matrix; BLOCK_M = BLOCK_N = T, BLOCK_K | T)
computes C[i, j] = Σ_kt A[i, kt]·B[kt, j] in three pipelined loops with constant strides, each k-step inside one
tile column:

    kt < j        A[i, kt] direct,            B[kt, j] = B[j, kt]ᵀ (the pointer block's strides swapped)
    j ≤ kt ≤ i    A[i, kt] direct,            B[kt, j] direct
    kt > i        A[i, kt] = A[kt, i]ᵀ,       B[kt, j] direct

fp32 accumulation, the library's epilogue s·(alpha·A·B + beta·A + diag·I) (the poly: alpha = c, beta = b,
diag = a, B = A), bf16 lower tiles out; rows and columns ≥ m are masked when T does not divide m.

The TMA variant (``_lower_tile_tma_kernel``, ``--kernel tma``) has the same math and k ranges but reads every tile
through host-built TMA descriptors, as the library's Triton SYRK kernel does: [T, BLOCK_K] blocks for direct tiles,
[BLOCK_K, T] blocks for the mirrored ones (A[kt, i] in kt > i, then ``tl.trans`` into the dot's A operand; B[j, kt]
in kt < j loaded as [T, BLOCK_K] and transposed), and C's tile and the output through [T, T] blocks (the output
stored by TMA, as the library's kernel does with host descriptors). Two descriptor layouts (``--tma-layout``): "3d"
over [B, m, m] with blocks [1, ·, ·] reshaped to 2-D, and "flat" over the batch's rows stacked, [B·m, m], the
library's own layout. T must divide m (no edge tiles, refused otherwise); the checks skip the other sizes, and
``--time`` skips the configs whose T does not divide m.

The Gluon variant (``--kernel gluon``) is the library's warp-specialized Hopper kernel (``kernels/ws_syrk.py``)
reading and writing lower tiles (``lower_in``, ``lower_out``): T = 128, BLOCK_K = 64, its ring depth the one knob ``--time`` varies
(GLUON_STAGES); it runs on a Hopper GPU only, so the interpreter's checks skip it.

``--check`` (CPU under the Triton interpreter, or a GPU) runs small stacks (B ∈ {1, 3}, m ∈ {128, 192, 256},
T = 64, BLOCK_K = 32; BLOCK_K = 64; m = 160 at T = 64 and m = 192 at T = 128 for the edge masks; m = 256 at
T = 128, BLOCK_K = 64), by every variant chosen, with NaN in every never-valid upper tile of the inputs and the
output: the lower tiles against a float64 reference within bf16 output rounding (2⁻⁸ of the row's largest entry) plus
fp32 accumulation (m·2⁻²⁴·(|A|·|B|)), the output's upper tiles still NaN, and a two-product chain R·Z, Z·(R·Z),
both lower-tile, against the reference. ``--time`` (GPU) times, for each stack (B ∈ {32, 128},
m ∈ {512, 768, 1024, 1408}) and each op (``product`` R·Z, ``poly``), every config of each lower-tile variant
(T, BLOCK_K, num_warps, num_stages), the library's kernel on full symmetric stacks
(``SYRK_MATMULS.symmetric_product`` / ``poly``: the Gluon kernel on Hopper where it pays, else the Triton one)
and ``torch.bmm`` (the poly: ``torch.baddbmm``, without a·I), each replayed from a CUDA graph (median of 7 rounds); it checks the best config's lower
tiles against the library's result and a float64 reference, and prints a markdown table: µs of each, the
lower-tile kernel's ratio to the library, its GB/s on the bytes it touches and TFLOP/s counting m³ per matrix
(the library's GB/s on its own bytes, 2 or 1 full operands read and a full result written, beside it), a row
per stack and variant ("pointers", "tma-3d", "tma-flat").

Under Triton 3.9's interpreter both kernels take an UPCAST path: bf16 tiles go to fp32 before ``tl.dot``
(the interpreter multiplies bf16 as raw uint16 bits) and the result is rounded to nearest bf16 by hand (the
interpreter truncates); the GPU compiles the plain bf16 ``tl.dot`` and conversion.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from graph_timing import graph_us
from torch import Tensor

# (T, BLOCK_K, num_warps, num_stages) tried by --time; the check runs T = 64, BLOCK_K = 32.
CONFIGS: tuple[tuple[int, int, int, int], ...] = tuple(itertools.product((64, 128), (32, 64), (4, 8), (2, 3, 4)))
GLUON_STAGES = (4, 5)  # ring depths --time tries for the library's Gluon kernel (its own is ws_syrk.STAGES, 5)
KELLER = (3.4445, -4.775, 2.0315)


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a·b in fp32. The Triton interpreter (3.9) multiplies bf16 tiles as their raw uint16 bits, so
    there (UPCAST) the tiles go to fp32 first: the same exact products and fp32 sums as the tensor cores'."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc) if UPCAST else tl.dot(a, b, acc)


@triton.jit
def _round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), still fp32: its conversion is then exact even where
    the conversion truncates (the interpreter). Finite inputs only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _lower_tile_kernel(
    a_ptr,
    b_ptr,  # B (= A for the poly); lower tiles only, like A
    scale_ptr,  # HAS_SCALE: fp32, one entry per matrix
    out_ptr,
    M,
    stride_ab,
    stride_am,
    stride_bb,
    stride_bm,
    stride_ob,
    stride_om,
    alpha,
    beta,
    diag,
    HAS_C: tl.constexpr,  # beta·A[i, j] in the epilogue (the poly's b·A)
    HAS_DIAG: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EVEN: tl.constexpr,  # T divides M: no masks
    T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the Triton interpreter only (see _dot, _round_to_bf16)
):
    """One lower output tile (i, j) of one matrix: s·(alpha·A·B + beta·A + diag·I), operands and result as lower
    tiles; the k loop split where A's row tile and B's column tile cross the diagonal."""
    # Tile t: row i is the largest with i(i+1)/2 <= t (float estimate, then exact fix-ups).
    t = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    ti = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    ti = tl.where((ti + 1) * (ti + 2) // 2 <= t, ti + 1, ti)
    ti = tl.where(ti * (ti + 1) // 2 > t, ti - 1, ti)
    tj = t - ti * (ti + 1) // 2
    row0 = ti * T
    col0 = tj * T

    a_base = a_ptr + batch * stride_ab
    b_base = b_ptr + batch * stride_bb
    offs = tl.arange(0, T)
    ks = tl.arange(0, BLOCK_K)
    rows = row0 + offs  # the output's rows: A's row tile i
    cols = col0 + offs  # the output's columns: B's column tile j
    acc = tl.zeros((T, T), dtype=tl.float32)

    # kt < j: A[i, kt] direct, B[kt, j] read as B[j, kt]ᵀ (k contiguous). k < col0 < M: only rows/cols masked.
    a_ptrs = a_base + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_base + cols[None, :] * stride_bm + ks[:, None]
    for _k0 in range(0, col0, BLOCK_K):
        if EVEN:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=rows[:, None] < M, other=0.0)
            b = tl.load(b_ptrs, mask=cols[None, :] < M, other=0.0)
        acc = _dot(a, b, acc, UPCAST)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    # j <= kt <= i: both direct; A's pointers go on from k = col0.
    b_ptrs = b_base + (col0 + ks)[:, None] * stride_bm + cols[None, :]
    if EVEN:
        for _k0 in range(col0, row0 + T, BLOCK_K):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            acc = _dot(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bm
    else:
        for k0 in range(col0, tl.minimum(row0 + T, M), BLOCK_K):
            k_ok = (k0 + ks) < M
            a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols[None, :] < M), other=0.0)
            acc = _dot(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bm

    # kt > i: A[i, kt] read as A[kt, i]ᵀ (rows contiguous), B direct; B's pointers go on from k = row0 + T.
    a_ptrs = a_base + (row0 + T + ks)[None, :] * stride_am + rows[:, None]
    if EVEN:
        for _k0 in range(row0 + T, M, BLOCK_K):
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            acc = _dot(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K * stride_am
            b_ptrs += BLOCK_K * stride_bm
    else:
        for k0 in range(row0 + T, M, BLOCK_K):
            k_ok = (k0 + ks) < M
            a = tl.load(a_ptrs, mask=(rows[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (cols[None, :] < M), other=0.0)
            acc = _dot(a, b, acc, UPCAST)
            a_ptrs += BLOCK_K * stride_am
            b_ptrs += BLOCK_K * stride_bm

    inside = (rows[:, None] < M) & (cols[None, :] < M)
    result = acc * alpha
    if HAS_C:  # A's tile (i, j), i >= j: a lower tile, stored
        c_ptrs = a_base + rows[:, None] * stride_am + cols[None, :]
        c_tile = tl.load(c_ptrs) if EVEN else tl.load(c_ptrs, mask=inside, other=0.0)
        result += beta * c_tile.to(tl.float32)
    if HAS_DIAG:
        result += tl.where(rows[:, None] == cols[None, :], diag, 0.0)
    if HAS_SCALE:
        result = result * tl.load(scale_ptr + batch)
    if UPCAST:  # the interpreter truncates fp32 to bf16: round to nearest even first, as the GPU does
        result = _round_to_bf16(result)
    result = result.to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + batch * stride_ob + rows[:, None] * stride_om + cols[None, :]
    if EVEN:
        tl.store(out_ptrs, result)
    else:
        tl.store(out_ptrs, result, mask=inside)


@triton.jit
def _tile_load(desc, batch, M, r0, c0, R: tl.constexpr, C: tl.constexpr, FLAT: tl.constexpr):
    """The [R, C] tile at (r0, c0) of matrix ``batch``: through a 2-D descriptor over the batch's rows stacked
    ([B·M, M], block [R, C]; FLAT) or a 3-D one over [B, M, M] (block [1, R, C], the unit dimension dropped)."""
    return desc.load([batch * M + r0, c0]) if FLAT else desc.load([batch, r0, c0]).reshape(R, C)


@triton.jit
def _tile_store(desc, batch, M, r0, c0, value, T: tl.constexpr, FLAT: tl.constexpr):
    """Store the [T, T] tile ``value`` at (r0, c0) of matrix ``batch`` (descriptors as in _tile_load)."""
    if FLAT:
        desc.store([batch * M + r0, c0], value)
    else:
        desc.store([batch, r0, c0], value.reshape(1, T, T))


@triton.jit
def _lower_tile_tma_kernel(
    a_rows,  # A, block [T, BLOCK_K]: A[i, kt] direct
    a_cols,  # A, block [BLOCK_K, T]: A[kt, i] (for A[i, kt] = A[kt, i]ᵀ, kt > i)
    b_rows,  # B, block [T, BLOCK_K]: B[j, kt] (for B[kt, j] = B[j, kt]ᵀ, kt < j); None when B_IS_A
    b_cols,  # B, block [BLOCK_K, T]: B[kt, j] direct; None when B_IS_A
    c_desc,  # HAS_C: A, block [T, T]; else None
    out_desc,  # the output, block [T, T]
    scale_ptr,  # HAS_SCALE: fp32, one entry per matrix
    M,
    alpha,
    beta,
    diag,
    B_IS_A: tl.constexpr,  # the poly: B's tiles through A's descriptors
    HAS_C: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FLAT: tl.constexpr,  # 2-D descriptors over [B·M, M] (else 3-D over [B, M, M])
    T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # the Triton interpreter only (see _dot, _round_to_bf16)
):
    """_lower_tile_kernel's tile (i, j), same three k ranges, every tile through a TMA descriptor; T divides M."""
    t = tl.program_id(0)
    batch = tl.program_id(1)
    ti = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    ti = tl.where((ti + 1) * (ti + 2) // 2 <= t, ti + 1, ti)
    ti = tl.where(ti * (ti + 1) // 2 > t, ti - 1, ti)
    tj = t - ti * (ti + 1) // 2
    row0 = ti * T
    col0 = tj * T
    b_rows_desc = a_rows if B_IS_A else b_rows
    b_cols_desc = a_cols if B_IS_A else b_cols
    acc = tl.zeros((T, T), dtype=tl.float32)

    # kt < j: A[i, kt] direct, B[kt, j] = B[j, kt]ᵀ.
    for k0 in range(0, col0, BLOCK_K):
        a = _tile_load(a_rows, batch, M, row0, k0, T, BLOCK_K, FLAT)
        b = _tile_load(b_rows_desc, batch, M, col0, k0, T, BLOCK_K, FLAT)
        acc = _dot(a, tl.trans(b), acc, UPCAST)
    # j <= kt <= i: both direct.
    for k0 in range(col0, row0 + T, BLOCK_K):
        a = _tile_load(a_rows, batch, M, row0, k0, T, BLOCK_K, FLAT)
        b = _tile_load(b_cols_desc, batch, M, k0, col0, BLOCK_K, T, FLAT)
        acc = _dot(a, b, acc, UPCAST)
    # kt > i: A[i, kt] = A[kt, i]ᵀ, B direct.
    for k0 in range(row0 + T, M, BLOCK_K):
        a_t = _tile_load(a_cols, batch, M, k0, row0, BLOCK_K, T, FLAT)
        b = _tile_load(b_cols_desc, batch, M, k0, col0, BLOCK_K, T, FLAT)
        acc = _dot(tl.trans(a_t), b, acc, UPCAST)

    result = acc * alpha
    if HAS_C:  # A's tile (i, j), i >= j: a lower tile, stored
        result += beta * _tile_load(c_desc, batch, M, row0, col0, T, T, FLAT).to(tl.float32)
    if HAS_DIAG:
        offs = tl.arange(0, T)
        result += tl.where((row0 + offs)[:, None] == (col0 + offs)[None, :], diag, 0.0)
    if HAS_SCALE:
        result = result * tl.load(scale_ptr + batch)
    if UPCAST:  # the interpreter truncates fp32 to bf16: round to nearest even first, as the GPU does
        result = _round_to_bf16(result)
    _tile_store(out_desc, batch, M, row0, col0, result.to(out_desc.dtype), T, FLAT)


def tile_count(m: int, tile: int) -> int:
    """Lower tiles (diagonal ones included) of an m×m matrix at tile size ``tile``."""
    sides = triton.cdiv(m, tile)
    return sides * (sides + 1) // 2


def lower_tile_mask(m: int, tile: int, device: torch.device | str = "cpu") -> Tensor:
    """[m, m] bool: True where element (r, c) lies in a lower tile (r//tile >= c//tile)."""
    idx = torch.arange(m, device=device) // tile
    return idx[:, None] >= idx[None, :]


def lower_tile_elements(m: int, tile: int) -> int:
    """Elements of an m×m matrix inside its lower tiles (edge tiles counted as far as they reach)."""
    return int(lower_tile_mask(m, tile).sum())


def pack_lower(full: Tensor, tile: int, fill: float = 0.0) -> Tensor:
    """A copy of the symmetric [.., m, m] ``full`` with its upper tiles (never valid) set to ``fill``: NaN in the
    checks, so that a kernel reading them is caught."""
    mask = lower_tile_mask(full.size(-1), tile, full.device)
    return torch.where(mask, full, torch.full_like(full, fill))


def unpack_lower(stored: Tensor, tile: int) -> Tensor:
    """The full symmetric matrix that lower tiles stand for: the lower tiles, and their mirror images above."""
    mask = lower_tile_mask(stored.size(-1), tile, stored.device)
    return torch.where(mask, stored, stored.mT)


def checked_operands(
    who: str, a: Tensor, b: Tensor | None, scale: Tensor | None, tile: int, block_k: int
) -> tuple[Tensor, int, int]:
    """The checks both product functions make (``who`` names the one in its errors): A is [B, m, m] with
    contiguous rows, B (A when None) matches it, BLOCK_K divides the tile, a scale is fp32 with one entry per
    matrix. Returns B, the batch and m."""
    if a.ndim != 3 or a.size(-1) != a.size(-2) or a.stride(-1) != 1:
        raise ValueError(f"{who}: A must be [B, m, m] with contiguous rows, got {tuple(a.shape)}")
    bmat = a if b is None else b
    if bmat.shape != a.shape or bmat.stride(-1) != 1 or bmat.dtype != a.dtype:
        raise ValueError(f"{who}: B must match A in shape and dtype, with contiguous rows")
    if tile % block_k:
        raise ValueError(f"{who}: BLOCK_K {block_k} must divide the tile {tile}")
    batch, m, _ = a.shape
    if scale is not None and (scale.dtype != torch.float32 or scale.numel() != batch):
        raise ValueError(f"{who}: scale must be fp32 with one entry per matrix")
    return bmat, batch, m


def lower_tile_product(
    a: Tensor,
    b: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    scale: Tensor | None = None,
    out: Tensor | None = None,
    tile: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
) -> Tensor:
    """s·(alpha·A·B + beta·A + diag·I) for symmetric [B, m, m] A and B (B = A when None) stored as lower tiles at
    ``tile``; returns the result's lower tiles (``out``, or a new buffer whose upper tiles are left unwritten)."""
    bmat, batch, m = checked_operands("lower_tile_product", a, b, scale, tile, block_k)
    if out is None:
        out = torch.empty_like(a)
    _lower_tile_kernel[(tile_count(m, tile), batch)](
        a,
        bmat,
        out if scale is None else scale,
        out,
        m,
        a.stride(0),
        a.stride(1),
        bmat.stride(0),
        bmat.stride(1),
        out.stride(0),
        out.stride(1),
        float(alpha),
        float(beta),
        float(diag),
        HAS_C=beta != 0.0,
        HAS_DIAG=diag != 0.0,
        HAS_SCALE=scale is not None,
        EVEN=m % tile == 0,
        T=tile,
        BLOCK_K=block_k,
        UPCAST=a.device.type == "cpu",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


TMA_LAYOUTS = ("3d", "flat")


def _descriptor(t: Tensor, block: tuple[int, int], layout: str) -> object:
    """A host TMA descriptor over the [B, m, m] stack ``t``: 3-D ([B, m, m], block [1, *block]) or flat
    ([B·m, m], block ``block``; the batch's rows stacked, so T must divide m: no tile crosses two matrices)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, m, _ = t.shape
    if layout == "flat":
        return TensorDescriptor(t, [batch * m, m], [t.stride(1), 1], list(block))
    return TensorDescriptor(t, [batch, m, m], list(t.stride()), [1, *block])


def _tma_ready(t: Tensor, layout: str) -> bool:
    """TMA's needs: a 16-byte aligned base, contiguous rows, 16-byte aligned strides (bf16: multiples of 8);
    flat also adjacent matrices (stride(0) = m·stride(1))."""
    m = t.size(-1)
    aligned = t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and t.stride(1) % 8 == 0 and t.stride(0) % 8 == 0
    return aligned and (layout != "flat" or t.stride(0) == m * t.stride(1))


def lower_tile_product_tma(
    a: Tensor,
    b: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    scale: Tensor | None = None,
    out: Tensor | None = None,
    tile: int = 128,
    block_k: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    layout: str = "3d",
) -> Tensor:
    """:func:`lower_tile_product` by the TMA kernel (host descriptors, ``layout`` "3d" or "flat"); T must
    divide m."""
    if layout not in TMA_LAYOUTS:
        raise ValueError(f"lower_tile_product_tma: layout must be one of {TMA_LAYOUTS}, got {layout!r}")
    bmat, batch, m = checked_operands("lower_tile_product_tma", a, b, scale, tile, block_k)
    if m % tile:
        raise ValueError(
            f"lower_tile_product_tma: the TMA kernel needs the tile to divide m (no edge tiles), got m {m}, T {tile}"
        )
    if out is None:
        out = torch.empty_like(a, memory_format=torch.contiguous_format)
    for name, t in (("A", a), ("B", bmat), ("out", out)):
        if t.shape != a.shape or t.dtype != a.dtype or not _tma_ready(t, layout):
            raise ValueError(
                f"lower_tile_product_tma: {name} does not suit {layout} TMA descriptors (16-byte aligned base and "
                f"strides, contiguous rows{', adjacent matrices' if layout == 'flat' else ''}): "
                f"shape {tuple(t.shape)}, strides {t.stride()}, dtype {t.dtype}"
            )
    rows, cols = (tile, block_k), (block_k, tile)
    b_is_a = b is None or b is a
    _lower_tile_tma_kernel[(tile_count(m, tile), batch)](
        _descriptor(a, rows, layout),
        _descriptor(a, cols, layout),
        None if b_is_a else _descriptor(bmat, rows, layout),
        None if b_is_a else _descriptor(bmat, cols, layout),
        _descriptor(a, (tile, tile), layout) if beta != 0.0 else None,
        _descriptor(out, (tile, tile), layout),
        out if scale is None else scale,
        m,
        float(alpha),
        float(beta),
        float(diag),
        B_IS_A=b_is_a,
        HAS_C=beta != 0.0,
        HAS_DIAG=diag != 0.0,
        HAS_SCALE=scale is not None,
        FLAT=layout == "flat",
        T=tile,
        BLOCK_K=block_k,
        UPCAST=a.device.type == "cpu",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def lower_tile_poly(
    a: Tensor, coefficients: tuple[float, float, float], product: Callable[..., Tensor] | None = None, **options: object
) -> Tensor:
    """P = a·I + b·A + c·A·A on lower tiles (the library's ``poly`` formula, one fp32 epilogue), by ``product``
    (a variant's product function, :func:`lower_tile_product` by default)."""
    ca, cb, cc = coefficients
    return (product or lower_tile_product)(a, None, alpha=cc, beta=cb, diag=ca, **options)


def lower_tile_variants(kernel: str, layouts: list[str]) -> dict[str, Callable[..., Tensor]]:
    """The product functions of the variants that ``--kernel`` (pointers, tma, both) and ``--tma-layout`` name,
    by label: "pointers", "tma-3d", "tma-flat"."""
    variants: dict[str, Callable[..., Tensor]] = {}
    if kernel in ("pointers", "both"):
        variants["pointers"] = lower_tile_product
    if kernel in ("tma", "both", "all"):
        for layout in layouts:
            variants[f"tma-{layout}"] = functools.partial(lower_tile_product_tma, layout=layout)
    if kernel in ("gluon", "all"):
        variants["gluon"] = lower_tile_product_gluon
    return variants


def lower_tile_product_gluon(
    a: Tensor,
    b: Tensor | None = None,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    diag: float = 0.0,
    scale: Tensor | None = None,
    out: Tensor | None = None,
    tile: int = 128,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 5,
) -> Tensor:
    """:func:`lower_tile_product` by the library's Gluon kernel on lower tiles (``ws_syrk_supported`` with
    ``lower_in`` and ``lower_out``; C = A where beta ≠ 0), its ring ``num_stages`` deep; T = 128, BLOCK_K = 64 and 4
    warps are the kernel's. The kernel allocates its output: with ``out`` its lower tiles are copied there (the
    checks' NaN above stays)."""
    from dtensor_muon.kernels import ws_syrk

    if (tile, block_k, num_warps) != (ws_syrk.BLOCK, ws_syrk.BLOCK_K, 4):
        raise ValueError(
            f"lower_tile_product_gluon: the kernel runs T {ws_syrk.BLOCK}, BLOCK_K {ws_syrk.BLOCK_K}, 4 warps, got "
            f"T {tile}, BLOCK_K {block_k}, {num_warps} warps"
        )
    stages, ws_syrk.STAGES = ws_syrk.STAGES, num_stages
    try:
        c = a if beta != 0.0 else None
        result = ws_syrk.ws_syrk_supported(a, b, alpha, beta, c, diag, scale, 1, lower_in=True, lower_out=True)
    finally:
        ws_syrk.STAGES = stages
    if out is None:
        return result
    return out.copy_(torch.where(lower_tile_mask(a.size(-1), tile, a.device), result, out))


def needs_even(variant: str) -> bool:
    """Whether a variant runs only where the tile divides m (the TMA ones and the Gluon one)."""
    return variant.startswith("tma") or variant == "gluon"


def variant_configs(variant: str, configs: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """The configs ``--time`` tries for a variant: the Gluon kernel's own tile, BLOCK_K and warps at each ring
    depth of GLUON_STAGES; the others' from ``configs``."""
    return [(128, 64, 4, stages) for stages in GLUON_STAGES] if variant == "gluon" else configs


def config_options(config: tuple[int, int, int, int]) -> dict[str, int]:
    """Keyword arguments of :func:`lower_tile_product` for a (T, BLOCK_K, num_warps, num_stages) config."""
    tile, block_k, warps, stages = config
    return {"tile": tile, "block_k": block_k, "num_warps": warps, "num_stages": stages}


# ---------------------------------------------------------------------------------------------------- checks


def symmetric_inputs(batch: int, m: int, device: str, seed: int = 0) -> tuple[Tensor, Tensor]:
    """R = X·Xᵀ/‖X‖² (X [m, 2m] Gaussian) and Z = poly(R) (Keller's triple), both bf16 and exactly symmetric."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, m, 2 * m, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=(1, 2), keepdim=True)
    r = x @ x.mT
    a, b, c = KELLER
    z = a * torch.eye(m, dtype=torch.float64) + b * r + c * r @ r
    return r.to(torch.bfloat16).to(device), z.to(torch.bfloat16).to(device)


def row_bound(ref: Tensor, abs_terms: Tensor, m: int) -> Tensor:
    """bf16 output rounding (2⁻⁸ of the row's largest |entry|) plus fp32 accumulation (m·2⁻²⁴·abs_terms)."""
    return 2.0**-8 * ref.abs().amax(dim=-1, keepdim=True) + m * 2.0**-24 * abs_terms


def lower_tile_error(got: Tensor, ref: Tensor, bound: Tensor, tile: int) -> tuple[float, float, bool]:
    """(max |got − ref| over the lower tiles, max of that over the bound, whether the upper tiles are all NaN)."""
    m = got.size(-1)
    mask = lower_tile_mask(m, tile, got.device)
    err = (got.double() - ref).abs()
    lower_err = torch.where(mask, err, torch.zeros_like(err))
    upper = got[..., ~mask]
    upper_nan = bool(upper.isnan().all()) if upper.numel() else True
    if bool(got[..., mask].isnan().any()):
        return float("nan"), float("nan"), upper_nan
    return float(lower_err.max()), float((lower_err / bound).max()), upper_nan


def nan_output(like: Tensor) -> Tensor:
    """An output buffer full of NaN: the kernel must overwrite every lower tile and nothing else."""
    return torch.full_like(like, float("nan"))


def check_case(
    batch: int, m: int, tile: int, block_k: int, device: str, variant: str = "pointers", product: Callable | None = None
) -> list[str]:
    """Product, poly and the two-product chain at one size by one variant (``product``, :func:`lower_tile_product`
    by default); returns the failures (printing a line per test)."""
    product = product or lower_tile_product
    failures: list[str] = []
    opts = {"tile": tile, "block_k": block_k, "num_warps": 4, "num_stages": 2}
    r, z = symmetric_inputs(batch, m, device, seed=m + batch)
    rs, zs = pack_lower(r, tile, float("nan")), pack_lower(z, tile, float("nan"))
    rd, zd = r.double(), z.double()

    def report(name: str, got: Tensor, ref: Tensor, bound: Tensor) -> None:
        err, ratio, upper_nan = lower_tile_error(got, ref, bound, tile)
        ok = ratio <= 1.0 and upper_nan
        print(f"  {variant:8s} B {batch} m {m:4d} T {tile} BK {block_k} {name:22s} max err {err:.3e}  "
              f"err/bound {ratio:.3f}  upper tiles NaN {upper_nan}  {'ok' if ok else 'FAIL'}")  # fmt: skip
        if not ok:
            failures.append(f"{variant} B {batch} m {m} T {tile} BK {block_k} {name}")

    # R·Z
    p1 = product(rs, zs, out=nan_output(rs), **opts)
    ref1 = rd @ zd
    bound1 = row_bound(ref1, rd.abs() @ zd.abs(), m)
    report("R·Z", p1, ref1, bound1)
    # poly(R) = a·I + b·R + c·R·R
    a, b, c = KELLER
    pz = lower_tile_poly(rs, KELLER, product, out=nan_output(rs), **opts)
    refp = a * torch.eye(m, dtype=torch.float64, device=device) + b * rd + c * rd @ rd
    boundp = row_bound(refp, abs(c) * (rd.abs() @ rd.abs()) + abs(b) * rd.abs() + abs(a), m)
    report("poly(R)", pz, refp, boundp)
    # scaled product s·R·Z, s per matrix
    scale = torch.linspace(0.5, 2.0, batch, device=device, dtype=torch.float32)
    ps = product(rs, zs, scale=scale, out=nan_output(rs), **opts)
    sd = scale.double()[:, None, None]
    report("s·R·Z", ps, sd * ref1, sd * bound1)
    # Chain: Z·(R·Z) from the lower-tile R·Z. Step: against Z·(its own R·Z); whole: against float64 throughout,
    # R·Z taken as its lower tiles stand for (mirrored), its error carried through Z.
    p2 = product(zs, p1, out=nan_output(rs), **opts)
    p1_full = unpack_lower(p1.double(), tile)
    ref_step = zd @ p1_full
    report("Z·(R·Z) step", p2, ref_step, row_bound(ref_step, zd.abs() @ p1_full.abs(), m))
    sym1 = unpack_lower(ref1, tile)
    ref2 = zd @ sym1
    bound2 = row_bound(ref2, zd.abs() @ sym1.abs(), m) + zd.abs() @ unpack_lower(bound1, tile)
    report("Z·(R·Z) chain", p2, ref2, bound2)
    return failures


def run_check(device: str, variants: dict[str, Callable[..., Tensor]]) -> bool:
    """Every check case by every variant (the TMA ones where T divides m); True when all pass."""
    cases = [(bsz, m, 64, 32) for bsz in (1, 3) for m in (128, 192, 256)]
    cases += [(3, 256, 64, 64), (3, 160, 64, 32), (1, 192, 128, 64)]  # BLOCK_K = T; edge masks (T ∤ m)
    cases += [(3, 256, 128, 64), (2, 512, 128, 64)]  # the timed tile, T = 128, BLOCK_K = 64, without edges
    failures: list[str] = []
    for variant, product in variants.items():
        for bsz, m, tile, block_k in cases:
            if needs_even(variant) and m % tile:
                print(f"  {variant:8s} B {bsz} m {m:4d} T {tile} BK {block_k} skipped: T does not divide m")
                continue
            if variant == "gluon" and (tile, block_k) != (128, 64):
                print(f"  {variant:8s} B {bsz} m {m:4d} T {tile} BK {block_k} skipped: the kernel's tile is 128, 64")
                continue
            failures += check_case(bsz, m, tile, block_k, device, variant, product)
    print("all checks pass" if not failures else f"FAILED: {failures}")
    return not failures


# ---------------------------------------------------------------------------------------------------- timing


def gpu_errors(got: Tensor, lib: Tensor, ref: Tensor, ref_bound: Tensor, tile: int) -> dict[str, float]:
    """The lower-tile result against the library's (on its elementwise lower triangle, which both compute
    directly; bound: twice the reference's) and against float64 (first matrices, whole lower tiles)."""
    m = got.size(-1)
    lower = torch.ones(m, m, dtype=torch.bool, device=got.device).tril()
    n = ref.size(0)
    diff = (got[:n].double() - lib[:n].double()).abs()
    lib_ratio = float((torch.where(lower, diff, torch.zeros_like(diff)) / (2 * ref_bound)).max())
    whole = (got.float() - lib.float()).abs().masked_fill(~lower, 0.0)
    ref_err, ref_ratio, _ = lower_tile_error(got[:n], ref, ref_bound, tile)
    return {
        "max_err_vs_library": float(whole.max()),
        "err_over_bound_vs_library": lib_ratio,
        "max_err_vs_fp64": ref_err,
        "err_over_bound_vs_fp64": ref_ratio,
    }


def time_stack(
    op: str,
    batch: int,
    m: int,
    configs: list[tuple[int, int, int, int]],
    rounds: int,
    variants: dict[str, Callable[..., Tensor]],
) -> list[dict]:
    """The table's rows for one stack, one per variant: every config of the variant's kernel (the TMA ones only
    where T divides m), and the library and torch.bmm (timed once, in every row)."""
    from dtensor_muon.kernels.triton_matmuls import SYRK_MATMULS
    from dtensor_muon.kernels.ws_syrk import ws_syrk_pays

    r, z = symmetric_inputs(batch, m, "cuda", seed=m + batch)
    checked = min(batch, 4)
    rd, zd = r[:checked].double(), z[:checked].double()
    if op == "product":
        lib_work = lambda: SYRK_MATMULS.symmetric_product(r, z)
        bmm_work = lambda: torch.bmm(r, z)
        ref = rd @ zd
        ref_bound = row_bound(ref, rd.abs() @ zd.abs(), m)
        operands = 2
    else:
        a, b, c = KELLER
        lib_work = lambda: SYRK_MATMULS.poly(r, a, b, c)
        bmm_work = lambda: torch.baddbmm(r, r, r, beta=b, alpha=c)
        ref = a * torch.eye(m, dtype=torch.float64, device="cuda") + b * rd + c * rd @ rd
        ref_bound = row_bound(ref, abs(c) * (rd.abs() @ rd.abs()) + abs(b) * rd.abs() + abs(a), m)
        operands = 1
    lib_us, lib_out = graph_us(lib_work, rounds=rounds)
    lib_out = lib_out.clone()
    bmm_us, _ = graph_us(bmm_work, rounds=rounds)
    library_kernel = "gluon" if (ws_syrk_pays(r, z) if op == "product" else ws_syrk_pays(r, None, r)) else "triton"
    library_bytes = (operands + 1) * batch * m * m * 2
    packed: dict[int, tuple[Tensor, Tensor]] = {}
    rows: list[dict] = []
    for variant, product in variants.items():
        timings: list[dict] = []
        best: tuple[float, dict, Tensor] | None = None
        for config in variant_configs(variant, configs):
            tile = config[0]
            opts = config_options(config)
            if needs_even(variant) and m % tile:
                timings.append({"config": opts, "us": None, "error": "skipped: T does not divide m"})
                continue
            if tile not in packed:
                packed[tile] = (pack_lower(r, tile), pack_lower(z, tile))
            rs, zs = packed[tile]
            if op == "product":
                work = lambda rs=rs, zs=zs, opts=opts, product=product: product(rs, zs, **opts)
            else:
                work = lambda rs=rs, opts=opts, product=product: lower_tile_poly(rs, KELLER, product, **opts)
            try:
                us, out = graph_us(work, rounds=rounds)
            except Exception as error:  # a config past the shared memory, or one that fails to compile
                timings.append({"config": opts, "us": None, "error": f"{type(error).__name__}: {error}"[:200]})
                continue
            timings.append({"config": opts, "us": us})
            if best is None or us < best[0]:
                best = (us, opts, out.clone())
        if best is None:
            print(f"{variant}: no config ran for {op} {batch}x{m}: {[t.get('error') for t in timings]}")
            continue
        us, opts, out = best
        lower_bytes = (operands + 1) * batch * lower_tile_elements(m, opts["tile"]) * 2
        rows.append({
            "op": op,
            "batch": batch,
            "m": m,
            "kernel": variant,
            "lower_us": us,
            "best_config": opts,
            "library_us": lib_us,
            "library_kernel": library_kernel,
            "bmm_us": bmm_us,
            "ratio_to_library": us / lib_us,
            "lower_bytes": lower_bytes,
            "lower_gbps": lower_bytes / (us * 1e-6) / 1e9,
            "library_gbps": library_bytes / (lib_us * 1e-6) / 1e9,
            "tflops": batch * m**3 / (us * 1e-6) / 1e12,
            **gpu_errors(out, lib_out, ref, ref_bound, opts["tile"]),
            "configs": timings,
        })  # fmt: skip
    if not rows:
        raise RuntimeError(f"no config of any variant ran for {op} {batch}x{m}")
    return rows


def print_table(rows: list[dict]) -> None:
    """The markdown table of the best configs, a row per stack and variant."""
    print("| op | stack | kernel | lower-tile µs | library µs (kernel) | bmm µs | lower/library | lower GB/s | "
          "library GB/s | TFLOP/s (m³) | best (T, BK, warps, stages) | err/bound vs lib, fp64 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        c = row["best_config"]
        print(f"| {row['op']} | {row['batch']}×{row['m']} | {row['kernel']} | {row['lower_us']:.1f} | "
              f"{row['library_us']:.1f} ({row['library_kernel']}) | {row['bmm_us']:.1f} | "
              f"{row['ratio_to_library']:.2f} | {row['lower_gbps']:.0f} | {row['library_gbps']:.0f} | "
              f"{row['tflops']:.0f} | {c['tile']}, {c['block_k']}, {c['num_warps']}, {c['num_stages']} | "
              f"{row['err_over_bound_vs_library']:.3f}, {row['err_over_bound_vs_fp64']:.3f} |")  # fmt: skip


def run_time(args: argparse.Namespace, variants: dict[str, Callable[..., Tensor]]) -> None:
    """--time: every stack, op and variant, the table, and the JSON file."""
    name = torch.cuda.get_device_name(0)
    print(f"{name}, triton {triton.__version__}, torch {torch.__version__}, kernels {', '.join(variants)}")
    configs = [c for c in CONFIGS if c[0] in args.tiles and c[1] in args.block_ks]
    rows = []
    for op in args.ops:
        for batch in args.batches:
            for m in args.dims:
                for row in time_stack(op, batch, m, configs, args.rounds, variants):
                    rows.append(row)
                    per_config = ", ".join(
                        f"{t['config']['tile']}/{t['config']['block_k']}/{t['config']['num_warps']}/"
                        f"{t['config']['num_stages']}: " + (f"{t['us']:.1f}" if t["us"] is not None else "failed")
                        for t in row["configs"]
                        if not t.get("error", "").startswith("skipped")
                    )
                    print(f"{op} {batch}×{m} {row['kernel']}: best {row['lower_us']:.1f} µs, library "
                          f"{row['library_us']:.1f} µs, max err vs library {row['max_err_vs_library']:.3e} "
                          f"(err/bound {row['err_over_bound_vs_library']:.3f}), vs fp64 {row['max_err_vs_fp64']:.3e} "
                          f"(err/bound {row['err_over_bound_vs_fp64']:.3f})\n"
                          f"    T/BK/warps/stages µs: {per_config}")  # fmt: skip
                    failed = [t for t in row["configs"] if t["us"] is None and not t["error"].startswith("skipped")]
                    if failed:
                        print(f"    first failure: {failed[0]['error']}")
    print(f"\n{name}\n")
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps({"device": name, "triton": triton.__version__, "rows": rows}, indent=1))


def int_list(text: str) -> list[int]:
    """Comma-separated ints."""
    return [int(s) for s in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="correctness on small sizes (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--time", action="store_true", help="time the kernels on the GPU")
    parser.add_argument("--batches", type=int_list, default=[32, 128], help="stack sizes B")
    parser.add_argument("--dims", type=int_list, default=[512, 768, 1024, 1408], help="matrix sides m")
    parser.add_argument("--ops", type=lambda s: s.split(","), default=["product", "poly"], help="product,poly")
    parser.add_argument("--tiles", type=int_list, default=[64, 128], help="tile sizes T to try")
    parser.add_argument("--block-ks", type=int_list, default=[32, 64], help="BLOCK_K values to try")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--out", type=Path, help="write the timing rows as JSON here")
    parser.add_argument(
        "--kernel",
        choices=("pointers", "tma", "both", "gluon", "all"),
        default="both",
        help="which lower-tile kernels to run (both: pointers and tma; gluon: the library's, GPU only; all)",
    )
    parser.add_argument(
        "--tma-layout", choices=(*TMA_LAYOUTS, "both"), default="both", help="the TMA kernel's descriptors"
    )
    args = parser.parse_args()
    if not (args.check or args.time):
        parser.error("give --check and/or --time")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    variants = lower_tile_variants(args.kernel, list(TMA_LAYOUTS) if args.tma_layout == "both" else [args.tma_layout])
    if interpreted and "gluon" in variants:
        if args.kernel == "gluon":
            parser.error("the Gluon kernel runs on a Hopper GPU only, not under TRITON_INTERPRET=1")
        print("gluon: skipped under the interpreter (Hopper GPU only)")
        del variants["gluon"]
    if args.check:
        if not interpreted and not torch.cuda.is_available():
            parser.error("--check without a GPU needs TRITON_INTERPRET=1")
        if not run_check("cpu" if interpreted else "cuda", variants):
            raise SystemExit(1)
    if args.time:
        if interpreted or not torch.cuda.is_available():
            parser.error("--time needs a CUDA GPU and no TRITON_INTERPRET")
        run_time(args, variants)


if __name__ == "__main__":
    main()
