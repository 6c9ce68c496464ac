"""Gram Newton–Schulz: the Newton–Schulz iteration carried out on the m×m Gram matrix.

One iteration of the standard form is X_{i+1} = Z_i·X_i with Z_i = a_i·I + b_i·R_i + c_i·R_i², R_i = X_i·X_iᵀ.
Every Z_i is a polynomial in R_0, so all of them are symmetric and commute, and L iterations from X_i are

    X_{i+L} = Q·X_i,   Q = Z_i·Z_{i+1}···Z_{i+L−1},   R_{j+1} = Z_j·R_j·Z_j = Z_j·(R_j·Z_j)

which needs the m×n matrix X only twice per segment of L iterations: the Gram matrix R_i = X_i·X_iᵀ (SYRK,
m²n FLOPs) and the product Q·X_i (2m²n). In between there are 4L − 3 products of symmetric m×m matrices
(R², Q·Z, R·Z, Z·(R·Z); m³ each as lower triangles), against L·(3m²n + m³) for L standard iterations:
fewer FLOPs whenever n > m and L > 1: for 5 iterations on 4096×14336, 0.74× in segments of 2 + 2 + 1.

In bf16, R_j drifts from X_j·X_jᵀ (Dao AI Lab's 2026 "Gram Newton–Schulz" reports spurious negative
eigenvalues and eigenvector drift), so X is recomputed and R restarted from it after each segment. The
negative eigenvalues bound the segment length: rounding leaves eigenvalues λ < 0 of size about 2⁻⁹·‖R‖
where X is rank-deficient, and for λ < 0 the factor Z = a + b·λ + c·λ² (b < 0) exceeds a and grows with |λ|,
so λ ← Z²·λ runs away within a segment instead of saturating as a singular value does. Segments of 2 keep
Keller's fixed triple, the quintic and 8-step Polar Express near the standard bf16 form's error, low-rank
inputs included; 3 + 2 (1.2× fewer FLOPs on 4096×14336) lets rank-1 inputs run away, and longer segments
overflow on full-rank spectra too (the measured errors: docs/kernels.md "The Gram form").
Segments of 1 are exactly the standard form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor


class GramBackend(Protocol):
    """The products Gram Newton–Schulz needs, on [m, n] / [m, m] or batched [B, ..] inputs; a ``scale`` s (per
    matrix) multiplies gram's result by s², poly's and symmetric_product's by s. Where ``keeps_lower_tiles(x)``
    holds, a chain on x passes ``lower_in`` (its symmetric operands, C included, are valid in their 128×128
    lower tiles only) and ``lower_out`` (the result need be written in its lower tiles only); a backend that
    never keeps lower tiles says so and writes whole results, which serve either way."""

    def keeps_lower_tiles(self, x: Tensor) -> bool: ...

    def gram(self, x: Tensor, scale: Tensor | None = None, lower_out: bool = False) -> Tensor: ...

    def poly(
        self,
        gram: Tensor,
        a: float,
        b: float,
        c: float,
        scale: Tensor | None = None,
        lower_in: bool = False,
        lower_out: bool = False,
    ) -> Tensor: ...

    def symmetric_product(
        self, x: Tensor, y: Tensor, scale: Tensor | None = None, lower_in: bool = False, lower_out: bool = False
    ) -> Tensor: ...

    def apply(self, p: Tensor, x: Tensor) -> Tensor: ...


def gram_segment(
    x: Tensor,
    triples: Sequence[tuple[float, float, float]],
    backend: GramBackend,
    scale: Tensor | None = None,
) -> Tensor:
    """len(triples) Newton–Schulz iterations from X = s·x (x itself without ``scale``) as one Q·X: R = X·Xᵀ,
    then per iteration Z = a·I + b·R + c·R², Q ← Q·Z and (all but the last) R ← Z·(R·Z). With a scale,
    R = s²·x·xᵀ and the last product forming Q is s·Q, so that Q·X = (s·Q)·x: s·x is never formed. Where the
    backend keeps lower tiles, R, every Z and every Q but the last are kept as their lower tiles; the last Q,
    which the apply reads whole, is written whole."""
    lower = backend.keeps_lower_tiles(x)
    r = backend.gram(x, scale, lower_out=lower)
    q: Tensor | None = None
    for j, (a, b, c) in enumerate(triples):
        last = j == len(triples) - 1
        fold = scale if last else None
        if q is None:
            z = backend.poly(r, a, b, c, fold, lower_in=lower, lower_out=lower and not last)
            q = z
        else:
            z = backend.poly(r, a, b, c, lower_in=lower, lower_out=lower)
            q = backend.symmetric_product(q, z, fold, lower_in=lower, lower_out=lower and not last)
        if not last:
            rz = backend.symmetric_product(r, z, lower_in=lower, lower_out=lower)
            r = backend.symmetric_product(z, rz, lower_in=lower, lower_out=lower)
    assert q is not None, "gram_segment needs at least one iteration"
    return backend.apply(q, x)


def gram_newton_schulz(
    x: Tensor,
    triples: Sequence[tuple[float, float, float]],
    backend: GramBackend,
    segments: Sequence[int],
    scale: Tensor | None = None,
) -> Tensor:
    """The iterations ``triples`` (one (a, b, c) per iteration) from the normalized wide X₀ = s·x (x itself
    without ``scale``), in segments of the given lengths (summing to len(triples)), R restarted from X after
    each. Returns X in x's layout (a transposed view stays one)."""
    if sum(segments) != len(triples) or any(length < 1 for length in segments):
        raise ValueError(f"gram_newton_schulz: segments {list(segments)} must be >= 1 and sum to {len(triples)}")
    done = 0
    for length in segments:
        x = gram_segment(x, triples[done : done + length], backend, scale if done == 0 else None)
        done += length
    return x
