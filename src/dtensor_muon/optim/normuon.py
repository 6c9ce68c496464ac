"""``dtensor_muon.NorMuon``: Muon with a per-row second moment of the orthogonalized update, kept on the owner."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..linalg.newton_schulz import KELLER_COEFFICIENTS, CoefficientSpec
from ..plan.views import MatrixSplit
from ..rules.momentum_storage import check_momentum_dtype
from ..rules.muon import AdjustLrFn
from ..rules.normuon import NorMuonRule
from ..rules.qk_clip import AttentionHeads
from .base import MatrixOptimizer, given_keywords, require, require_number
from .muon import validate_newton_schulz


class NorMuon(MatrixOptimizer):
    """NorMuon for matrices, AdamW for the rest; exact on DTensor (FSDP2) parameters.

    Defaults that train, as :class:`dtensor_muon.Muon`'s: ``NorMuon(model.named_parameters())`` uses lr 0.02
    with the "original" per-matrix scale (the normalized update keeps Muon's size, so Muon's lr carries over);
    the values come from small CPU models (docs/optimizers.md, "Recommended settings").

    Per matrix (see :mod:`dtensor_muon.rules.normuon`): Muon's O = NS(U); v ← β₂·v + (1 − β₂)·mean_cols(O²)
    (kept on the matrix's owner); Ô = O / (√v + ε), rescaled to ‖O‖_F; θ ← θ·(1 − γλ) − γ'·Ô.

    Args: those of :class:`dtensor_muon.Muon` (same defaults), and
        beta2: β₂ in [0, 1), the second moment's decay (0.95, as NorMuon's paper and Emerging-Optimizers).
        normuon_eps: ε > 0 added to √v (1e-8).
    """

    rule = NorMuonRule()

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: AdjustLrFn = None,
        beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
        momentum_dtype: str = "float32",
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_algorithm: str = "auto",
        wire_dtype: torch.dtype | None = torch.bfloat16,
        bucket_size_mb: float = 64.0,
        exchange: str = "owner",
        skip_nonfinite: bool = False,
        diagnostics_interval: int = 0,
        overlap: bool = False,
        offload: str = "none",
        ns_cuda_graphs: bool = True,
        matrix_splits: dict[str, MatrixSplit] | None = None,
        tp_mode: str = "owned",
        qk_clip_tau: float = 0.0,
        qk_clip_alpha: float = 0.5,
        qk_clip_heads: dict[str, AttentionHeads] | None = None,
    ) -> None:
        super().__init__(params, given_keywords(locals()))

    def validate_group(self, group: dict[str, Any]) -> None:
        validate_newton_schulz(group)
        check_momentum_dtype(group["momentum_dtype"])
        require_number(group, "beta2", "normuon_eps")
        require(0 <= group["beta2"] < 1, f"beta2: expected a number in [0, 1), got {group['beta2']}")
        require(group["normuon_eps"] > 0, f"normuon_eps: expected a number > 0, got {group['normuon_eps']}")
