"""Shape helpers shared by the Newton–Schulz backends (no Triton needed)."""

from __future__ import annotations

from torch import Tensor


def matrix_count(x: Tensor) -> int:
    """Matrices in ``x``: B for a batch [B, m, n], 1 for a matrix [m, n]."""
    return x.size(0) if x.ndim == 3 else 1


def gram_work(x: Tensor) -> int:
    """B·m²·n multiply-adds of one Gram matrix of ``x`` ([m, n] or [B, m, n])."""
    return matrix_count(x) * x.size(-2) ** 2 * x.size(-1)
