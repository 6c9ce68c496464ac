"""QK-clip (MuonClip, Kimi K2): the per-row factors that bring each attention head's largest logit back to τ.

For head h with S_h, the largest softmax input q_i·k_j·scale over the global batch, γ_h = min(1, τ / S_h); a
head at or below τ keeps γ = 1 (its rows untouched, bit for bit). With α (0.5 by default):

- MHA and GQA: K is shared by the ``n_heads / n_kv_heads`` query heads of a group g, so
  γ_g = min(1, τ / max_{h∈g} S_h); every query row of group g's heads × γ_g^α, the group's key rows × γ_g^(1−α)
  (Megatron-Core's rule; MHA is the case of groups of one).
- MLA (DeepSeek-V3, Kimi K2): per head, the query's NoPE rows × γ_h^α, its RoPE rows × γ_h (the RoPE key is shared
  by every head: it takes no factor), the NoPE key rows of ``wkv_b`` × γ_h^(1−α); the value rows and ``wkv_a``
  are untouched.

Rows are the output rows of ``nn.Linear`` weights ([out, in]): head h of ``W_q`` is rows h·d … (h+1)·d − 1 (MHA,
GQA: d = head_dim; MLA: d = qk_nope_head_dim + qk_rope_head_dim, NoPE first), group g of ``W_k`` rows
g·d … (g+1)·d − 1, and head h of MLA's ``wkv_b`` rows h·(n + v) … with the n NoPE key rows first, then the v value
rows. A fused QKV weight interleaved by key group (:meth:`AttentionHeads.grouped_qkv`, the layout of
:meth:`dtensor_muon.MatrixSplit.grouped_qkv`: per group its query heads, its key head, its value head, d rows each)
takes the same factors in that order, the value rows 1. The factors are computed in float64 and applied in the
weight's dtype; optimizer state is not rescaled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class AttentionHeads:
    """Where one attention layer's heads sit: the names of its query and key weights and the head geometry.

    MHA/GQA: ``q`` and ``k`` name ``W_q`` and ``W_k``; ``head_dim`` rows per head, ``n_kv_heads`` key heads
    (``None``: MHA). MLA: ``k`` names ``wkv_b`` and ``qk_rope_head_dim`` > 0, with ``qk_nope_head_dim``,
    ``v_head_dim`` (``head_dim`` unused).
    """

    q: str
    k: str
    n_heads: int
    head_dim: int = 0
    n_kv_heads: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    fused: bool = False
    """``q`` and ``k`` name one fused QKV weight, its rows interleaved by key group (:meth:`grouped_qkv`)."""

    @classmethod
    def grouped_qkv(cls, weight: str, n_heads: int, n_kv_heads: int, head_dim: int) -> AttentionHeads:
        """The heads of a fused QKV weight whose rows interleave by key group (torchtitan 0.3's ``wqkv``): per
        group g its ``n_heads / n_kv_heads`` query heads, then its key head, then its value head."""
        return cls(q=weight, k=weight, n_heads=n_heads, head_dim=head_dim, n_kv_heads=n_kv_heads, fused=True)

    def __post_init__(self) -> None:
        if self.n_heads < 1:
            raise ValueError(f"AttentionHeads {self.q!r}: n_heads must be >= 1, got {self.n_heads}")
        if self.is_mla:
            if self.qk_nope_head_dim < 1 or self.v_head_dim < 1:
                raise ValueError(
                    f"AttentionHeads {self.q!r}: MLA needs qk_nope_head_dim and v_head_dim >= 1, got "
                    f"{self.qk_nope_head_dim} and {self.v_head_dim}"
                )
            return
        if self.fused != (self.q == self.k):
            raise ValueError(
                f"AttentionHeads {self.q!r}: q and k name one weight exactly when it is a fused QKV weight "
                "(AttentionHeads.grouped_qkv)"
            )
        if self.head_dim < 1:
            raise ValueError(f"AttentionHeads {self.q!r}: head_dim must be >= 1, got {self.head_dim}")
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            raise ValueError(
                f"AttentionHeads {self.q!r}: n_kv_heads must divide n_heads ({self.n_heads}), got {self.n_kv_heads}"
            )

    @property
    def is_mla(self) -> bool:
        return self.qk_rope_head_dim > 0

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def row_counts(self) -> dict[str, int]:
        """The number of rows the two weights must have."""
        if self.is_mla:
            q_rows = self.n_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
            return {self.q: q_rows, self.k: self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)}
        if self.fused:
            return {self.q: (self.n_heads + 2 * self.kv_heads) * self.head_dim}
        return {self.q: self.n_heads * self.head_dim, self.k: self.kv_heads * self.head_dim}


def head_factors(max_logits: Tensor, tau: float) -> Tensor:
    """γ_h = min(1, τ / S_h) per head, in float64 (1 for a head at or below τ, or with no value: −inf)."""
    s = max_logits.to(torch.float64)
    return torch.where(s > tau, tau / s, torch.ones_like(s))


def row_factors(heads: AttentionHeads, max_logits: Tensor, tau: float, alpha: float) -> dict[str, Tensor]:
    """The float64 factor of every row of the query and key weights (module docstring), by weight name, on
    ``max_logits``' device."""
    if max_logits.shape != (heads.n_heads,):
        raise ValueError(
            f"QK-clip {heads.q!r}: expected {heads.n_heads} per-head maxima, got shape {tuple(max_logits.shape)}"
        )
    if heads.is_mla:
        gamma = head_factors(max_logits, tau)
        nope, rope, v = heads.qk_nope_head_dim, heads.qk_rope_head_dim, heads.v_head_dim
        q = torch.cat([gamma[:, None].pow(alpha).expand(-1, nope), gamma[:, None].expand(-1, rope)], dim=1)
        k = torch.cat([gamma[:, None].pow(1 - alpha).expand(-1, nope), gamma.new_ones(heads.n_heads, v)], 1)
        return {heads.q: q.reshape(-1), heads.k: k.reshape(-1)}
    group = heads.n_heads // heads.kv_heads
    gamma = head_factors(max_logits.reshape(heads.kv_heads, group).amax(dim=1), tau)  # per key head
    q = gamma.repeat_interleave(group).pow(alpha).repeat_interleave(heads.head_dim)
    k = gamma.pow(1 - alpha).repeat_interleave(heads.head_dim)
    if heads.fused:  # per key group: its query rows, its key rows, its value rows (1)
        d = heads.head_dim
        v = gamma.new_ones(heads.kv_heads, d)
        rows = torch.cat([q.reshape(heads.kv_heads, group * d), k.reshape(heads.kv_heads, d), v], dim=1)
        return {heads.q: rows.reshape(-1)}
    return {heads.q: q, heads.k: k}
