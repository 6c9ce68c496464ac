"""``dtensor_muon.MOP``: momentum orthogonalized by the exact polar factor (an fp32 SVD on each matrix's owner)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..plan.views import MatrixSplit
from ..rules.momentum_storage import check_momentum_dtype
from ..rules.mop import MOP_SCALES, MOPRule
from ..rules.muon import AdjustLrFn
from ..rules.qk_clip import AttentionHeads
from .base import MatrixOptimizer, given_keywords, require
from .muon import validate_adjust_lr_fn


class MOP(MatrixOptimizer):
    """MOP for matrices, AdamW for the rest; exact on DTensor (FSDP2) parameters.

    Defaults that train: ``MOP(model.named_parameters())`` steps by Muon's shape-scaled lr (``scale="shape"``,
    lr 0.02, as :class:`dtensor_muon.Muon`), since the nuclear scale of Emerging-Optimizers' MOP (lr 3e-4)
    made a small MLP's and a tiny language model's loss fall far slower than AdamW's at its defaults, and its
    step follows the gradient's size (docs/optimizers.md, "Recommended settings": small CPU models; a GPU study
    at scale may revise them). ``scale="nuclear", lr=3e-4`` gives Emerging-Optimizers' MOP; torchtitan's
    ``[mop]`` section keeps ``scale = "nuclear"``.

    Per matrix (see :mod:`dtensor_muon.rules.mop`): B ← B + (1 − μ)(g − B); U = g + μ(B − g) if nesterov
    else B; U = P·diag(S)·Qᵀ (float32 SVD); O = P·Qᵀ; θ ← θ·(1 − γλ) − γ·(ΣS)·O (``scale="nuclear"``) or
    θ ← θ·(1 − γλ) − γ'·O with Muon's shape-scaled γ' (``scale="shape"``).

    The other defaults follow Emerging-Optimizers' MOP (momentum 0.95, weight_decay 0.01, no Nesterov); its
    lr is 3e-4 and its scale the nuclear norm (``scale_mode="nuclear_norm"`` in 0.2.0 to 0.4.0,
    ``orthogonalized_optimizers/mop.py``).

    Args:
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or param groups.
        lr: learning rate γ (AdamW's too unless ``adamw_lr`` is given).
        weight_decay: decoupled weight decay λ.
        momentum: μ in [0, 1).
        nesterov: use g + μ·(B − g) instead of B.
        scale: "shape" (Muon's γ', see ``adjust_lr_fn``; the default) or "nuclear" (ΣS).
    Keyword-only:
        adjust_lr_fn: with ``scale="shape"``: None/"original", "match_rms_adamw", "spectral_unclamped" or a
            callable, as in Muon.
        adamw_betas, adamw_eps, adamw_lr, adamw_weight_decay: AdamW for element-wise parameters.
        momentum_dtype: storage of the momentum buffer, "float32", "bfloat16" or "int8", as in Muon.
        wire_dtype: dtype of the exchange; float32 by default, since the SVD runs in float32 (a 16-bit wire
            is refused for DTensor parameters: it would round the SVD's input).
        bucket_size_mb, exchange, skip_nonfinite, diagnostics_interval, overlap, offload, matrix_splits, tp_mode,
        qk_clip_tau, qk_clip_alpha, qk_clip_heads: as in
            :class:`dtensor_muon.Muon` (tp_mode "owned", "duplicated" or "blockwise": the distributed forms are
            Newton–Schulz's).
    """

    rule = MOPRule()

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = False,
        scale: str = "shape",
        *,
        adjust_lr_fn: AdjustLrFn = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
        momentum_dtype: str = "float32",
        wire_dtype: torch.dtype | None = torch.float32,
        bucket_size_mb: float = 64.0,
        exchange: str = "owner",
        skip_nonfinite: bool = False,
        diagnostics_interval: int = 0,
        overlap: bool = False,
        offload: str = "none",
        matrix_splits: dict[str, MatrixSplit] | None = None,
        tp_mode: str = "owned",
        qk_clip_tau: float = 0.0,
        qk_clip_alpha: float = 0.5,
        qk_clip_heads: dict[str, AttentionHeads] | None = None,
    ) -> None:
        super().__init__(params, given_keywords(locals()))

    def validate_group(self, group: dict[str, Any]) -> None:
        require(group["scale"] in MOP_SCALES, f"scale must be one of {MOP_SCALES}, got {group['scale']!r}")
        validate_adjust_lr_fn(group)
        check_momentum_dtype(group["momentum_dtype"])
