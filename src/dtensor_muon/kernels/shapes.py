"""Shape helpers shared by the Newton–Schulz backends (no Triton needed)."""

from __future__ import annotations

from torch import Tensor


def matrix_count(x: Tensor) -> int:
    """Matrices in ``x``: B for a batch [B, m, n], 1 for a matrix [m, n]."""
    return x.size(0) if x.ndim == 3 else 1
