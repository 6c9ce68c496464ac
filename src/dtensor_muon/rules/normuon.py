"""NorMuon's rule: Muon's orthogonalized momentum, normalized per row by a second moment kept on the owner.

Per m×n matrix, after Muon's B, U and O = NS(U) (:mod:`.muon`), in float32 (β₂, ε = ``normuon_eps``):

    v ← β₂·v + (1 − β₂)·mean_cols(O²)           (v ∈ ℝᵐ, one entry per row; owner state, starts at 0)
    Ô = O / (√v + ε)                             (each row divided by its own scale)
    Ô ← Ô · ‖O‖_F / ‖Ô‖_F                        (back to O's Frobenius norm; Ô = 0 where O = 0)
    θ ← θ·(1 − γλ) − γ'·Ô,  γ' = Muon's adjust_lr(γ, matrix shape)

This follows NorMuon (arXiv 2510.05491) with the renormalization to ‖O‖_F of its modded-nanogpt form, so
the learning rate keeps Muon's meaning. A matrix whose O is zero (its momentum is still zero: a MoE expert that no
token has reached yet has a zero gradient) gets Ô = 0, not the 0/0 of the ratio, which would turn it into NaN.
Emerging-Optimizers' AdaptiveMuon ``moment2_method="normuon"`` renormalizes to ‖O‖_F too from 0.3.0 on (its PR
#187, ``orthogonalized_optimizers/adaptive_muon.py``; 0.2.0 did not), before Muon's scale; it differs in keeping
one v entry per row only when m ≥ n (per column otherwise) and in Ô = O/√max(v, ε). Ô is returned in O's dtype
(the Newton–Schulz dtype), as Muon's O is.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.shapes import decision_batch
from .base import Group, MatrixCost, NewtonSchulzRunner
from .muon import MuonRule


class NorMuonRule(MuonRule):
    """NorMuon (see the module formula); owner state ``v`` (float32, one entry per row) per matrix."""

    name = "normuon"
    has_owner_state = True

    def init_owner_state(self, shape: tuple[int, int], group: Group, device: torch.device) -> dict[str, Tensor]:
        return {"v": torch.zeros(shape[0], dtype=torch.float32, device=device)}

    def cost(self, group: Group, shape: tuple[int, int]) -> MatrixCost:
        return MatrixCost(super().cost(group, shape).flops + 6 * shape[0] * shape[1], 4 * shape[0])

    def direction(
        self, u: Tensor, owner_states: list[dict[str, Tensor]], group: Group, runner: NewtonSchulzRunner
    ) -> Tensor:
        """Ô of each matrix (module formula). Newton–Schulz takes the whole call; in a stack of units (the
        dispatch deciding as for :func:`~dtensor_muon.kernels.shapes.decision_batch` matrices) the row and matrix
        reductions run unit by unit, on the tensors of a unit alone, since torch's reductions over a batch may
        sum in an order that follows the batch count."""
        o = super().direction(u, owner_states, group, runner)
        per_unit = decision_batch() if o.ndim == 3 else None
        if per_unit is None or per_unit >= o.shape[0]:
            return self._normalized(o, owner_states, group).to(o.dtype)
        out = torch.empty_like(o)
        for k in range(0, o.shape[0], per_unit):
            out[k : k + per_unit].copy_(self._normalized(o[k : k + per_unit], owner_states[k : k + per_unit], group))
        return out

    def _normalized(self, o: Tensor, owner_states: list[dict[str, Tensor]], group: Group) -> Tensor:
        """Ô in float32 for O (one matrix or a batch), v advanced in ``owner_states`` (module formula)."""
        o32 = o.to(torch.float32)
        beta2, eps = group["beta2"], group["normuon_eps"]
        v = owner_states[0]["v"] if o.ndim == 2 else torch.stack([s["v"] for s in owner_states])
        v = v * beta2 + (1 - beta2) * o32.square().mean(-1)
        normalized = o32 / (v.sqrt() + eps).unsqueeze(-1)
        o_norm = torch.linalg.vector_norm(o32, dim=(-2, -1))
        normalized_norm = torch.linalg.vector_norm(normalized, dim=(-2, -1))
        ratio = torch.where(normalized_norm > 0, o_norm / normalized_norm, 0.0)  # O = 0 (module docstring)
        normalized = normalized * ratio[..., None, None]
        for i, s in enumerate(owner_states):
            s["v"].copy_(v if o.ndim == 2 else v[i])
        return normalized
