"""Muon's math in three parts: ``prepare`` (on the shard), ``direction`` (on the owner), ``apply`` (on the shard).

With momentum μ, gradient g, momentum buffer B, learning rate γ and weight decay λ:

    B ← B + (1 − μ)·(g − B)                    (``B.lerp_(g, 1 − μ)``)
    U = g + μ·(B − g)  if nesterov, else B       (``g.lerp(B, μ)``)
    O = NS(U)                                    (Newton–Schulz polar-factor approximation)
    θ ← θ·(1 − γλ) − γ'·O,   γ' = adjust_lr(γ, matrix shape)

These are exactly torch.optim.Muon's operations, so one device gives the same bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim.optimizer import _to_scalar

from ..newton_schulz import CoefficientSpec, newton_schulz

NewtonSchulz = Callable[..., Tensor]

AdjustLrFn = None | str | Callable[[float, tuple[int, int]], float]
ADJUST_LR_NAMES = ("original", "match_rms_adamw")


def prepare(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """Update the momentum buffer in place and return the matrix to orthogonalize (see module formula)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    return grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer


def direction(
    update: Tensor,
    coefficients: CoefficientSpec,
    steps: int,
    eps: float,
    dtype: torch.dtype,
    algorithm: str = "auto",
    runner: NewtonSchulz = newton_schulz,
) -> Tensor:
    """O = NS(U) for one matrix [m, n] or a batch [B, m, n] (``algorithm``: see :func:`newton_schulz`), run by
    ``runner``: :func:`newton_schulz` or a :class:`..ns_graphs.NewtonSchulzGraphs` (the same bits)."""
    return runner(update, coefficients, steps, eps, dtype, algorithm)


def adjusted_lr(lr: float, adjust_lr_fn: AdjustLrFn, matrix_shape: tuple[int, int]) -> float:
    """γ' for a matrix of shape (A, B): "original" √max(1, A/B), "match_rms_adamw" 0.2·√max(A, B), or a callable."""
    rows, cols = matrix_shape
    lr = _to_scalar(lr)  # a Tensor lr of shape [1] or [1, 1] as a 0-d tensor, as torch.optim.Muon does
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    if callable(adjust_lr_fn):
        return float(adjust_lr_fn(lr, (rows, cols)))
    raise ValueError(f"adjust_lr_fn: expected None, {ADJUST_LR_NAMES} or a callable, got {adjust_lr_fn!r}")


def apply(param: Tensor, orthogonal_update: Tensor, lr: float, weight_decay: float, lr_adjusted: float) -> None:
    """θ ← θ·(1 − γλ) − γ'·O, in place on ``param`` (a whole matrix or a shard of it)."""
    lr, lr_adjusted = _to_scalar(lr), _to_scalar(lr_adjusted)
    param.mul_(1 - lr * weight_decay)
    param.add_(orthogonal_update, alpha=-lr_adjusted)
