"""Newton–Schulz's first step on the GPU, in either of two forms, each on G̃ = round(G), G rounded to the working
dtype (bf16 by default):

    normalize_into:       s_b = 1 / max(‖G̃_b‖_F, eps),  X₀_b = round(s_b · G̃_b)
    cast_and_scale_into:  X̃_b = G̃_b,  s_b = 1 / max(‖G̃_b‖_F, eps),  X₀_b = s_b · X̃_b

Both read G̃, never G's own bits: X₀ for an fp32 G equals X₀ for the same G sent in the working dtype, as the
optimizer's wire sends it to a matrix's owner (the wire is never narrower than the working dtype). That is what
makes a matrix that travelled and one that did not, or a distributed step and one process, give the same bits;
torch's start (:meth:`..torch_matmuls.TorchMatmuls.normalize_into`) also starts from the cast.

``normalize_into`` takes two Triton kernels: an fp32 sum-of-squares pass over G̃ that ends in s, then one that
reads G again and writes X₀, rounding s·G̃ once (instead of torch's cast, norm of the cast and in-place division
by a broadcast device scalar, whose non-vectorized division dominates: docs/kernels.md). X₀ differs from torch's
by at most one rounding of the working dtype per entry (torch rounds the norm to the working dtype as well).

``cast_and_scale_into`` reads G once, in one kernel that writes X̃ = G̃ and ends in s. The caller folds s into
the first products (A₀ = s²·X̃·X̃ᵀ, P₀·X₀ = (s·P₀)·X̃), so X₀ is never written: one read of G instead of two.
``scale_of`` is the same for a G already in the working dtype: X̃ is G itself, and only s is written.

How a kernel ends in s without a second launch: each program stores its block's fp32 sum of squares, and the
last program of a matrix to finish adds them in a fixed order (deterministic) and writes s
(:func:`.ordered_sum.store_partial_and_total`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .counters import ticket_counters
from .ordered_sum import store_partial_and_total
from .shapes import matrix_count

BLOCK = 4096
CHUNK = 1024


@triton.jit
def _scale_cast_kernel(g_ptr, scale_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """out[b, i] = round(round(g[b, i]) · scale[b]) for the N entries of each matrix b = program_id(1), g rounded to
    out's dtype first."""
    matrix = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    values = tl.load(g_ptr + matrix * N + offsets, mask=inside, other=0.0)
    scale = tl.load(scale_ptr + matrix)
    scaled = values.to(out_ptr.dtype.element_ty).to(tl.float32) * scale
    tl.store(out_ptr + matrix * N + offsets, scaled.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _sum_squares_scale_kernel(
    g_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    scale_ptr,
    N,
    eps,
    WRITE_CAST: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """partial[b, block] = Σ round(g[b, i])² (fp32) over the block's entries, g rounded to out's dtype, and
    out[b, i] = round(g[b, i]) when WRITE_CAST; the last program of matrix b to finish writes
    scale[b] = 1 / max(√Σ_j partial[b, j], eps), summed chunk by chunk in a fixed order, and zeroes counter[b]
    (module docstring)."""
    matrix = tl.program_id(1).to(tl.int64)
    block = tl.program_id(0)
    blocks = tl.num_programs(0)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    rounded = tl.load(g_ptr + matrix * N + offsets, mask=inside, other=0.0).to(out_ptr.dtype.element_ty)
    if WRITE_CAST:
        tl.store(out_ptr + matrix * N + offsets, rounded, mask=inside)
    values = rounded.to(tl.float32)
    last, total = store_partial_and_total(
        partial_ptr, counter_ptr, matrix, block, blocks, tl.sum(values * values, axis=0), CHUNK
    )
    if last:
        tl.store(scale_ptr + matrix, 1.0 / tl.maximum(tl.sqrt(total), eps))


def _sum_squares_into(g: Tensor, scale: Tensor, eps: float, out: Tensor, write_cast: bool) -> None:
    """scale[b] = 1 / max(‖round(G_b)‖_F, eps) per matrix of ``g`` in one launch, G rounded to ``out``'s dtype, and
    round(G) into ``out`` when ``write_cast``."""
    matrices = matrix_count(g)
    per_matrix = g.size(-2) * g.size(-1)
    blocks = triton.cdiv(per_matrix, BLOCK)
    partials = torch.empty(matrices, blocks, device=g.device, dtype=torch.float32)
    _sum_squares_scale_kernel[(blocks, matrices)](
        g,
        out,
        partials,
        ticket_counters(g.device, matrices),
        scale,
        per_matrix,
        float(eps),
        WRITE_CAST=write_cast,
        BLOCK=BLOCK,
        CHUNK=CHUNK,
        num_warps=4,
    )


def require_scale(scale: Tensor, matrices: int, device: torch.device, caller: str) -> None:
    """Raises ValueError, naming ``caller``, unless ``scale`` is a contiguous float32 tensor of ``matrices``
    entries on ``device``: the per-matrix scale the kernels read."""
    if scale.dtype != torch.float32 or scale.numel() != matrices or not scale.is_contiguous() or scale.device != device:
        raise ValueError(
            f"{caller}: scale must be a contiguous float32 tensor of {matrices} entries on {device}, got "
            f"{tuple(scale.shape)} {scale.dtype} on {scale.device}"
        )


def scale_cast_applies(g: Tensor, out: Tensor) -> bool:
    """Whether :func:`normalize_into` and :func:`cast_and_scale_into` apply: both contiguous, same shape, not
    empty, and each matrix under 2³¹ entries (the kernels' offsets within a matrix are 32-bit)."""
    per_matrix = g.size(-2) * g.size(-1) if g.ndim >= 2 else 0
    return g.is_contiguous() and out.is_contiguous() and g.shape == out.shape and 0 < per_matrix < 2**31


def _require_kernel_layout(g: Tensor, out: Tensor, caller: str) -> None:
    """Raises ValueError, naming ``caller``, unless :func:`scale_cast_applies` to ``g`` and ``out``."""
    if not scale_cast_applies(g, out):
        raise ValueError(
            f"{caller}: G and out must be contiguous, of one shape, with 1 to 2³¹ - 1 entries per matrix, "
            f"got {tuple(g.shape)} and {tuple(out.shape)}"
        )


def normalize_into(g: Tensor, out: Tensor, eps: float) -> None:
    """out = round(G̃ / max(‖G̃‖_F, eps)) per matrix of ``g`` ([m, n] or [B, m, n]), G̃ = G rounded to out's
    dtype.

    ``g`` and ``out`` must be contiguous and of one shape (:func:`scale_cast_applies`)."""
    _require_kernel_layout(g, out, "normalize_into")
    scale = torch.empty(matrix_count(g), device=g.device, dtype=torch.float32)
    _sum_squares_into(g, scale, eps, out, write_cast=False)
    per_matrix = g.size(-2) * g.size(-1)
    grid = (triton.cdiv(per_matrix, BLOCK), scale.numel())
    _scale_cast_kernel[grid](g, scale, out, per_matrix, BLOCK=BLOCK, num_warps=4)


def cast_and_scale_into(g: Tensor, out: Tensor, eps: float, scale: Tensor | None = None) -> Tensor:
    """out = round(G) in out's dtype and scale[b] = 1 / max(‖round(G_b)‖_F, eps) per matrix of ``g`` ([m, n] or
    [B, m, n]), so that X₀ = scale·out; G is read once. Returns the scale: ``scale`` (fp32, one entry per
    matrix) written in place when given, else a new tensor.

    ``g`` and ``out`` must be contiguous and of one shape (:func:`scale_cast_applies`)."""
    _require_kernel_layout(g, out, "cast_and_scale_into")
    matrices = matrix_count(g)
    if scale is None:
        scale = torch.empty(matrices, device=g.device, dtype=torch.float32)
    else:
        require_scale(scale, matrices, g.device, "cast_and_scale_into")
    _sum_squares_into(g, scale, eps, out, write_cast=True)
    return scale


def scale_of(g: Tensor, eps: float, scale: Tensor | None = None) -> Tensor:
    """scale[b] = 1 / max(‖G_b‖_F, eps) per matrix of ``g`` ([m, n] or [B, m, n], already in the working dtype):
    :func:`cast_and_scale_into` where round(G) is G itself, so nothing is written but the scale (X₀ = scale·G).
    Returns ``scale`` (fp32, one entry per matrix) written in place when given, else a new tensor.

    ``g`` must be contiguous (:func:`scale_cast_applies`)."""
    _require_kernel_layout(g, g, "scale_of")
    if scale is None:
        scale = torch.empty(matrix_count(g), device=g.device, dtype=torch.float32)
    else:
        require_scale(scale, matrix_count(g), g.device, "scale_of")
    _sum_squares_into(g, scale, eps, g, write_cast=False)
    return scale
