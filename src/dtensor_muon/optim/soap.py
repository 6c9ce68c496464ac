"""``dtensor_muon.SOAP`` (and ``KLSOAP``, ``REKLS``): Adam in the eigenbasis of Shampoo's factors, on each owner."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..plan.views import MatrixSplit
from ..rules.qk_clip import AttentionHeads
from ..rules.soap import SOAP_BASES, SOAPRule
from .base import MatrixOptimizer, given_keywords, require, require_number


class SOAP(MatrixOptimizer):
    """SOAP for matrices, AdamW for the rest; exact on DTensor (FSDP2) parameters.

    Defaults that train: ``SOAP(model.named_parameters())`` (and ``KLSOAP``, ``REKLS``) uses lr 1e-2, an Adam
    learning rate for the matrices' rotated Adam and for AdamW's parameters alike; at Emerging-Optimizers' 3e-3
    a small MLP's loss fell slower than AdamW's at its defaults (docs/optimizers.md, "Recommended settings":
    small CPU models; a GPU study at scale may revise it, and a larger model usually wants a smaller lr).

    Per matrix G (m×n), on its owner, in float32 (see :mod:`dtensor_muon.rules.soap` for the exact steps):
    L ← β_t·L + (1 − β_t)·G·Gᵀ, R ← β_t·R + (1 − β_t)·Gᵀ·G (KL-Shampoo's factors with ``kl=True``); every
    ``precondition_frequency`` steps new bases Q_L, Q_R (eigh on step 1, then one power iteration and QR, or
    eigh with ``basis="eigh"``, or the power iteration orthogonalized by Cholesky QR with ``basis="cholqr"``),
    the second moment's axes first sorted by the old bases' eigenvalue estimates
    diag(Q_oldᵀ·K·Q_old) for either basis (as Emerging-Optimizers 0.3 does) and the first moment rotated into
    the new bases; a failing eigendecomposition never raises (float64 and shifted retries, else the old basis);
    then Adam on G' = Q_Lᵀ·G·Q_R and θ ← θ·(1 − γλ) − γ·Q_L·N·Q_Rᵀ. The order (factors, basis, Adam) and
    most defaults follow Emerging-Optimizers' SOAP (whose lr was 3e-3 before lr became required there;
    weight_decay 0.1 here, 0.01 there). Two more defaults differ, so that SOAP trains as it comes:
    ``skip_first_update=True`` (a matrix's first step only builds its factors and basis, as the original
    SOAP, arXiv 2409.11321) and ``max_update_rms=1.0`` (each matrix's update clipped to RMS 1). Without them,
    Adam in a freshly rotated basis divides float32 rounding and rotated momentum by a near-zero second
    moment, and a small MLP diverges within a few steps at Adam-sized learning rates; the clip is what keeps
    it stable, the skip alone does not (the losses with and without each: docs/optimizers.md, "SOAP, KL-SOAP
    and REKLS"). ``skip_first_update=False, max_update_rms=0.0`` give Emerging-Optimizers 0.3's SOAP.

    Args:
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or param groups.
        lr: learning rate γ (AdamW's too unless ``adamw_lr`` is given); the update is Adam-like (entries of
            size ~1), so γ is an Adam learning rate, not Muon's.
        betas: Adam's (β₁, β₂) in the eigenbasis. The group key ``momentum`` (checked by every matrix
            optimizer) is set to β₁ and not read.
        shampoo_beta: β of the factors' moving average, in [0, 1).
        eps: Adam's ε, also KL's lower clamp of the eigenvalue estimates.
        weight_decay: decoupled weight decay λ.
        precondition_frequency: steps between basis refreshes (an int ≥ 1; 1 refreshes every step).
        basis: "qr" (power iteration and Householder QR from the previous basis), "eigh" (a full
            eigendecomposition; in float32, retried in float64 and then shifted where it fails, else the previous
            basis is kept) or "cholqr" (the power iteration on K + 10⁻⁵·2ᵉ·I, 2ᵉ⁻¹ ≤ max diag(Q_oldᵀ·K·Q_old) < 2ᵉ,
            orthogonalized by Cholesky QR on float32-accurate matrix products, a warm basis's second pass a
            series of TF32 products, same-size factors batched, eigh only on step 1 or where a pass fails; see
            :mod:`dtensor_muon.linalg.eigenbasis`). "qr" and "eigh" are the references and "qr" stays the default, as
            the basis the peer comparisons (Emerging-Optimizers) are written against: "cholqr" equals "qr" of
            the shifted factor (within float32 Householder QR's own error of the float64 formula), trains as
            "qr" does and refreshes faster (docs/optimizers.md, "SOAP, KL-SOAP and REKLS").
        kl: KL-Shampoo's factor update (arXiv 2509.03378).
        max_preconditioner_dim: sides longer than this are not preconditioned (identity basis, no factor).
            8192 by default: a side k costs 8k² + 4k bytes of state (factor and basis) and its refresh is
            cubic in k, so sides up to 8192 (hidden sizes) stay affordable and vocabulary or long MLP sides are
            left to Adam's diagonal (refresh times by k: docs/optimizers.md, "SOAP, KL-SOAP and REKLS").
        correct_bias: Adam's bias corrections 1 − β₁ᵗ and 1 − β₂ᵗ.
    Keyword-only:
        correct_shampoo_beta_bias: bias-corrected factors (β_t = 1 − (1 − β)/(1 − βᵗ)); else an EMA from zero.
        max_update_rms: clip each matrix's update RMS to this value (0: no clipping); 1.0 by default (see
            above). It acts after ``match_update_rms``, so a match above 1 needs ``max_update_rms=0``.
        match_update_rms: scale every matrix's update to exactly this RMS (0: off; e.g. 0.2 to reuse an AdamW
            learning rate and schedule).
        skip_first_update: a matrix's step 1 updates its factors and builds its basis, leaves Adam's moments
            at zero and applies no update (θ only decays by 1 − γλ); Adam's bias corrections then count from
            its step 2. Per matrix, from its own step count on its owner: the same at every world size. A
            checkpoint saved before this option existed takes the value given here when loaded: pass False
            (and its own ``max_update_rms``, which it keeps) to continue such a run exactly.
        adamw_betas, adamw_eps, adamw_lr, adamw_weight_decay: AdamW for element-wise parameters.
        wire_dtype: dtype of the exchange; float32 (the gradient travels and is used in float32; a 16-bit
            wire is refused for DTensor parameters).
        bucket_size_mb, exchange, skip_nonfinite, diagnostics_interval, overlap, offload, matrix_splits, tp_mode,
        qk_clip_tau, qk_clip_alpha, qk_clip_heads: as in
            :class:`dtensor_muon.Muon` (tp_mode "owned", "duplicated" or "blockwise": the distributed forms are
            Newton–Schulz's).
    """

    rule = SOAPRule()

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.95),
        shampoo_beta: float = 0.95,
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        precondition_frequency: int = 1,
        basis: str = "qr",
        kl: bool = False,
        max_preconditioner_dim: int = 8192,
        correct_bias: bool = True,
        *,
        correct_shampoo_beta_bias: bool = True,
        max_update_rms: float = 1.0,
        match_update_rms: float = 0.0,
        skip_first_update: bool = True,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
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
        keywords = given_keywords(locals())
        # momentum mirrors β₁ for the shared checks; a bad β₁ is left to validate_group, whose error names betas
        pair = isinstance(betas, (tuple, list)) and len(betas) == 2
        beta1 = betas[0] if pair and isinstance(betas[0], (int, float)) and 0 <= betas[0] < 1 else 0.0
        super().__init__(params, {**keywords, "momentum": beta1})

    def validate_group(self, group: dict[str, Any]) -> None:
        betas = group["betas"]
        require(
            isinstance(betas, (tuple, list))
            and len(betas) == 2
            and all(not isinstance(b, bool) and isinstance(b, (int, float)) and 0 <= b < 1 for b in betas),
            f"betas: expected two numbers in [0, 1), got {betas!r}",
        )
        require_number(group, "shampoo_beta", "eps", "max_update_rms", "match_update_rms")
        require(
            0 <= group["shampoo_beta"] < 1, f"shampoo_beta: expected a number in [0, 1), got {group['shampoo_beta']}"
        )
        require(group["eps"] > 0, f"eps: expected a number > 0, got {group['eps']}")
        require(group["max_update_rms"] >= 0, f"max_update_rms: expected a number >= 0, got {group['max_update_rms']}")
        require(
            group["match_update_rms"] >= 0, f"match_update_rms: expected a number >= 0, got {group['match_update_rms']}"
        )
        for key in ("precondition_frequency", "max_preconditioner_dim"):
            value = group[key]
            require(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                f"{key}: expected an int >= 1, got {value!r}",
            )
        require(group["basis"] in SOAP_BASES, f"basis: expected one of {SOAP_BASES}, got {group['basis']!r}")
        for key in ("kl", "correct_bias", "correct_shampoo_beta_bias", "skip_first_update"):
            require(isinstance(group[key], bool), f"{key}: expected a bool, got {group[key]!r}")


class KLSOAP(SOAP):
    """:class:`SOAP` with KL-Shampoo's factors (``kl=True``; the QR basis by default) and SOAP's defaults
    (``skip_first_update=True``, ``max_update_rms=1.0``). KL's factors alone kept the MLP of :class:`SOAP`'s
    docstring training (20 steps at lr 3e-3/1e-2/0.02: 0.47/2.3e-4/3e-4 without skip and clip); with them it
    trains as well (0.44/1.4e-4/0.10), and they bound a step where KL's whitening is not enough."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("kl", True)
        super().__init__(params, *args, **kwargs)


class REKLS(SOAP):
    """:class:`SOAP` with KL-Shampoo's factors and a full eigendecomposition every refresh (``kl=True``,
    ``basis="eigh"``), as Emerging-Optimizers 0.3's REKLS (its SOAP with ``use_eigh=True`` and
    ``use_kl_shampoo=True``, ``soap/rekls.py``; equal with ``skip_first_update=False, max_update_rms=0.0``).
    SOAP's defaults (skip and clip) hold here too: on the MLP of :class:`SOAP`'s docstring, 20 steps at lr
    3e-3/1e-2/0.02 gave 0.36/6.2e-5/0.038 with them and 0.40/4.6e-5/3.9e-4 without."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("kl", True)
        kwargs.setdefault("basis", "eigh")
        super().__init__(params, *args, **kwargs)
