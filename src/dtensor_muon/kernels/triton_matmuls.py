"""The three Newton–Schulz products with Triton SYRK kernels (CUDA, bf16/fp16, 2-D or batched).

    gram:      A = X·Xᵀ                 (SYRK: lower-triangle tiles only, mirrored)
    gram_poly: B = b·A + c·A·A          (SYRK on the symmetric A, b·A fused into the epilogue)
    combine:   X' = a·X + B·X           (cuBLAS addmm/baddbmm: a full product, nothing to save)

A tall gradient reaches the iteration as X = Gᵀ, a transposed view. ``gram`` reads it in place, and
``combine`` computes X'ᵀ = a·Xᵀ + Xᵀ·B on the contiguous Gᵀ's storage (B is exactly symmetric), so the
iteration never materializes a transpose and hands back a view of the same layout.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_syrk import is_transposed_view, syrk


class TritonMatmuls:
    """SYRK backend: ``gram`` and ``gram_poly`` in Triton, ``combine`` through cuBLAS."""

    name = "triton"

    def gram(self, x: Tensor) -> Tensor:
        """A = X·Xᵀ (per matrix of a batch), exactly symmetric."""
        return syrk(x)

    def gram_poly(self, a: Tensor, b: float, c: float) -> Tensor:
        """B = b·A + c·A·A for a symmetric A, exactly symmetric."""
        return syrk(a, alpha=c, beta=b, c=a)

    def combine(self, x: Tensor, bmat: Tensor, a: float) -> Tensor:
        """X' = a·X + B·X (B symmetric); keeps x's layout when x is a transposed view."""
        if is_transposed_view(x):
            xt = x.mT
            out = (
                torch.addmm(xt, xt, bmat, beta=a)
                if x.ndim == 2
                else torch.baddbmm(xt, xt, bmat, beta=a)
            )
            return out.mT
        if x.ndim == 2:
            return torch.addmm(x, bmat, x, beta=a)
        return torch.baddbmm(x, bmat, x, beta=a)


TRITON_MATMULS = TritonMatmuls()
