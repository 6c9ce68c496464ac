"""Learning-rate transfer: from an AdamW recipe to Muon, and across global batch sizes.

From AdamW to Muon. With ``adjust_lr_fn="match_rms_adamw"`` (each matrix's update scaled to RMS 0.2·γ, an
AdamW update's) one lr γ serves the Muon matrices and the AdamW parameters (embeddings, head, norms). Measured
on one H200 (``bench/lr_study.py``, docs/lr_study.md: a 4-layer MoE of 32 experts and a 4-layer dense model of
dim 1024, 500 steps, held-out loss, lrs on half-decades), Muon's best γ was 3e-3 on both models (NorMuon's too,
on both) where AdamW's best was 3e-4 (each one's loss worse a half-decade below and above its best), and Muon
at 3e-3 ended 0.49 (MoE) and 0.26 (dense) nats below AdamW at 3e-4 (3 seeds each); at 3.3× AdamW's lr Muon
already beats AdamW on both, and at AdamW's own lr it is 0.22–0.30 nats behind it. Hence

    γ_Muon = :data:`MUON_LR_PER_ADAMW_LR` · γ_AdamW

for the whole optimizer (both rules' parameters), the rule the shipped torchtitan configs follow. SOAP with
``match_update_rms=0.2`` (every matrix's update scaled to an AdamW update's RMS) had its best lr at the same 10×
on both models, KL-SOAP at a third of it (1e-3; 3 seeds each): :data:`LR_PER_ADAMW_LR`, :func:`lr_from_adamw`. It is
measured on models of 50–166 M parameters over 4 M tokens: at larger scales and longer runs the best ratio
may be smaller (Moonlight trained at AdamW's lr), so sweep γ/3, γ and 3γ around it when you can.

Across global batch sizes, the square-root rule.

An lr tuned at a global batch of B_ref tokens (or sequences of one length) moves to a batch of B as

    γ(B) = γ(B_ref) · √(B / B_ref)

the rule NVIDIA's study of SOAP and Muon at scale uses when it changes the batch (a larger batch averages
away gradient noise, so a larger step stays stable; for Adam-type and orthogonalized updates the step grows
with the square root, not linearly). It is a starting point for a new batch size, not a substitute for a
sweep at it, and it holds below the critical batch size, past which a larger batch buys no larger step.

Mixture-of-experts layers: each expert sees about B·k/N of the B tokens (top-k routing over N experts), so
its gradient is noisier than the dense matrices' at the same B. The rule's ratio is the same for both as
long as k and N stay fixed; it does not transfer an lr across a change of k or N.
"""

from __future__ import annotations

import math

MUON_LR_PER_ADAMW_LR = 10.0
"""The measured ratio of Muon's best lr (``adjust_lr_fn="match_rms_adamw"``) to AdamW's (module docstring)."""


ADAMW_UPDATE_RMS = 0.2
"""The RMS of an AdamW update that ``adjust_lr_fn="match_rms_adamw"`` (Muon, NorMuon) and SOAP's
``match_update_rms`` match in :data:`LR_PER_ADAMW_LR`'s rule."""

LR_PER_ADAMW_LR = {
    "Muon": MUON_LR_PER_ADAMW_LR,
    "NorMuon": MUON_LR_PER_ADAMW_LR,
    "SOAP": MUON_LR_PER_ADAMW_LR,
    "KLSOAP": MUON_LR_PER_ADAMW_LR / 3,
}
"""Each measured optimizer's best lr over AdamW's (module docstring), with its update matched to AdamW's RMS:
``adjust_lr_fn="match_rms_adamw"`` for Muon and NorMuon, ``match_update_rms=ADAMW_UPDATE_RMS`` for SOAP and
KL-SOAP."""


def lr_from_adamw(optimizer: str, adamw_lr: float) -> float:
    """γ = :data:`LR_PER_ADAMW_LR` [``optimizer``]·γ_AdamW: the lr for ``optimizer`` ("Muon", "NorMuon", "SOAP"
    or "KLSOAP", set to match AdamW's update RMS as that table says; matrices and AdamW parameters alike) from
    an AdamW recipe's lr. Raises ValueError for another optimizer or a negative or non-numeric lr."""
    if optimizer not in LR_PER_ADAMW_LR:
        raise ValueError(f"lr_from_adamw: optimizer must be one of {', '.join(LR_PER_ADAMW_LR)}, got {optimizer!r}")
    if isinstance(adamw_lr, bool) or not isinstance(adamw_lr, (int, float)) or adamw_lr < 0:
        raise ValueError(f"lr_from_adamw: adamw_lr must be a number >= 0, got {adamw_lr!r}")
    return LR_PER_ADAMW_LR[optimizer] * adamw_lr


def muon_lr_from_adamw(adamw_lr: float) -> float:
    """γ_Muon = :data:`MUON_LR_PER_ADAMW_LR`·γ_AdamW: the lr for Muon or NorMuon with
    ``adjust_lr_fn="match_rms_adamw"`` (matrices and AdamW parameters alike) from an AdamW recipe's lr. Raises
    ValueError for a negative or non-numeric lr."""
    if isinstance(adamw_lr, bool) or not isinstance(adamw_lr, (int, float)) or adamw_lr < 0:
        raise ValueError(f"muon_lr_from_adamw: adamw_lr must be a number >= 0, got {adamw_lr!r}")
    return MUON_LR_PER_ADAMW_LR * adamw_lr


def batch_scaled_lr(lr: float, batch_size: float, reference_batch_size: float) -> float:
    """γ·√(B / B_ref): the lr for a global batch of ``batch_size`` from ``lr`` tuned at ``reference_batch_size``
    (both in the same unit: tokens, or sequences of one length). Raises ValueError for a non-positive batch
    or a negative lr."""
    for label, value in (("batch_size", batch_size), ("reference_batch_size", reference_batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"batch_scaled_lr: {label} must be a number > 0, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
        raise ValueError(f"batch_scaled_lr: lr must be a number >= 0, got {lr!r}")
    return lr * math.sqrt(batch_size / reference_batch_size)
