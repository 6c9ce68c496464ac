"""``dtensor_muon.Muon``: torch.optim.Muon's interface, for whole models, on one device or over DTensors.

Matrices (see :mod:`dtensor_muon.plan.routing` for the rule) get Muon's orthogonalized momentum update
(:mod:`dtensor_muon.rules.muon`); everything else gets AdamW. The shared machinery (param groups, routing,
eager state, engine, checkpoints, overlap) is :class:`dtensor_muon.optim.base.MatrixOptimizer`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..kernels import resolve_ns_algorithm
from ..linalg.newton_schulz import KELLER_COEFFICIENTS, CoefficientSpec, resolve_coefficients, resolve_ns_dtype
from ..plan.views import MatrixSplit
from ..rules.momentum_storage import check_momentum_dtype
from ..rules.muon import ADJUST_LR_NAMES, AdjustLrFn, MuonRule
from ..rules.qk_clip import AttentionHeads
from .base import MatrixOptimizer, given_keywords, require, require_number

MAX_NS_STEPS = 99  # torch.optim.Muon: "Number of steps must be less than 100 for computational efficiency"


def validate_newton_schulz(group: dict[str, Any]) -> None:
    """Raise ValueError/TypeError naming the first bad Newton–Schulz or ``adjust_lr_fn`` setting of a group."""
    require_number(group, "eps")
    require(group["eps"] > 0, f"eps: eps should be > 0 but is: {group['eps']}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"ns_steps must be an int, got {type(steps).__name__}")
    require(steps >= 1, f"ns_steps: ns_steps should be >= 1 but is: {steps}")
    require(
        steps <= MAX_NS_STEPS,
        f"ns_steps: Number of steps must be less than {MAX_NS_STEPS + 1} for computational efficiency, got {steps}",
    )
    resolve_coefficients(group["ns_coefficients"])
    resolve_ns_dtype(group["ns_dtype"])
    resolve_ns_algorithm(group["ns_algorithm"])
    validate_adjust_lr_fn(group)


def validate_adjust_lr_fn(group: dict[str, Any]) -> None:
    """Raise ValueError unless ``adjust_lr_fn`` is None, a known name or a callable."""
    fn = group["adjust_lr_fn"]
    require(
        fn is None or fn in ADJUST_LR_NAMES or (callable(fn) and not isinstance(fn, str)),
        f"adjust_lr_fn: Adjust learning rate function {fn} is not supported; expected None, "
        f"{' or '.join(repr(n) for n in ADJUST_LR_NAMES)} or a callable (lr, (A, B)) -> lr",
    )


class Muon(MatrixOptimizer):
    """Muon for matrices, AdamW for the rest; exact on DTensor (FSDP2) parameters.

    Defaults that train: ``Muon(model.named_parameters())`` uses lr 0.02 (Keller Jordan's Muon lr) with torch's
    "original" per-matrix scale, for the matrices and for AdamW's parameters alike; every other positional
    default is torch.optim.Muon's, so torch's defaults are one keyword away (``lr=1e-3``) and
    ``Muon(params, lr=..., ...)`` with torch's arguments equals ``torch.optim.Muon`` bit for bit. Why a default
    and not a preset: a preset helps only users who know of it, while torch's lr 1e-3 leaves a small model far
    behind AdamW at its own defaults (docs/optimizers.md, "Recommended settings": measured on small CPU models;
    a GPU study at scale may revise it). For one lr shared by both rules at AdamW's scale, pass
    ``adjust_lr_fn="match_rms_adamw"`` with an AdamW-like lr (torchtitan's configs do).

    Args (shared with torch.optim.Muon, same meaning and defaults except lr):
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or param groups.
        lr: learning rate γ, a float or a 1-element Tensor (AdamW's too unless ``adamw_lr`` is given); 0.02
            by default (torch.optim.Muon's is 1e-3).
        weight_decay: decoupled weight decay λ: θ ← θ·(1 − γλ).
        momentum: μ in [0, 1).
        nesterov: use g + μ·(B − g) instead of B.
        ns_coefficients: (a, b, c), a list of triples (one per iteration, last repeated) or a name from
            :data:`dtensor_muon.linalg.newton_schulz.NAMED_COEFFICIENTS`.
        eps: Frobenius-normalization floor of Newton–Schulz.
        ns_steps: Newton–Schulz iterations, 1 to 99.
        adjust_lr_fn: None/"original" (γ·√max(1, A/B)), "match_rms_adamw" (γ·0.2·√max(A, B)),
            "spectral_unclamped" (γ·√(A/B), torch.optim.Muon's from torch 2.14), or a callable
            ``(lr, (A, B)) -> lr`` for an A×B matrix.
    Keyword-only:
        adamw_betas, adamw_eps, adamw_lr, adamw_weight_decay: AdamW for element-wise parameters.
        momentum_dtype: storage of the momentum buffer (a param-group key): "float32" (the parameter's dtype,
            torch.optim.Muon's), "bfloat16" (stochastic rounding) or "int8" (one float32 scale per 128 entries
            of a row); B' and U are computed in float32 either way (:mod:`dtensor_muon.rules.momentum_storage`).
        ns_dtype: Newton–Schulz working dtype (bfloat16, float32, float16).
        ns_algorithm: "auto" (Gram Newton–Schulz where it is faster and validated: Keller's coefficients,
            large rectangular matrices on the GPU backend), "standard" or "gram" (measured as accurate as
            the standard form for Keller's, quintic and 8-step Polar Express coefficients; not for CANS or
            5-step Polar Express); see :func:`dtensor_muon.linalg.newton_schulz.newton_schulz`.
        wire_dtype: dtype of the exchange (bf16 by default; None = parameter dtype). Must not round the
            Newton–Schulz input: bf16 with float32 ns_dtype is refused.
        bucket_size_mb: full-matrix megabytes per exchange bucket.
        exchange: "owner" (each matrix on one owner rank) or "gather_all" (baseline: every rank computes all).
        skip_nonfinite: if any rank sees an inf/NaN gradient, every rank skips the step.
        diagnostics_interval: every N steps, measure the orthogonality error and AdamW update RMS (0: never).
        overlap: ``step()`` returns with the return exchanges in flight; each module's updates are applied by
            a forward pre-hook just before FSDP all-gathers it (call :meth:`attach` with the model), and
            everything is flushed before the next step, any ``state_dict()`` and by :meth:`flush`.
        offload: "none" (state on the parameters' device) or "host": the momentum (every format) and AdamW's
            moments in pinned host memory, streamed through the GPU in buckets of ``bucket_size_mb`` each step,
            overlapped with the step's work, same bits (:mod:`dtensor_muon.engine.offload`); host memory: twice
            the momentum, once AdamW's moments. On CPU parameters it saves nothing (a warning says so).
        matrix_splits: ``{parameter-name pattern: MatrixSplit}`` (fnmatch patterns) cutting fused parameters into
            their matrices (fused QKV, SwiGLU w13, per-head blocks); a group's ``"matrix_split"`` wins.
        tp_mode: how tensor-parallel matrices (a ``Shard`` on a mesh dim named "tp") are computed, the default of
            every param group (a group's ``"tp_mode"`` wins): "owned" (each whole on one owner of the whole mesh;
            exact), "duplicated" (on every rank of one TP group; exact), "distributed" (one TP group runs
            Newton–Schulz on its blocks, all-reducing the Gram matrices in float32), "auto" (distributed where
            :func:`dtensor_muon.plan.distributed_pays`, else owned) or "blockwise" (each TP block as a matrix
            of its own: an approximation, no communication under TP alone).
        ns_cuda_graphs: on CUDA, replay each owner's Newton–Schulz from a CUDA graph per matrix shape (same
            bits; for matrices of up to :data:`~dtensor_muon.linalg.ns_graphs.MAX_GRAPH_WORK` = 2³⁶ multiply-adds
            per Gram matrix (4096×4096 and below), where the eager launches' host time rivals the GPU work, see
            :mod:`dtensor_muon.linalg.ns_graphs`). Each graph keeps a few matrices of memory.
        qk_clip_tau, qk_clip_alpha, qk_clip_heads: QK-clip (MuonClip): with τ > 0, after each step every head
            whose largest logit (handed over by :meth:`record_max_logits`) exceeded τ has its query and key rows
            of ``qk_clip_heads`` (``{layer: dtensor_muon.AttentionHeads}``) scaled back to τ (see
            :mod:`dtensor_muon.rules.qk_clip` for the formula, :mod:`dtensor_muon.optim.qk_clip` for the step).

    Every keyword, its default and allowed values: :data:`dtensor_muon.optim.options.OPTIONS` (docs/options.md).
    """

    rule = MuonRule()

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
