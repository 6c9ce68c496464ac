"""Triton symmetric rank-k kernel (SYRK) with a fused epilogue, for 2-D and batched matrices.

    out = alpha·X·Xᵀ + beta·C          X: [m, k] or [B, m, k] (bf16/fp16, any strides), C: [.., m, m] symmetric

Accumulation is in fp32. Only the tiles of the lower triangle are computed (tile row I ≥ tile column J);
each one is stored twice, as itself and transposed into the upper triangle, so the result is exactly
symmetric and costs m²k instead of 2m²k FLOPs. Newton–Schulz uses it twice per iteration:
``A = X·Xᵀ`` (alpha = 1, no C) and ``B = b·A + c·A·A`` (A symmetric, so A·A = A·Aᵀ: X = C = A).

Tiles are read either through pointers (any strides, any size; masks at the edges) or, on Hopper and
newer when the strides allow it, through tensor-memory descriptors (TMA). A matrix whose rows are not
contiguous but whose columns are (a transposed view of a contiguous tall matrix) is read in its own
layout: the kernel loads Xᵀ tiles and transposes them in registers/shared memory, never in global memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def _configs() -> list[triton.Config]:
    """Square tiles (the triangle mapping needs BLOCK_M = BLOCK_N); a few Hopper-friendly shapes."""
    shapes = [(128, 64, 8, 4), (128, 64, 4, 4), (128, 128, 8, 3), (64, 64, 4, 4)]
    return [
        triton.Config({"BLOCK": bm, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bk, w, s in shapes
    ]


@triton.jit
def _syrk_kernel(
    x_ptr,
    c_ptr,
    out_ptr,
    M,
    K,
    BATCH,  # only an autotuning key: the batch index is program_id(1)
    stride_xb,
    stride_xm,
    stride_xk,
    stride_cb,
    stride_cm,
    stride_ob,
    stride_om,
    alpha,
    beta,
    TRANSPOSED: tl.constexpr,
    USE_TMA: tl.constexpr,
    HAS_C: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Tile t of the lower triangle, row-major: tile row I holds tiles t = I(I+1)/2 .. I(I+1)/2 + I.
    t = tl.program_id(0)
    batch = tl.program_id(1)
    ti = ((tl.sqrt((8 * t + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    ti = tl.where((ti + 1) * (ti + 2) // 2 <= t, ti + 1, ti)
    ti = tl.where(ti * (ti + 1) // 2 > t, ti - 1, ti)
    tj = t - ti * (ti + 1) // 2
    row0 = ti * BLOCK
    col0 = tj * BLOCK

    x_base = x_ptr + batch.to(tl.int64) * stride_xb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    if USE_TMA:
        if TRANSPOSED:
            # Xᵀ is a contiguous [K, M] matrix: load [BLOCK_K, BLOCK] tiles of it.
            desc = tl.make_tensor_descriptor(
                x_base,
                shape=[K, M],
                strides=[stride_xk, 1],
                block_shape=[BLOCK_K, BLOCK],
            )
            for k0 in range(0, K, BLOCK_K):
                a_t = desc.load([k0, row0])
                b_t = desc.load([k0, col0])
                acc = tl.dot(tl.trans(a_t), b_t, acc)
        else:
            desc = tl.make_tensor_descriptor(
                x_base,
                shape=[M, K],
                strides=[stride_xm, 1],
                block_shape=[BLOCK, BLOCK_K],
            )
            for k0 in range(0, K, BLOCK_K):
                a = desc.load([row0, k0])
                b = desc.load([col0, k0])
                acc = tl.dot(a, tl.trans(b), acc)
    else:
        rows_a = row0 + tl.arange(0, BLOCK)
        rows_b = col0 + tl.arange(0, BLOCK)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_base + rows_a[:, None] * stride_xm + ks[None, :] * stride_xk
        b_ptrs = x_base + rows_b[:, None] * stride_xm + ks[None, :] * stride_xk
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks)[None, :] < K
            a = tl.load(a_ptrs, mask=(rows_a[:, None] < M) & k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=(rows_b[:, None] < M) & k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K * stride_xk
            b_ptrs += BLOCK_K * stride_xk

    rows = row0 + tl.arange(0, BLOCK)[:, None]
    cols = col0 + tl.arange(0, BLOCK)[None, :]
    in_bounds = (rows < M) & (cols < M)
    result = acc * alpha
    if HAS_C:
        c_tile = tl.load(
            c_ptr + batch.to(tl.int64) * stride_cb + rows * stride_cm + cols,
            mask=in_bounds,
            other=0.0,
        )
        result += beta * c_tile.to(tl.float32)
    result = result.to(out_ptr.dtype.element_ty)
    out_base = out_ptr + batch.to(tl.int64) * stride_ob
    # The tile itself (on a diagonal tile only its lower half) and its mirror image (strict upper half).
    tl.store(
        out_base + rows * stride_om + cols, result, mask=in_bounds & (rows >= cols)
    )
    mirror_rows = col0 + tl.arange(0, BLOCK)[:, None]
    mirror_cols = row0 + tl.arange(0, BLOCK)[None, :]
    tl.store(
        out_base + mirror_rows * stride_om + mirror_cols,
        tl.trans(result),
        mask=(mirror_rows < M) & (mirror_cols < M) & (mirror_rows < mirror_cols),
    )


_syrk_tuned = triton.autotune(
    configs=_configs(), key=["M", "K", "BATCH", "TRANSPOSED", "USE_TMA", "HAS_C"]
)(_syrk_kernel)

# Under the Triton interpreter (CPU tensors) there is nothing to tune: one small tile.
_INTERPRETER_CONFIG = {"BLOCK": 32, "BLOCK_K": 32}


def _tma_allocator(size: int, alignment: int, stream: int | None) -> Tensor:
    """Global scratch for device-side tensor descriptors (Triton asks for it per launch)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def _can_use_tma(x: Tensor, transposed: bool) -> bool:
    """TMA needs a 16-byte aligned base and 16-byte aligned strides (elements are 2 bytes)."""
    strides = [x.stride(-1) if transposed else x.stride(-2)]
    if x.ndim == 3:
        strides.append(x.stride(0))
    return x.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides)


def is_transposed_view(x: Tensor) -> bool:
    """Columns contiguous (stride 1 along m) and rows not: x is Gᵀ for a row-major tall G."""
    return x.stride(-2) == 1 and x.stride(-1) != 1


def syrk(
    x: Tensor,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Tensor | None = None,
    tma: bool | None = None,
) -> Tensor:
    """``alpha·X·Xᵀ + beta·C`` for X [m, k] or [B, m, k]; C (optional) symmetric [.., m, m], contiguous rows.

    Returns a new contiguous, exactly symmetric [.., m, m] tensor in x's dtype (fp32 accumulation).
    ``tma``: read tiles through tensor descriptors; None picks them on CUDA devices of compute capability
    9.0+ when the strides are 16-byte aligned (True uses them wherever the strides allow, e.g. under the Triton interpreter).
    """
    if x.ndim not in (2, 3):
        raise ValueError(
            f"syrk expects a 2-D or 3-D tensor, got shape {tuple(x.shape)}"
        )
    x3 = x if x.ndim == 3 else x.unsqueeze(0)
    batch, m, k = x3.shape
    if x3.stride(-1) != 1 and x3.stride(-2) != 1:
        x3 = x3.contiguous()
    transposed = is_transposed_view(x3)
    out = torch.empty((batch, m, m), device=x.device, dtype=x.dtype)
    if c is not None:
        c3 = c if c.ndim == 3 else c.unsqueeze(0)
        if c3.shape != out.shape or c3.stride(-1) != 1:
            raise ValueError(
                f"syrk: C must be [.., {m}, {m}] with contiguous rows, got {tuple(c.shape)}"
            )
    else:
        c3 = out
    on_hopper = (
        x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 9
    )
    use_tma = (on_hopper if tma is None else tma) and _can_use_tma(x3, transposed)
    if use_tma and x.device.type == "cuda":
        triton.set_allocator(_tma_allocator)

    def grid(meta: dict) -> tuple[int, int]:
        tiles = triton.cdiv(m, meta["BLOCK"])
        return (tiles * (tiles + 1) // 2, batch)

    on_cpu = x.device.type == "cpu"
    kernel = _syrk_kernel if on_cpu else _syrk_tuned
    kernel[grid](
        x3,
        c3,
        out,
        m,
        k,
        batch,
        x3.stride(0),
        x3.stride(1),
        x3.stride(2),
        c3.stride(0),
        c3.stride(1),
        out.stride(0),
        out.stride(1),
        float(alpha),
        float(beta),
        TRANSPOSED=transposed,
        USE_TMA=use_tma,
        HAS_C=c is not None,
        **(_INTERPRETER_CONFIG if on_cpu else {}),
    )
    return out if x.ndim == 3 else out.squeeze(0)
