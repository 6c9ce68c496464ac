"""Chooses the Newton–Schulz product backend for a given input (shape, dtype, device)."""

from __future__ import annotations

from torch import Tensor

from .torch_matmuls import TORCH_MATMULS, TorchMatmuls


def select_backend(x: Tensor) -> TorchMatmuls:
    """Backend for the (already transposed to wide) working matrix ``x`` of shape [m, n] or [B, m, n]."""
    return TORCH_MATMULS
