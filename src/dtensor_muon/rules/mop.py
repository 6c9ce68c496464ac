"""MOP's rule (momentum orthogonalized by the exact polar factor): Muon's momentum, an fp32 SVD on the owner.

With momentum μ, gradient g, momentum buffer B, learning rate γ and weight decay λ, per matrix:

    B ← B + (1 − μ)·(g − B);   U = g + μ·(B − g) if nesterov, else B
    U = P·diag(S)·Qᵀ            (thin SVD in float32)
    O = P·Qᵀ                    (the polar factor; directions with σ ≤ σ_max·max(m, n)·ε₃₂ dropped, so a
                                 zero or rank-deficient U gives its partial isometry, not arbitrary vectors)
    scale "nuclear": θ ← θ·(1 − γλ) − γ·(ΣS)·O
    scale "shape":   θ ← θ·(1 − γλ) − γ'·O,  γ' = Muon's adjust_lr(γ, matrix shape)

A matrix with an inf or NaN gives a NaN O (the SVD would not converge); ``skip_nonfinite`` skips such steps.
The nuclear scale is Emerging-Optimizers' MOP default (``scale_mode="nuclear_norm"``, the polar factor times
the sum of the singular values, in 0.2.0 to 0.4.0, ``orthogonalized_optimizers/mop.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.optimizer import _to_scalar

from .base import Group, MatrixCost, NewtonSchulzRunner
from .muon import MomentumRule, adjusted_lr

MOP_SCALES = ("nuclear", "shape")


def svd_flops(shape: tuple[int, int]) -> int:
    """FLOPs of a thin SVD with both factors of an m×n matrix (m ≤ n): 4m²n + 22m³ (Golub–Van Loan's R-SVD)."""
    m, n = min(shape), max(shape)
    return 4 * m * m * n + 22 * m**3


def exact_polar(u: Tensor) -> tuple[Tensor, Tensor]:
    """(O, ΣS) of each matrix of ``u`` ([m, n] or [B, m, n]) in float32: O = P·Qᵀ over the significant σ."""
    x = u.to(torch.float32)
    bad = ~torch.isfinite(x).flatten(-2).all(-1)
    x = torch.where(bad[..., None, None], torch.zeros((), dtype=x.dtype, device=x.device), x)
    p, s, qh = torch.linalg.svd(x, full_matrices=False)
    floor = s.amax(-1, keepdim=True) * max(x.shape[-2:]) * torch.finfo(torch.float32).eps
    keep = (s > floor).to(x.dtype)
    o = (p * keep.unsqueeze(-2)) @ qh
    nan = torch.full((), float("nan"), dtype=x.dtype, device=x.device)
    return torch.where(bad[..., None, None], nan, o), torch.where(bad, nan, s.sum(-1))


class MOPRule(MomentumRule):
    """MOP (see the module formula); shard state ``momentum_buffer``, no owner state."""

    name = "mop"

    def cost(self, group: Group, shape: tuple[int, int]) -> MatrixCost:
        return MatrixCost(svd_flops(shape))

    def input_dtype(self, group: Group) -> torch.dtype:
        return torch.float32

    def direction(
        self, u: Tensor, owner_states: list[dict[str, Tensor]], group: Group, runner: NewtonSchulzRunner
    ) -> Tensor:
        o, nuclear = exact_polar(u)
        return o * nuclear[..., None, None] if group["scale"] == "nuclear" else o

    def adjusted_lr(self, group: Group, shape: tuple[int, int]) -> float | Tensor:
        if group["scale"] == "nuclear":
            return _to_scalar(group["lr"])
        return adjusted_lr(group["lr"], group["adjust_lr_fn"], shape)
