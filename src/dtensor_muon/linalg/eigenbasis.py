"""SOAP's eigenbasis refresh on matrix products: one power iteration from the previous basis, orthogonalized by
Cholesky QR, batched over same-size factors (``basis="cholqr"`` of :class:`dtensor_muon.SOAP`).

For a batch of symmetric positive semidefinite factors K (``[B, k, k]``) and their previous orthogonal bases
Q_old, one refresh computes, per factor::

    Y   = K·Q_old                                  the power-iteration product
    d   = diag(Q_oldᵀ·K·Q_old) = Σ_rows (Q_old ∘ Y)  the eigenvalue estimates (Rayleigh quotients), read off Y
    π   = argsort(d, descending)                   Q_s = Q_old[:, π], Y_s = Y[:, π] = K·Q_s
    Ŷ   = (Y_s·2⁻ᵉ + ρ·Q_s)·D                      2ᵉ⁻¹ ≤ max d < 2ᵉ, ρ = SHIFT, D normalizes columns
    Q_new = Ŷ·R⁻¹                                  R from Cholesky QR passes (below); values = d[π]

so Q_new = qr((K + ρ·2ᵉ·I)·Q_s).Q: basis="qr"'s orthogonal iteration (one power step and a QR of the sorted old
basis, the eigenvalue estimates sorted as there), on the shifted factor, with the QR computed from Gram
matrices instead of Householder reflections.

Why a triangular orthogonalization and not a polar one: Q_old is square and orthogonal, so Y_s = Q_s·A with
A = Q_sᵀ·K·Q_s symmetric positive semidefinite, and polar(Y_s) = Q_s·polar(A) = Q_s: a polar (Newton–Schulz)
step never moves the basis. The QR factor does (Q_new = Q_s·qr(A).Q), and Cholesky QR's R has a positive
diagonal, so Q_new equals Householder QR's Q up to column signs, which SOAP's update does not depend on (a
flipped column flips a row of the rotated moments and back).

Why the shift ρ = 1e-5 (relative to max d, which is at least K's largest eigenvalue / k and at most the
largest): K + ρ·2ᵉ·I has K's eigenvectors, and the power step converges at the rate (λ_{j+1} + ρ')/(λ_j + ρ')
instead of λ_{j+1}/λ_j, which differs only for eigenvalues below ~ρ·λ_max; in float32 the product K·Q itself
carries rounding of about √k·2⁻²⁴·λ_max (4e-6·λ_max at k = 4096), so those directions are rounding noise in
basis="qr" too. The shift keeps them on their old columns (a zero or rank-deficient K keeps Q_s's columns
for its null space instead of noise), and bounds cond(Ŷ) by about (1 + ρ)/ρ = 1e5, inside Cholesky QR's
reach in float32 with a shifted first pass.

Orthogonalization, in passes on Q (first Q = Ŷ); each needs G = QᵀQ = I + F in float32-accurate arithmetic
(:func:`accurate_gram`: on CUDA two TF32 products of a high/low split, relative error ~2⁻²¹; float32 on CPU):

- Cholesky pass: Q ← Q·R⁻¹ with RᵀR = Cholesky(G) (float32; on G + s·I where G is not numerically positive
  definite: s = FIRST_PASS_SHIFT on the first pass, whose input Ŷ may have cond up to ~1e5, k·2⁻²⁴ later),
  triangular solve in float32 whatever torch's float32 matmul precision (under "high" cuBLAS's solve runs
  in TF32, faster, but the first pass then leaves ‖F‖_F above SERIES_DEFECT, and the whole refresh takes a
  second Cholesky pass and longer: BENCHMARKS.md "The refresh on matrix products"). R is triangular, so Q
  keeps Ŷ's nested column spans (the power iteration's order) whatever its rounding. Cholesky QR leaves
  max|QᵀQ − I| ≈ 2⁻²⁴·cond(Q)², so the first pass's only job is a well-conditioned Q and the second makes it
  orthogonal.
- series pass, on the members with ‖F‖_F ≤ SERIES_DEFECT: the same Q·R⁻¹ with the upper
  triangular R = I + U from products instead of cuSOLVER and cuBLAS, U₀ = Φ(F), U = Φ(F − U₀ᵀ·U₀)
  (Φ: strict upper triangle plus half the diagonal, so that U + Uᵀ + UᵀU = F to O(‖F‖³)) and
  R⁻¹ = I − U + U² to O(‖F‖³): Q ← Q + Q·(U² − U), three TF32 products on CUDA (their rounding, about
  2⁻¹¹·‖F‖_F/√k per entry, stays below the float32 Cholesky pass's own). From warm bases the first pass's
  ‖F‖_F is small enough for it, and the series pass is faster than a Cholesky pass, its result as far from
  float64 Cholesky QR's and as orthogonal (the measured figures: BENCHMARKS.md "The refresh on matrix
  products"; re-measure: tools/soap/refresh_ops.py).

Passes run, each batch member on its own, until the input of its Cholesky pass had max|F| ≤ ACCEPT_DEFECT,
or a series pass ran, at most MAX_PASSES (a basis far from K's eigenvectors, e.g. a new gradient direction in
a rank-deficient factor, takes three or four; a warm one two). A pass whose input had max|F| ≤ ACCEPT_DEFECT
leaves Q orthogonal to O(max|F|²) plus float32 rounding (tests/test_soap_refresh.py measures the result's max|QᵀQ − I| in float64).

Factors of a side above BATCH_MAX_SIDE are refreshed in batches of at most LARGE_BATCH_ENTRIES entries per
tensor, with their products batched and their Cholesky factorizations and triangular solves one per factor
on SIDE_STREAMS CUDA streams (batched cuSOLVER is slower than a loop at these sizes, and one factorization
leaves the GPU idle in its panel steps).

The second-order polar correction Q·(I − F/2 + 3F²/8) would be a last pass as cheap as the series (two
products, orthogonal to O(‖F‖³)) and is not used: it rotates column pairs by F_ij/2 where the triangular R
removes the whole overlap from the later column, and as a last pass it left the parameters farther from the
float64 reference than Cholesky passes do (docs/numerics.md "SOAP's basis refresh").

A factor gets ``eigh`` (:func:`dtensor_muon.rules.soap.eigh_descending`: the sorted old basis where that fails
too) where the refresh cannot vouch for its basis: a non-finite Ŷ or Q, a failed Cholesky, or a last pass
whose input had max|F| > ACCEPT_DEFECT. A zero factor, or one whose largest estimate is not finite, keeps its
sorted old basis (Ŷ = Q_s), as eigh_descending does for a factor with an inf or NaN. The products that rotate
SOAP's moments (Q_newᵀ·Q_old) use :func:`accurate_matmul` as well; nothing here depends on torch's float32
matmul precision setting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

SHIFT = 1e-5
"""ρ: the power step runs on K + ρ·2ᵉ·I (2ᵉ⁻¹ ≤ the largest Rayleigh quotient < 2ᵉ); see the module docstring."""

FIRST_PASS_SHIFT = 1e-3
"""s of the first Cholesky QR pass where Ŷ's Gram matrix (unit diagonal) is not numerically positive definite
(cond(Ŷ) up to ~1e5, so cond(G) up to ~1e10): the shifted pass still gives a Q of cond ≤ √(1 + s/σ_min(Ŷ)²),
which the later passes make orthogonal."""

SERIES_DEFECT = 2.0**-10
"""Largest ‖QᵀQ − I‖_F for which a pass runs as the series (module docstring): its truncation, ‖F‖³ ≤ 2⁻³⁰,
and its TF32 rounding, 2⁻²¹/√k per entry, stay below float32's rounding in the Cholesky pass it replaces
(max|QᵀQ − I| after it, measured: docs/numerics.md "SOAP's basis refresh")."""

ACCEPT_DEFECT = 1e-3
"""Largest max|QᵀQ − I| (float32-accurate) the input of the last Cholesky QR pass may have; beyond it after
``MAX_PASSES`` passes, eigh."""

FLOAT32_UNIT = 2.0**-24
"""float32's unit roundoff: the later Cholesky steps, where G is not numerically positive definite, run on
G + k·2⁻²⁴·I (k·u bounds the float32-accurate Gram's rounding for unit columns)."""

BATCH_MAX_SIDE = 512
"""Largest factor side whose Cholesky factorizations and triangular solves run as one batched call; larger
factors take one call each, on SIDE_STREAMS streams (batched cuSOLVER is slower there than one call per factor).
Chosen by measurement: docs/performance.md "SOAP's basis refresh on streams"."""

LARGE_BATCH_ENTRIES = 2**26
"""Most entries per tensor of a batch of factors above BATCH_MAX_SIDE (4 factors of k = 4096, 64 of 1024): a
refresh holds about ten such tensors at once."""

SIDE_STREAMS = 4
"""CUDA streams the per-factor Cholesky factorizations and solves are spread over (more gain little).
Chosen by measurement: docs/performance.md "SOAP's basis refresh on streams"."""

MAX_PASSES = 4
"""Orthogonalization passes at most (module docstring): two for a warm basis."""

TF32_MASK = -8192
"""Clears the 13 low mantissa bits of a float32 (0xFFFFE000): TF32's 10-bit mantissa."""

TF32_ROUND = 4096
"""Half of TF32's last place in float32's bits (0x1000): added before the mask, rounds to nearest."""


@contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    """torch.set_float32_matmul_precision(``precision``) inside, the previous setting restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def tf32_split(x: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) with hi = x rounded to TF32 (10-bit mantissa, to nearest) and lo = x − hi (exact in float32)."""
    hi = ((x.view(torch.int32) + TF32_ROUND) & TF32_MASK).view(torch.float32)
    return hi, x - hi


def accurate_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a·b (float32, batched) to float32's accuracy. On CUDA on tensor cores: with hi/lo the TF32 split of each,
    a_hi·b_hi + (a_hi·b_lo + a_lo·b_hi) in TF32 with float32 accumulation (the dropped a_lo·b_lo and the TF32
    rounding of lo are ≤ 2⁻²² of |a|·|b| per term), three products. Elsewhere a·b in float32."""
    if not a.is_cuda:
        with float32_matmul_precision("highest"):
            return a @ b
    return split_matmul(a, b)


def split_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a_hi·b_hi + (a_hi·b_lo + a_lo·b_hi) with (hi, lo) = :func:`tf32_split`, at "high" float32 precision
    (TF32 on CUDA; float32 elsewhere, where it differs from a·b by a_lo·b_lo and rounding)."""
    a_hi, a_lo = tf32_split(a)
    b_hi, b_lo = tf32_split(b)
    with float32_matmul_precision("high"):
        return a_hi @ b_hi + (a_hi @ b_lo + a_lo @ b_hi)


def accurate_gram(q: Tensor) -> Tensor:
    """QᵀQ to float32's accuracy, as :func:`accurate_matmul` (two TF32 products on CUDA: the cross term is
    symmetric, q_hiᵀ·q_lo + (q_hiᵀ·q_lo)ᵀ)."""
    if not q.is_cuda:
        return accurate_matmul(q.mT, q)
    hi, lo = tf32_split(q)
    with float32_matmul_precision("high"):
        cross = hi.mT @ lo
        return hi.mT @ hi + (cross + cross.mT)


def cholesky_qr_pass(q: Tensor, gram: Tensor, shift: float = 0.0) -> tuple[Tensor, Tensor]:
    """One Cholesky QR step Q·R⁻¹ with RᵀR = Cholesky(G) (float32; where a batch member's Cholesky fails, of
    G + shift·I when shift > 0), and per batch member whether its Cholesky succeeded. A ``[B, k, k]`` batch with
    k above BATCH_MAX_SIDE on CUDA: one factorization and one solve per member, on SIDE_STREAMS streams."""
    one_per_member = q.is_cuda and q.ndim == 3 and q.shape[-1] > BATCH_MAX_SIDE
    if one_per_member:
        chol, info = torch.empty_like(gram), torch.empty(gram.shape[:-2], dtype=torch.int32, device=gram.device)
        for i, on_stream in _spread_over_side_streams(gram.shape[0], q.device):
            with on_stream:
                torch.linalg.cholesky_ex(gram[i], out=(chol[i], info[i]))
    else:
        chol, info = torch.linalg.cholesky_ex(gram)
    failed = info != 0
    if shift > 0 and bool(failed.any()):
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        shifted, info_shifted = torch.linalg.cholesky_ex(gram[failed] + shift * eye)
        chol[failed] = shifted
        info[failed] = info_shifted
    with float32_matmul_precision("highest"):  # cuBLAS's solve takes TF32 under "high" (module docstring)
        if one_per_member:
            q_new = torch.empty_like(q)
            for i, on_stream in _spread_over_side_streams(q.shape[0], q.device):
                with on_stream:
                    torch.linalg.solve_triangular(chol[i].mT, q[i], upper=True, left=False, out=q_new[i])
        else:
            q_new = torch.linalg.solve_triangular(chol.mT, q, upper=True, left=False)
    return q_new, info == 0


_SIDE_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}


def _spread_over_side_streams(count: int, device: torch.device) -> Iterator[tuple[int, torch.cuda.StreamContext]]:
    """(i, a context running on side stream i mod SIDE_STREAMS) for i < count. The side streams first wait for
    the current stream's work, and the current stream waits for theirs once the loop ends, so results written
    there into tensors allocated beforehand (on the current stream) are safe to use and free as usual."""
    streams = _SIDE_STREAMS.setdefault(device, [torch.cuda.Stream(device) for _ in range(SIDE_STREAMS)])
    current = torch.cuda.current_stream(device)
    used = streams[: min(count, SIDE_STREAMS)]
    for stream in used:
        stream.wait_stream(current)
    for i in range(count):
        yield i, torch.cuda.stream(used[i % len(used)])
    for stream in used:
        current.wait_stream(stream)


def upper_half(a: Tensor) -> Tensor:
    """Φ(A): A's strict upper triangle plus half its diagonal (per batch member)."""
    return torch.triu(a, 1) + torch.diag_embed(a.diagonal(dim1=-2, dim2=-1) * 0.5)


def series_pass(q: Tensor, gram: Tensor) -> Tensor:
    """Q·R⁻¹ with RᵀR = G = QᵀQ = I + F and R = I + U upper triangular, from products (module docstring):
    U₀ = Φ(F), U = Φ(F − U₀ᵀ·U₀), Q + Q·(U² − U); TF32 products on CUDA, float32 elsewhere."""
    f = gram - torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    u = upper_half(f)
    with float32_matmul_precision("high" if q.is_cuda else "highest"):
        u = upper_half(f - u.mT @ u)
        return q + q @ (u @ u - u)


def power_of_two_above(x: Tensor) -> tuple[Tensor, Tensor]:
    """(a, b) with a·b = 2⁻ᵉ, 2ᵉ⁻¹ ≤ x < 2ᵉ for x > 0 (two factors, so that neither overflows float32)."""
    exponent = torch.frexp(x).exponent.to(torch.float32)  # x = m·2^exponent, m ∈ [0.5, 1)
    first = torch.floor(exponent / 2)
    return torch.exp2(-first), torch.exp2(first - exponent)


def later_passes(q: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Passes 2 to MAX_PASSES on the first pass's output, member by member (module docstring): a member whose
    ‖F‖_F ≤ SERIES_DEFECT takes the series pass and is done; the others take a Cholesky pass, done once its
    input had max|F| ≤ ACCEPT_DEFECT. Members on the same path run as one batch (the whole batch when all
    are). Returns (Q, done, whether every Cholesky of the member succeeded), per member."""
    members = q.shape[0]
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device)
    done = [False] * members
    cholesky_ok = torch.ones(members, dtype=torch.bool, device=q.device)
    pending = list(range(members))
    for _ in range(MAX_PASSES - 1):
        q_pending = _rows(q, pending, members)
        gram = accurate_gram(q_pending)
        off = (gram - eye).nan_to_num(float("inf"))
        series, within = torch.stack(
            [torch.linalg.matrix_norm(off) <= SERIES_DEFECT, off.abs().amax(dim=(-2, -1)) <= ACCEPT_DEFECT]
        ).tolist()
        by_series = [j for j, s in enumerate(series) if s]
        by_cholesky = [j for j, s in enumerate(series) if not s]
        if by_series:
            rows = [pending[j] for j in by_series]
            q = _put_rows(
                q, rows, series_pass(_rows(q_pending, by_series, len(pending)), _rows(gram, by_series, len(pending)))
            )
        if by_cholesky:
            rows = [pending[j] for j in by_cholesky]
            q_new, passed = cholesky_qr_pass(
                _rows(q_pending, by_cholesky, len(pending)),
                _rows(gram, by_cholesky, len(pending)),
                q.shape[-1] * FLOAT32_UNIT,
            )
            q = _put_rows(q, rows, q_new)
            cholesky_ok[rows] = cholesky_ok[rows] & passed
        for j in range(len(pending)):
            done[pending[j]] = series[j] or within[j]
        pending = [i for i in pending if not done[i]]
        if not pending:
            break
    return q, torch.tensor(done, device=q.device), cholesky_ok


def _rows(x: Tensor, rows: list[int], members: int) -> Tensor:
    """``x``'s batch members ``rows`` (``x`` itself when they are all of its ``members``, in order)."""
    return x if len(rows) == members else x[rows]


def _put_rows(x: Tensor, rows: list[int], values: Tensor) -> Tensor:
    """``x`` with its batch members ``rows`` replaced by ``values`` (``values`` itself when they are all)."""
    if len(rows) == x.shape[0]:
        return values
    x[rows] = values
    return x


def power_cholqr(
    k: Tensor, q_old: Tensor, eigh: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The refresh of the module docstring on ``[B, k, k]`` factors and bases (float32, B ≥ 1).

    Returns (Q_new, values, order, fallen_back): the new bases, their eigenvalue estimates (d sorted by
    decreasing value, or eigh's eigenvalues where it took over), the permutation π of each old basis (for the
    second moment's axis) and per member whether ``eigh(K, Q_s)`` gave its basis (``eigh`` returns (values,
    basis) by decreasing value, Q_s where it fails, as :func:`dtensor_muon.rules.soap.eigh_descending`)."""
    y = accurate_matmul(k, q_old)
    d = (q_old * y).sum(dim=-2)
    order = torch.argsort(d, dim=-1, descending=True)
    index = order.unsqueeze(-2).expand_as(q_old)
    q_sorted = q_old.gather(-1, index)
    y_sorted = y.gather(-1, index)
    values = d.gather(-1, order)
    top = values[..., 0]
    usable = torch.isfinite(top) & (top > 0)
    a, b = power_of_two_above(torch.where(usable, top, torch.ones_like(top)))
    scaled = (y_sorted * a[:, None, None]) * b[:, None, None]
    # a factor without a positive finite estimate (zero, or not finite) keeps its sorted old basis: Ŷ = Q_s
    y_hat = torch.where(usable[:, None, None], scaled + SHIFT * q_sorted, q_sorted)
    y_hat = y_hat / torch.linalg.vector_norm(y_hat, dim=-2, keepdim=True)

    ok = torch.isfinite(y_hat).flatten(1).all(dim=1)
    q, chol_ok = cholesky_qr_pass(y_hat, accurate_gram(y_hat), FIRST_PASS_SHIFT)
    q, done, later_ok = later_passes(q)
    ok = ok & chol_ok & later_ok & done & torch.isfinite(q).flatten(1).all(dim=1)
    fallen_back = ~ok
    if bool(fallen_back.any()):
        for i in fallen_back.nonzero().flatten().tolist():
            values_i, q_i = eigh(k[i], q_sorted[i])
            q[i] = q_i
            values[i] = values_i
    return q, values, order, fallen_back
