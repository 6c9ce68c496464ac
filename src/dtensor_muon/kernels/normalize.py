"""Newton–Schulz's first step on the GPU, in either of two forms:

    normalize_into:       s_b = 1 / max(‖G_b‖_F, eps),  X₀_b = round(s_b · G_b)
    cast_and_scale_into:  X̃_b = round(G_b),  s_b = 1 / max(‖G_b‖_F, eps),  X₀_b = s_b · X̃_b

``normalize_into`` takes an fp32 norm pass over G, then one Triton kernel that reads G again and writes
X₀ rounded once (instead of torch's cast, norm of the cast and in-place division by a broadcast device
scalar: 0.92 ms of prologue on 64×2048×1408 on the H200, of which 0.57 the non-vectorized division). X₀
differs from torch's by at most one rounding of the working dtype per entry (torch rounds G, then the
quotient).

``cast_and_scale_into`` reads G once: one kernel writes X̃ = round(G) and each block's fp32 sum of
squares of G, a second (one program per matrix) sums a matrix's blocks in a fixed order (deterministic)
into s. The caller folds s into the first products (A₀ = s²·X̃·X̃ᵀ, P₀·X₀ = (s·P₀)·X̃), so X₀ is never
written: one read of G instead of two. Each entry of X̃ is G's rounded once; X₀ = s·X̃ is within one
rounding of G / ‖G‖ as above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .shapes import matrix_count

BLOCK = 4096


@triton.jit
def _scale_cast_kernel(g_ptr, scale_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """out[b, i] = g[b, i] · scale[b] for the N entries of each matrix b = program_id(1)."""
    matrix = tl.program_id(1).to(tl.int64)
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    values = tl.load(g_ptr + matrix * N + offsets, mask=inside, other=0.0)
    scale = tl.load(scale_ptr + matrix)
    scaled = values.to(tl.float32) * scale
    tl.store(out_ptr + matrix * N + offsets, scaled.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _cast_sum_squares_kernel(g_ptr, out_ptr, partial_ptr, N, BLOCK: tl.constexpr):
    """out[b, i] = round(g[b, i]); partial[b, block] = Σ g[b, i]² (fp32) over the block's entries."""
    matrix = tl.program_id(1).to(tl.int64)
    block = tl.program_id(0)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < N
    values = tl.load(g_ptr + matrix * N + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + matrix * N + offsets, values.to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(partial_ptr + matrix * tl.num_programs(0) + block, tl.sum(values * values, axis=0))


@triton.jit
def _scale_from_partials_kernel(partial_ptr, scale_ptr, NUM_PARTIALS, eps, CHUNK: tl.constexpr):
    """scale[b] = 1 / max(sqrt(Σ_j partial[b, j]), eps), summed chunk by chunk in a fixed order."""
    matrix = tl.program_id(0).to(tl.int64)
    total = tl.zeros((CHUNK,), dtype=tl.float32)
    for start in range(0, NUM_PARTIALS, CHUNK):
        index = start + tl.arange(0, CHUNK)
        total += tl.load(partial_ptr + matrix * NUM_PARTIALS + index, mask=index < NUM_PARTIALS, other=0.0)
    norm = tl.sqrt(tl.sum(total, axis=0))
    tl.store(scale_ptr + matrix, 1.0 / tl.maximum(norm, eps))


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
    """out = G / max(‖G‖_F, eps) per matrix of ``g`` ([m, n] or [B, m, n]), rounded once to out's dtype.

    ``g`` and ``out`` must be contiguous and of one shape (:func:`scale_cast_applies`)."""
    _require_kernel_layout(g, out, "normalize_into")
    norms = torch.linalg.vector_norm(g, dim=(-2, -1), dtype=torch.float32)
    scale = norms.clamp(min=eps).reciprocal().reshape(-1)
    per_matrix = g.size(-2) * g.size(-1)
    grid = (triton.cdiv(per_matrix, BLOCK), scale.numel())
    _scale_cast_kernel[grid](g, scale, out, per_matrix, BLOCK=BLOCK, num_warps=4)


def cast_and_scale_into(g: Tensor, out: Tensor, eps: float, scale: Tensor | None = None) -> Tensor:
    """out = round(G) in out's dtype and scale[b] = 1 / max(‖G_b‖_F, eps) per matrix of ``g`` ([m, n] or
    [B, m, n]), so that X₀ = scale·out; G is read once. Returns the scale: ``scale`` (fp32, one entry per
    matrix) written in place when given, else a new tensor.

    ``g`` and ``out`` must be contiguous and of one shape (:func:`scale_cast_applies`)."""
    _require_kernel_layout(g, out, "cast_and_scale_into")
    matrices = matrix_count(g)
    if scale is None:
        scale = torch.empty(matrices, device=g.device, dtype=torch.float32)
    else:
        require_scale(scale, matrices, g.device, "cast_and_scale_into")
    per_matrix = g.size(-2) * g.size(-1)
    blocks = triton.cdiv(per_matrix, BLOCK)
    partials = torch.empty(matrices, blocks, device=g.device, dtype=torch.float32)
    _cast_sum_squares_kernel[(blocks, matrices)](g, out, partials, per_matrix, BLOCK=BLOCK, num_warps=4)
    _scale_from_partials_kernel[(matrices,)](partials, scale, blocks, float(eps), CHUNK=1024, num_warps=4)
    return scale
