"""Gram Newton–Schulz: the Newton–Schulz iteration carried out on the m×m Gram matrix.

One iteration of the standard form is X_{i+1} = Z_i·X_i with Z_i = a_i·I + b_i·R_i + c_i·R_i², R_i = X_i·X_iᵀ.
Every Z_i is a polynomial in R_0, so all of them are symmetric and commute, and L iterations from X_i are

    X_{i+L} = Q·X_i,   Q = Z_i·Z_{i+1}···Z_{i+L−1},   R_{j+1} = Z_j·R_j·Z_j = Z_j·(R_j·Z_j)

which needs the m×n matrix X only twice per segment of L iterations: the Gram matrix R_i = X_i·X_iᵀ (SYRK,
m²n FLOPs) and the product Q·X_i (2m²n). In between there are 4L − 3 products of symmetric m×m matrices
(R², Q·Z, R·Z, Z·(R·Z); m³ each as lower triangles), against L·(3m²n + m³) for L standard iterations:
fewer FLOPs whenever n > m and L > 1, e.g. 0.61× for 5 iterations on 4096×14336 in segments of 3 + 2.

In bf16, R_j drifts from X_j·X_jᵀ (rounding compounds through Z·R·Z: spurious negative eigenvalues and
eigenvector drift, as Dao AI Lab's 2026 "Gram Newton–Schulz" reports), so X is recomputed and R restarted
from it after each segment. How long a segment may be depends on the coefficients; measured against the
float64 iteration (CPU, bf16, Gaussian, power-law, low-rank and ill-conditioned spectra, worst error as a
multiple of the standard bf16 form's; :func:`dtensor_muon.newton_schulz.gram_segments` holds the choice):
- segments of 2: Keller's fixed triple 0.93× (5 steps) to 1.04× (10), quintic 1.01×, Polar Express 8 steps
  1.07×; but Polar Express 5 steps 2.4× and CANS 19×;
- a first segment of 3 (from the normalized input, whose σ ≤ 1) then segments of 2: Keller 1.37× to 1.69×
  for 5 to 10 steps, with 1.2× fewer FLOPs than 2 + 2 + 1 at 5 steps on 4096×14336; alone it is 11×
  (3 steps) and 3.8× (3 + 1), and for every other named schedule it overflows;
- segments of 3 after the first: Keller 8 steps 7.6·10⁶×, 10 steps non-finite.
Segments of 1 are exactly the standard form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor


class GramBackend(Protocol):
    """The products Gram Newton–Schulz needs, on [m, n] / [m, m] or batched [B, ..] inputs."""

    def gram(self, x: Tensor) -> Tensor: ...

    def poly(self, gram: Tensor, a: float, b: float, c: float) -> Tensor: ...

    def symmetric_product(self, x: Tensor, y: Tensor) -> Tensor: ...

    def apply(self, p: Tensor, x: Tensor) -> Tensor: ...


def gram_segment(x: Tensor, triples: Sequence[tuple[float, float, float]], backend: GramBackend) -> Tensor:
    """len(triples) Newton–Schulz iterations from X (m ≤ n) as one Q·X: R = X·Xᵀ, then per iteration
    Z = a·I + b·R + c·R², Q ← Q·Z and (all but the last) R ← Z·(R·Z)."""
    r = backend.gram(x)
    q: Tensor | None = None
    for j, (a, b, c) in enumerate(triples):
        z = backend.poly(r, a, b, c)
        q = z if q is None else backend.symmetric_product(q, z)
        if j < len(triples) - 1:
            r = backend.symmetric_product(z, backend.symmetric_product(r, z))
    assert q is not None, "gram_segment needs at least one iteration"
    return backend.apply(q, x)


def gram_newton_schulz(
    x: Tensor,
    triples: Sequence[tuple[float, float, float]],
    backend: GramBackend,
    segments: Sequence[int],
) -> Tensor:
    """The iterations ``triples`` (one (a, b, c) per iteration) on the normalized wide X, in segments of the
    given lengths (summing to len(triples)), R restarted from X after each. Returns X in x's layout (a
    transposed view stays one)."""
    if sum(segments) != len(triples) or any(length < 1 for length in segments):
        raise ValueError(f"gram_newton_schulz: segments {list(segments)} must be >= 1 and sum to {len(triples)}")
    done = 0
    for length in segments:
        x = gram_segment(x, triples[done : done + length], backend)
        done += length
    return x
