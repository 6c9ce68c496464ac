"""SOAP's refresh on matrix products (``basis="cholqr"``, :mod:`dtensor_muon.linalg.eigenbasis`) against float64 references.

One refresh is Householder QR of the shifted power-iteration product, Q_new = qr((K + 10⁻⁵·2ᵉ·I)·Q_s).Q with
Q_s the old basis sorted by decreasing Rayleigh quotient d and 2ᵉ⁻¹ ≤ max d < 2ᵉ, written here in float64 from
that formula; repeated refreshes converge to float64 eigh's eigenvectors; every basis is orthogonal (max|QᵀQ − I|
in float64) on degenerate factors; a zero or NaN factor keeps its sorted basis; an old basis that is no longer
orthogonal gets eigh's. On CPU every product is float32 (the TF32 split runs on CUDA only; its arithmetic is
checked here on CPU through :func:`split_matmul`).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from dtensor_muon.linalg import eigenbasis as eb
from dtensor_muon.linalg.eigenbasis import (
    ACCEPT_DEFECT,
    BATCH_MAX_SIDE,
    FLOAT32_UNIT,
    SERIES_DEFECT,
    accurate_gram,
    power_cholqr,
    series_pass,
    split_matmul,
    tf32_split,
)
from dtensor_muon.rules.soap import SOAPRule, eigh_descending

F64 = torch.float64


def eigh(k: Tensor, fallback: Tensor) -> tuple[Tensor, Tensor]:
    return eigh_descending(k, fallback=fallback)


def defect(q: Tensor) -> float:
    """max|QᵀQ − I| in float64."""
    q = q.to(F64)
    return (q.mT @ q - torch.eye(q.shape[-1], dtype=F64)).abs().max().item()


def random_basis(k: int, seed: int) -> Tensor:
    return torch.linalg.qr(torch.randn(k, k, generator=torch.Generator().manual_seed(seed), dtype=F64)).Q.float()


def gram_factor(k: int, rank: int, seed: int, scale: float = 1.0) -> Tensor:
    g = torch.randn(k, rank, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale
    return (g @ g.T).float()


def reference_refresh(k: Tensor, q_old: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(Q_new, sorted d, order) in float64 from the formula in the module docstring (Householder QR)."""
    k64, q64 = k.to(F64), q_old.to(F64)
    d = torch.diagonal(q64.T @ k64 @ q64)
    order = torch.argsort(d, descending=True)
    shift = 1e-5 * 2.0 ** math.frexp(d.max().item())[1]
    q_new = torch.linalg.qr((k64 + shift * torch.eye(len(k64), dtype=F64)) @ q64[:, order]).Q
    return q_new, d[order], order


def test_tf32_split_is_exact_and_keeps_ten_mantissa_bits():
    x = torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-20, 20, 300)
    hi, lo = tf32_split(x)
    assert torch.equal(hi + lo, x)
    assert bool(((hi.view(torch.int32) & 0x1FFF) == 0).all())  # the 13 low mantissa bits clear
    assert (lo.abs() / x.abs()).max().item() <= 2.0**-11  # rounded to nearest: half of TF32's last place


def test_split_product_is_float32_accurate():
    """a_hi·b_hi + a_hi·b_lo + a_lo·b_hi against the float64 product: relative error ≤ 2e-6 of max|a·b|
    (measured 6.6e-7 for 256×256; plain float32 4.9e-7)."""
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(256, 256, generator=gen), torch.randn(256, 256, generator=gen)
    want = a.to(F64) @ b.to(F64)
    err = ((split_matmul(a, b).to(F64) - want).abs().max() / want.abs().max()).item()
    assert err <= 2e-6, err


def test_series_pass_equals_float64_cholesky_qr_of_a_near_orthogonal_basis():
    """A batch of 3 bases Q off orthogonal by ‖QᵀQ − I‖_F ≈ 0.7·SERIES_DEFECT (k = 64): the series pass gives
    float64 Cholesky QR's Q·R⁻¹ within 2e-7 (entry-wise; measured 7.4e-8, the float32 Cholesky pass 9.1e-8) and
    a basis orthogonal within 1e-6 (measured 3.4e-7), where Q itself was off by 4e-5 (max|QᵀQ − I|)."""
    k = 64
    gen = torch.Generator().manual_seed(70)
    exact = torch.stack([random_basis(k, 71 + i).to(F64) for i in range(3)])
    noise = torch.randn(3, k, k, generator=gen, dtype=F64)
    q = (exact + noise * (SERIES_DEFECT / 2 / noise.norm(dim=(-2, -1), keepdim=True))).float()
    gram = accurate_gram(q)
    f_norm = torch.linalg.matrix_norm(gram.to(F64) - torch.eye(k, dtype=F64))
    assert bool((f_norm <= SERIES_DEFECT).all()) and bool((f_norm >= SERIES_DEFECT / 2).all()), f_norm
    q64 = q.to(F64)
    r = torch.linalg.cholesky(q64.mT @ q64).mT
    want = torch.linalg.solve_triangular(r, q64, upper=True, left=False)
    got = series_pass(q, gram)
    assert (got.to(F64) - want).abs().max().item() <= 2e-7
    assert max(defect(g) for g in got) <= 1e-6
    assert min(defect(g) for g in q) >= 2e-5


def float32_gamma(n: int) -> float:
    """γₙ = n·u/(1 − n·u), u = 2⁻²⁴: a float32 sum of n products differs from the exact one by at most γₙ times
    the sum of their absolute values, whatever the order of the additions."""
    return n * FLOAT32_UNIT / (1 - n * FLOAT32_UNIT)


def at_most(low: float, high: float, threshold: float) -> bool | None:
    """Whether a value known to lie in [low, high] is ≤ ``threshold``; None where the interval holds it."""
    return True if high <= threshold else False if low > threshold else None


def pass_choice(x: Tensor) -> tuple[bool | None, bool | None]:
    """(series, ends) of a later pass on the basis ``x`` (k×k, float32) by the rule of
    :func:`dtensor_muon.linalg.eigenbasis.later_passes`, from F = XᵀX − I in float64: the series pass where
    ‖F‖_F ≤ SERIES_DEFECT (it ends the member's passes), else a Cholesky pass, which ends them where
    max|F| ≤ ACCEPT_DEFECT. The float32 Gram matrix the refresh reads is within γ_k·|X|ᵀ|X| of XᵀX entrywise, and
    its float32 Frobenius norm within γ_{k²+2} relative of the exact one: each answer is None where an error
    that large could tip it."""
    k = x.shape[-1]
    x64 = x.to(F64)
    f = x64.T @ x64 - torch.eye(k, dtype=F64)
    rounding = float32_gamma(k) * (x64.abs().T @ x64.abs())
    fro, fro_rounding = torch.linalg.matrix_norm(f).item(), torch.linalg.matrix_norm(rounding).item()
    relative = float32_gamma(k * k + 2)
    series = at_most((fro - fro_rounding) * (1 - relative), (fro + fro_rounding) * (1 + relative), SERIES_DEFECT)
    ends = at_most((f.abs() - rounding).max().item(), (f.abs() + rounding).max().item(), ACCEPT_DEFECT)
    return series, True if series else ends


def with_singular_values(values: Tensor, seed: int) -> Tensor:
    """U·diag(values)·Vᵀ with U, V random orthogonal (float64, then rounded to float32)."""
    u, v = random_basis(len(values), seed).to(F64), random_basis(len(values), seed + 1).to(F64)
    return ((u * values) @ v.T).float()


def test_members_of_a_batch_take_their_own_passes(monkeypatch):
    """later_passes on a batch of four k = 40 bases X, each off orthogonal by a set amount in exact arithmetic:
    singular values from 1 down to 10^-3.5 (a Cholesky pass leaves such a basis up to about 2⁻²⁴·cond² ≈ 0.6 off
    orthogonal, :mod:`dtensor_muon.linalg.eigenbasis`: two Cholesky passes, then the series), an orthogonal one (the series at
    once), singular values in [0.8, 1.25] (a Cholesky pass, then the series) and XᵀX = I + F with every
    off-diagonal |F_ij| = ACCEPT_DEFECT/2 (‖F‖_F ≈ 0.02 > SERIES_DEFECT: one Cholesky pass, which ends its
    passes). Every pass is replayed from the float64 Gram matrix of each member's actual input
    (:func:`pass_choice`): which members take the series and which a Cholesky pass, each member's input its own
    previous output, which members go on, and which are done at the end. The four members take four
    different sequences of passes; every Cholesky succeeds; each basis ends orthogonal and is the Q factor of
    its input (QᵀX upper triangular), within first-order bounds of float32's rounding."""
    calls: list[tuple[str, Tensor, Tensor]] = []  # (function, its input Q, its output: Q, or the Gram matrix)
    gram_of, series_pass_of, cholesky_pass_of = eb.accurate_gram, eb.series_pass, eb.cholesky_qr_pass

    def gram(q: Tensor) -> Tensor:
        out = gram_of(q)
        calls.append(("gram", q.clone(), out))
        return out

    def series(q: Tensor, gram: Tensor) -> Tensor:
        out = series_pass_of(q, gram)
        calls.append(("series", q.clone(), out.clone()))
        return out

    def cholesky(q: Tensor, gram: Tensor, shift: float = 0.0) -> tuple[Tensor, Tensor]:
        out, passed = cholesky_pass_of(q, gram, shift)
        calls.append(("cholesky", q.clone(), out.clone()))
        return out, passed

    monkeypatch.setattr(eb, "accurate_gram", gram)
    monkeypatch.setattr(eb, "series_pass", series)
    monkeypatch.setattr(eb, "cholesky_qr_pass", cholesky)
    k = 40
    signs = (torch.randint(0, 2, (k, k), generator=torch.Generator().manual_seed(68), dtype=F64) * 2 - 1).triu(1)
    values, vectors = torch.linalg.eigh(torch.eye(k, dtype=F64) + ACCEPT_DEFECT / 2 * (signs + signs.T))
    inputs = torch.stack(
        [
            with_singular_values(torch.logspace(0, -3.5, k, dtype=F64), seed=60),
            random_basis(k, 62),
            with_singular_values(torch.linspace(0.8, 1.25, k, dtype=F64), seed=64),
            (random_basis(k, 66).to(F64) @ (vectors * values.sqrt()) @ vectors.T).float(),  # Q·(I + F)^½
        ]
    )
    q_out, done, cholesky_ok = eb.later_passes(inputs.clone())

    current = list(inputs)  # each member's input to its next pass
    taken: list[list[str]] = [[] for _ in current]
    ends: list[bool | None] = [False] * len(current)  # whether the member's last pass ended its passes
    last_input = list(inputs)

    def members(q: Tensor, among: list[int]) -> list[int]:
        """The members of ``among`` whose current input is a row of ``q``, in order."""
        return [i for i in among if any(torch.equal(current[i], row) for row in q)]

    pending, position = list(range(len(current))), 0
    for _ in range(eb.MAX_PASSES - 1):
        name, q, _ = calls[position]
        assert name == "gram" and torch.equal(q, torch.stack([current[i] for i in pending])), (name, pending)
        position += 1
        choices = {i: pass_choice(current[i]) for i in pending}
        took: dict[int, str] = {}
        while position < len(calls) and calls[position][0] != "gram":  # this pass's series and Cholesky calls
            name, q, out = calls[position]
            position += 1
            rows = members(q, pending)
            assert torch.equal(q, torch.stack([current[i] for i in rows])) and not set(rows) & set(took), name
            for i, row in zip(rows, out):
                took[i], last_input[i], current[i] = name, current[i], row
                taken[i].append(name)
        assert sorted(took) == pending
        for i in pending:
            series, end = choices[i]
            assert series is None or series == (took[i] == "series"), (i, taken[i], choices[i])
            ends[i] = True if took[i] == "series" else end
        if position == len(calls):
            break
        # the next pass's Gram matrix names the members that go on: none whose pass ended by the rule, and
        # every one whose pass did not (where float32 rounding could tip the rule, either)
        going_on = members(calls[position][1], pending)
        assert all(ends[i] is not True for i in going_on) and all(
            ends[i] is not False for i in pending if i not in going_on
        )
        for i in pending:
            ends[i] = i not in going_on
        pending = going_on
    assert position == len(calls)
    assert all(e is None or e == d for e, d in zip(ends, done.tolist())), (ends, done)
    assert done.all() and cholesky_ok.all() and len({tuple(t) for t in taken}) == len(taken), taken
    for i, (x, q) in enumerate(zip(inputs, q_out)):
        x64, q64 = x.to(F64), q.to(F64)
        # first order, for a last Cholesky pass: its float32 Gram matrix (γ_k), Cholesky (γ_{k+1}) and solve (γ_k,
        # on either side of QᵀQ) each err by ≤ γ_{k+1}·|x_i|·|x_j| entrywise, and R⁻¹ on both sides multiplies
        # that by at most cond² of the pass's input; a last series pass is within ‖F‖³ + 2u·|Q|ᵀ|Q|, smaller
        cond = torch.linalg.cond(last_input[i].to(F64)).item()
        assert defect(q) <= 4 * float32_gamma(k + 1) * cond**2, (i, defect(q))
        # each pass's solve (or series) is backward stable: X = Q·R + ΔX, R upper triangular, ‖ΔX‖_F growing by
        # ≤ γ_{k+1}·‖Q‖_F·‖R‖_F ≤ γ_{k+1}·k·‖X‖₂ a pass (doubled for Q and R above their first-order sizes);
        # QᵀX = R + (QᵀQ − I)·R + Qᵀ·ΔX, so its strict lower triangle is within the last two terms
        lower = torch.linalg.matrix_norm(torch.tril(q64.T @ x64, -1)).item()
        orthogonality = torch.linalg.matrix_norm(q64.T @ q64 - torch.eye(k, dtype=F64)).item()
        norm = torch.linalg.matrix_norm(x64, ord=2).item()
        assert lower <= norm * (orthogonality + 2 * len(taken[i]) * k * float32_gamma(k + 1)), (i, lower)


@pytest.mark.parametrize("rank", [64, 12])
def test_one_refresh_equals_float64_householder_qr_of_the_shifted_product(rank):
    """A warm basis (float64 eigh of the factor one gradient before, K ← 0.95·K + 0.05·gᵀg as SOAP's moving
    average): the same order and sorted estimates as the float64 formula (1e-5 relative) and the same basis up
    to column signs, as close to it as float32 Householder QR of the same product (max entry difference ≤ 2×
    Householder's + 1e-6; measured 1.8e-7 against 2.5e-7 for a full-rank factor, 3.6e-4 against 3.3e-4 for
    the rank-24 one, whose eigenvectors of eigenvalues near float32's rounding are that sensitive)."""
    k = 40
    before = gram_factor(k, rank, seed=2)
    _, q_old = eigh_descending(before)
    factor = 0.95 * before + 0.05 * gram_factor(k, rank, seed=3)
    q_new, values, order, fallen_back = power_cholqr(factor[None], q_old[None], eigh)
    want_q, want_values, want_order = reference_refresh(factor, q_old)
    assert not bool(fallen_back[0])
    assert torch.equal(order[0], want_order)
    assert torch.allclose(values[0].to(F64), want_values, rtol=1e-5, atol=1e-5 * want_values[0].item())
    shift = 1e-5 * 2.0 ** math.frexp(want_values[0].item())[1]
    householder = torch.linalg.qr((factor + shift * torch.eye(k)) @ q_old[:, want_order]).Q

    def error(q: Tensor) -> float:
        signs = torch.sign(torch.diagonal(want_q.T @ q.to(F64)))
        return (q.to(F64) - want_q * signs).abs().max().item()

    assert error(q_new[0]) <= 2 * error(householder) + 1e-6
    assert defect(q_new[0]) <= 1e-5


def test_repeated_refreshes_converge_to_float64_eigenvectors():
    """Eigenvalues 10^(−3i/23), i < 24, from a random basis: after 80 refreshes every column is ± float64 eigh's
    eigenvector (|cos| ≥ 1 − 1e-6) and the estimates are its eigenvalues (1e-5 relative)."""
    k = 24
    u = random_basis(k, 4).to(F64)
    lam = torch.logspace(0, -3, k, dtype=F64)
    factor = ((u * lam) @ u.T).float()
    q = random_basis(k, 5)
    for _ in range(80):
        q_new, values, _, fallen_back = power_cholqr(factor[None], q[None], eigh)
        assert not bool(fallen_back[0])
        q = q_new[0]
    want_values, want_vectors = torch.linalg.eigh(factor.to(F64))
    want_values, want_vectors = want_values.flip(0), want_vectors.flip(1)
    cos = torch.diagonal(want_vectors.T @ q.to(F64)).abs()
    assert cos.min().item() >= 1 - 1e-6, cos
    assert torch.allclose(values[0].to(F64), want_values, rtol=1e-5, atol=0)


def degenerate_factors(k: int) -> dict[str, Tensor]:
    """k×k factors SOAP can hold: rank 1, rank 8, ill-conditioned (eigenvalues 1e-12 … 1), rank 8 of a gradient
    of size 1e-18 (entries ~1e-36) and of size 1e18 (entries ~1e36)."""
    u = random_basis(k, 6).to(F64)
    return {
        "rank-1": gram_factor(k, 1, seed=7),
        "rank-8": gram_factor(k, 8, seed=8),
        "ill-conditioned": ((u * torch.logspace(0, -12, k, dtype=F64)) @ u.T).float(),
        "rank-8 tiny": gram_factor(k, 8, seed=9, scale=1e-18),
        "rank-8 huge": gram_factor(k, 8, seed=10, scale=1e18),
    }


@pytest.mark.parametrize("start", ["random", "warm"])
def test_bases_are_orthogonal_on_degenerate_factors(start):
    """All five factors refreshed as one batch, from a random orthogonal basis or from float64 eigh's basis of
    the factor before a new rank-8 gradient (a new direction in a rank-deficient factor): every basis orthogonal
    to 1e-5 in float64 (measured ≤ 4.2e-7) and no eigh. A rank-1 factor's first column is its direction
    (|cos| ≥ 1 − 1e-6)."""
    k = 40
    factors = degenerate_factors(k)
    olds, news = [], []
    for i, factor in enumerate(factors.values()):
        if start == "random":
            olds.append(random_basis(k, 11 + i))
            news.append(factor)
        else:
            olds.append(eigh_descending(factor)[1])
            scale = factor.abs().max().sqrt().item() / 10
            news.append(0.95 * factor + 0.05 * gram_factor(k, 8, seed=20 + i, scale=scale))
    q_new, values, _, fallen_back = power_cholqr(torch.stack(news), torch.stack(olds), eigh)
    for name, q, fell in zip(factors, q_new, fallen_back):
        assert defect(q) <= 1e-5, (name, defect(q))
        assert not bool(fell), name
    assert torch.isfinite(values).all()
    if start == "random":
        g = torch.randn(k, 1, generator=torch.Generator().manual_seed(7), dtype=F64)[:, 0]
        cos = (q_new[0, :, 0].to(F64) @ g).abs() / g.norm()
        assert cos.item() >= 1 - 1e-6


def test_a_zero_or_nan_factor_keeps_its_sorted_basis():
    """A zero factor (a matrix whose gradients were all zero) and a NaN one: the new basis is the old one with
    its columns sorted by d (within 1e-6), the estimates d (0, or NaN), no eigh."""
    k = 16
    old = torch.stack([random_basis(k, 30), random_basis(k, 31)])
    factors = torch.stack([torch.zeros(k, k), torch.full((k, k), float("nan"))])
    q_new, values, order, fallen_back = power_cholqr(factors, old, eigh)
    for i in range(2):
        assert (q_new[i] - old[i][:, order[i]]).abs().max().item() <= 1e-6
    assert torch.equal(values[0], torch.zeros(k)) and values[1].isnan().all()
    assert not bool(fallen_back.any())


def test_an_old_basis_that_lost_orthogonality_gets_eigh_or_is_repaired():
    """An old basis with a zero column: its product has a zero column, so the refresh cannot vouch for a
    Cholesky QR and takes eigh, whose basis diagonalizes K (off-diagonal of QᵀKQ ≤ 1e-5 of max|K| in float64)
    with float64's eigenvalues (1e-5 relative); the healthy factor of the same batch does not. An old basis with
    two equal columns is repaired by the shifted Cholesky QR passes themselves (orthogonal to 1e-5, no eigh)."""
    k = 16
    factor = gram_factor(k, 32, seed=40)
    broken = random_basis(k, 41)
    broken[:, 1] = 0.0
    duplicated = random_basis(k, 43)
    duplicated[:, 1] = duplicated[:, 0]
    q_new, values, _, fallen_back = power_cholqr(
        torch.stack([factor, factor, factor]), torch.stack([broken, random_basis(k, 42), duplicated]), eigh
    )
    assert fallen_back.tolist() == [True, False, False]
    assert defect(q_new[2]) <= 1e-5
    q = q_new[0].to(F64)
    b = q.T @ factor.to(F64) @ q
    assert (b - torch.diag(b.diagonal())).abs().max().item() <= 1e-5 * factor.abs().max().item()
    want = torch.linalg.eigvalsh(factor.to(F64)).flip(0)
    assert torch.allclose(values[0].to(F64), want, rtol=1e-5, atol=1e-5 * want[0].item())


def unit_group(kl: bool, precondition_frequency: int) -> dict:
    """A SOAPRule group of basis="cholqr" (units batched), the front ends' clip and first-step skip, both sides of
    the tests' 6×10 matrices preconditioned."""
    return dict(
        betas=(0.9, 0.95), shampoo_beta=0.95, eps=1e-8, precondition_frequency=precondition_frequency,
        basis="cholqr", kl=kl, max_preconditioner_dim=64, correct_bias=True, correct_shampoo_beta_bias=True,
        max_update_rms=1.0, match_update_rms=0.0, skip_first_update=True,
    )  # fmt: skip


def factor_condition(states: list[dict[str, torch.Tensor]]) -> float:
    """max over the states' factors K of max λ(K) / (smallest gap between K's eigenvalues), in float64, over the
    eigenvalues above 10⁻⁶·max λ (the null space's directions carry no gradient, so the update does not see how
    a computation rotates them): how far a relative change of K moves its eigenvectors (Davis–Kahan)."""
    worst = 0.0
    for s in states:
        for side in ("L", "R"):
            values = torch.linalg.eigvalsh(s[side].to(F64))
            values = values[values > 1e-6 * values.max()]
            if len(values) > 1:
                worst = max(worst, (values.max() / values.diff().min()).item())
    return worst


@pytest.mark.parametrize("kl", [False, True])
def test_a_batch_of_matrices_equals_each_alone(kl: bool):
    """SOAPRule.direction on a unit of 3 same-shape matrices ([3, 6, 10], basis="cholqr": factors, Adam and the
    refresh as batched operations) against the 3 matrices one at a time, over 4 steps (eigh on step 1, the
    batched refresh after). The batched products round differently from the single ones: a factor changes by at
    most γ₁₀ = 10·u relative (u = 2⁻²⁴, 10-term dot products), its eigenvectors by that times the factors'
    condition κ (:func:`factor_condition`), and the update, linear in both bases, by about twice that per step;
    so every update within 32·u·κ (κ the largest so far) of the largest entry (measured at most 0.35·u·κ)."""
    rule = SOAPRule()
    group = unit_group(kl=kl, precondition_frequency=1)
    assert rule.can_batch(group)
    gen = torch.Generator().manual_seed(50)
    batched = [rule.init_owner_state((6, 10), group, torch.device("cpu")) for _ in range(3)]
    alone = [rule.init_owner_state((6, 10), group, torch.device("cpu")) for _ in range(3)]
    condition, largest_change = 0.0, 0.0
    for _ in range(4):
        grads = torch.randn(3, 6, 10, generator=gen)
        got = rule.direction(grads, batched, group, None)
        want = torch.stack([rule.direction(g, [s], group, None) for g, s in zip(grads, alone)])
        assert got.shape == (3, 6, 10)
        condition = max(condition, factor_condition(alone))
        largest_change = max(largest_change, want.abs().max().item())
        bound = 32 * 2**-24 * condition * want.abs().max().item() + 1e-12
        assert (got - want).abs().max().item() <= bound
        assert [int(s["step"]) for s in batched] == [int(s["step"]) for s in alone]
    assert largest_change > 0.1  # steps 2–4 moved every matrix


def test_a_unit_at_mixed_steps_in_batches_of_one_equals_each_alone_bitwise(monkeypatch: pytest.MonkeyPatch):
    """A unit of 3 whose middle matrix is one step ahead (its own batch), with at most one matrix's state per
    stacked tensor (``LARGE_BATCH_ENTRIES`` lowered): every matrix then runs alone, so the unit's updates and
    states equal those of the matrices one at a time bit for bit, in the unit's order."""
    from dtensor_muon.rules import soap

    rule = SOAPRule()
    group = unit_group(kl=True, precondition_frequency=2)
    gen = torch.Generator().manual_seed(51)
    batched = [rule.init_owner_state((6, 10), group, torch.device("cpu")) for _ in range(3)]
    alone = [rule.init_owner_state((6, 10), group, torch.device("cpu")) for _ in range(3)]
    ahead = torch.randn(6, 10, generator=gen)
    rule.direction(ahead, [batched[1]], group, None)
    rule.direction(ahead, [alone[1]], group, None)
    monkeypatch.setattr(soap, "LARGE_BATCH_ENTRIES", 100)  # fewer than one matrix's 6·10 + factors
    for _ in range(3):
        grads = torch.randn(3, 6, 10, generator=gen)
        got = rule.direction(grads, batched, group, None)
        want = torch.stack([rule.direction(g, [s], group, None) for g, s in zip(grads, alone)])
        assert torch.equal(got, want)
        assert want.abs().max().item() > 0.1
    for b, a in zip(batched, alone):
        assert all(torch.equal(b[k], a[k]) for k in a)
    assert [int(s["step"]) for s in batched] == [3, 4, 3]


def test_experts_batched_by_the_plan_equal_each_expert_alone():
    """16 experts of 6×10 in one [16, 6, 10] parameter: with basis="cholqr" the plan stacks them in units of 2
    (16 experts ÷ 8 units a parameter) and the engine hands each unit to the rule at once; 4 steps equal the
    same experts as 16 separate 2-D parameters within 1e-5 of the largest change (measured 1.4e-6)."""
    from dtensor_muon import SOAP
    from dtensor_muon.plan import build_plan
    from dtensor_muon.plan.simulate import fsdp_layout

    layout = fsdp_layout("layers.0.moe.experts.w1", (16, 6, 10), 1)
    plan = build_plan([layout], [0], 64 * 2**20, 4, batchable=[True])
    assert {len(unit.members) for unit in plan.units} == {2}

    gen = torch.Generator().manual_seed(60)
    w0 = torch.randn(16, 6, 10, generator=gen)
    grads = [torch.randn(16, 6, 10, generator=gen) for _ in range(4)]
    stacked = torch.nn.Parameter(w0.clone())
    singles = [torch.nn.Parameter(w0[i].clone()) for i in range(16)]
    opt = SOAP([("layers.0.moe.experts.w1", stacked)], basis="cholqr", lr=0.01)
    alone = SOAP([(f"layers.0.e{i}.weight", p) for i, p in enumerate(singles)], basis="cholqr", lr=0.01)
    for g in grads:
        stacked.grad = g.clone()
        for i, p in enumerate(singles):
            p.grad = g[i].clone()
        opt.step()
        alone.step()
    change = (stacked.detach() - w0).abs().max().item()
    diff = (stacked.detach() - torch.stack([p.detach() for p in singles])).abs().max().item()
    assert change > 0.01 and diff <= 1e-5 * change, (diff, change)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_large_factors_on_side_streams_equal_each_alone_on_cuda():
    """Three warm factors of k = 1024 (> BATCH_MAX_SIDE: batched products, one Cholesky and one solve per factor
    on side streams) refreshed at once: each basis within 1e-6 of its refresh alone (measured 6e-8 on an
    H200), orthogonal within 1e-5 in float64, none fallen back to eigh, the same order and estimates (1e-6)."""
    k = 1024
    assert k > BATCH_MAX_SIDE
    factors, bases = [], []
    for seed in range(3):
        before = gram_factor(k, 2 * k, seed=80 + seed, scale=1 / k)
        bases.append(eigh_descending(before)[1])
        factors.append(0.95 * before + 0.05 * gram_factor(k, 2 * k, seed=90 + seed, scale=1 / k))
    factor, q_old = torch.stack(factors).cuda(), torch.stack(bases).cuda()
    q_new, values, order, fallen_back = power_cholqr(factor, q_old, eigh)
    assert not bool(fallen_back.any())
    for i in range(3):
        q_i, values_i, order_i, _ = power_cholqr(factor[i : i + 1], q_old[i : i + 1], eigh)
        assert torch.equal(order[i], order_i[0])
        assert torch.allclose(values[i], values_i[0], rtol=1e-6, atol=0)
        assert (q_new[i] - q_i[0]).abs().max().item() <= 1e-6
        assert defect(q_new[i].cpu()) <= 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_refresh_is_the_same_at_every_float32_matmul_precision_on_cuda():
    """A warm refresh at k = 1024 under torch's "high" float32 matmul precision (TF32, which cuBLAS's
    triangular solve would take) gives the bits of the refresh under "highest": every product and solve of
    the refresh sets its own precision."""
    k = 1024
    before = gram_factor(k, 2 * k, seed=70, scale=1 / k)
    q_old = eigh_descending(before)[1].cuda()
    factor = (0.95 * before + 0.05 * gram_factor(k, 2 * k, seed=71, scale=1 / k)).cuda()
    results = {}
    previous = torch.get_float32_matmul_precision()
    try:
        for precision in ("highest", "high"):
            torch.set_float32_matmul_precision(precision)
            results[precision] = power_cholqr(factor[None], q_old[None], eigh)
    finally:
        torch.set_float32_matmul_precision(previous)
    for got, want in zip(results["high"], results["highest"]):
        assert torch.equal(got, want)
