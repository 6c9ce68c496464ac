"""SOAP, KL-SOAP and REKLS: a float64 reference written from the formulas, Shard(0) DTensors = one process.

The reference below uses no library code. Per m×n matrix G at step t = 1, 2, … (β = shampoo_beta, ε = eps):

    β_t = 1 − (1 − β)/(1 − βᵗ) with the factors' bias correction, else β
    SOAP: L ← β_t·L + (1 − β_t)·G·Gᵀ,  R ← β_t·R + (1 − β_t)·Gᵀ·G               (L, R start at 0)
    KL:   L ← β_t·L + (1 − β_t)/n·G·Q_R·Λ_R⁻¹·Q_Rᵀ·Gᵀ,  R likewise with 1/m and Λ_L,
          Λ = max(diag(Qᵀ·K·Q), ε) of the factors before the update, Q of the previous step (I at t = 1)
    refresh when (t − 1) mod precondition_frequency = 0: d = diag(Q_oldᵀ·K·Q_old), Q_old's columns and V's
          axis sorted by decreasing d (both bases, as Emerging-Optimizers 0.3); M back with the old Q, into the
          new one; t = 1 or basis "eigh": Q = eigenvectors of K by decreasing eigenvalue; "qr": Q = qr(K·Q_old);
          "cholqr": Q = qr((K + 10⁻⁵·2ᵉ·I)·Q_old), 2ᵉ⁻¹ ≤ max d < 2ᵉ (Householder QR here, in float64)
    G' = Q_Lᵀ·G·Q_R; M ← β₁M + (1 − β₁)G'; V ← β₂V + (1 − β₂)G'²; N = M̂/(√V̂ + ε) (bias-corrected with t
          or not); O = Q_L·N·Q_Rᵀ (scaled to RMS ρ' when match_update_rms = ρ' > 0, then clipped to RMS ρ when
          max_update_rms = ρ > 0); θ ← θ·(1 − γλ) − γ·O
    a side longer than max_preconditioner_dim: Q = I, no factor (with KL the other side uses Λ = 1 there)

The bases are compared only through θ, which does not depend on the signs of the basis columns (a flipped
column flips its row of G' and M, N, and the product Q·N back; Householder QR commutes with column signs).
It does depend on the basis of a factor's null space: the first gradient of a non-square matrix leaves a
rank-deficient factor, whose null-space eigenvectors eigh picks freely, and the QR refresh carries that choice
on. So the first gradient here is zero outside its leading min(m, n) block: the null spaces are then spanned
by coordinate vectors, which float32 and float64 eigh both return (up to sign and order, neither of which
matters), and later gradients are dense. The sort of V pairs old columns with new ones, so θ also depends on
the old basis of a null space; here every preconditioned factor has full rank from step 2 on (the wide 9-side
and the tall 8-side get rank 5 a step), so only step 1's coordinate null spaces are ever sorted.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import scenarios
import torch
from dist_harness import one_thread, requires_cuda, run_distributed
from torch import Tensor

from dtensor_muon import KLSOAP, REKLS, SOAP
from dtensor_muon.rules import soap as soap_rule

SHAPES = [("layers.0.wide", (5, 9)), ("layers.0.tall", (8, 5)), ("layers.0.long", (4, 13))]
MAX_DIM = 10  # the long matrix's 13 columns are not preconditioned
STEPS = 5
FIRST_DIAGONAL = torch.tensor([3.0, -2.5, 2.0, 1.5, -1.0])  # distinct squares: distinct first eigenvalues
VARIANTS: dict[str, tuple[Any, dict[str, Any]]] = {
    "soap": (SOAP, dict(kl=False, basis="qr")),
    "soap-eigh": (partial(SOAP, basis="eigh"), dict(kl=False, basis="eigh")),
    "soap-cholqr": (partial(SOAP, basis="cholqr"), dict(kl=False, basis="cholqr")),
    "klsoap": (KLSOAP, dict(kl=True, basis="qr")),
    "klsoap-cholqr": (partial(KLSOAP, basis="cholqr"), dict(kl=True, basis="cholqr")),
    "rekls": (REKLS, dict(kl=True, basis="eigh")),
}


PREVIOUS_DEFAULTS = dict(skip_first_update=False, max_update_rms=0.0)
"""The defaults before the skipped first step and the RMS clip: Emerging-Optimizers 0.3's SOAP."""


def integer_ish_problem(steps: int = STEPS, seed: int = 0) -> tuple[list[Tensor], list[list[Tensor]]]:
    """Parameters and gradients on a grid of 1/8 (float32); the first gradient zero outside its leading
    min(m, n) × min(m, n) block (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)

    def grid(shape: tuple[int, int]) -> Tensor:
        return torch.randn(shape, generator=gen).mul(8).round().div(8)

    params = [grid(shape) for _, shape in SHAPES]
    grads = []
    for step in range(steps):
        row = []
        for _, (m, n) in SHAPES:
            g = grid((m, n))
            if step == 0:
                g = torch.zeros(m, n)
                k = min(m, n)
                g[range(k), range(k)] = FIRST_DIAGONAL[:k]
            row.append(g)
        grads.append(row)
    return params, grads


def soap_reference(
    p0: Tensor,
    grads: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    shampoo_beta: float,
    eps: float,
    weight_decay: float,
    precondition_frequency: int,
    basis: str,
    kl: bool,
    max_preconditioner_dim: int,
    correct_bias: bool,
    correct_shampoo_beta_bias: bool,
    max_update_rms: float = 0.0,
    match_update_rms: float = 0.0,
    eigh_sorts_second_moment: bool = True,
    skip_first_update: bool = False,
) -> Tensor:
    """θ after SOAP's steps on one matrix, in float64 (see the module docstring); with
    ``eigh_sorts_second_moment=False`` an eigh refresh keeps V's order (the behaviour before Emerging-Optimizers
    0.3, for tests that show the sort is seen); with ``skip_first_update`` step 1 only updates the factors and
    the bases (θ ← θ·(1 − γλ)) and Adam's bias corrections count from step 2 (τ = t − 1)."""
    f64 = torch.float64
    theta = p0.to(f64).clone()
    m, n = theta.shape
    keep = [m <= max_preconditioner_dim, n <= max_preconditioner_dim]
    factors = [torch.zeros(m, m, dtype=f64), torch.zeros(n, n, dtype=f64)]
    bases = [torch.eye(m, dtype=f64), torch.eye(n, dtype=f64)]
    exp_avg = torch.zeros(m, n, dtype=f64)
    exp_avg_sq = torch.zeros(m, n, dtype=f64)
    beta1, beta2 = betas
    for t, g32 in enumerate(grads, start=1):
        g = g32.to(f64)
        bt = 1 - (1 - shampoo_beta) / (1 - shampoo_beta**t) if correct_shampoo_beta_bias else shampoo_beta
        if kl:
            inverses = []
            for side, size in ((0, m), (1, n)):
                if keep[side]:
                    q = bases[side]
                    lam = torch.diagonal(q.T @ factors[side] @ q).clamp_min(eps)
                    inverses.append(q @ torch.diag(1 / (size * lam)) @ q.T)
                else:
                    inverses.append(torch.eye(size, dtype=f64) / size)
            new = [g @ inverses[1] @ g.T, g.T @ inverses[0] @ g]
        else:
            new = [g @ g.T, g.T @ g]
        for side in (0, 1):
            if keep[side]:
                factors[side] = bt * factors[side] + (1 - bt) * new[side]
        if (t - 1) % precondition_frequency == 0:
            momentum = bases[0] @ exp_avg @ bases[1].T
            for side in (0, 1):
                if not keep[side]:
                    continue
                k, q = factors[side], bases[side]
                order = torch.argsort(torch.diagonal(q.T @ k @ q), descending=True)
                eigh = t == 1 or basis == "eigh"
                if eigh_sorts_second_moment or not eigh:
                    exp_avg_sq = exp_avg_sq.index_select(side, order)
                if eigh:
                    values, vectors = torch.linalg.eigh(k)
                    bases[side] = vectors[:, torch.argsort(values, descending=True)]
                elif basis == "cholqr":
                    top = torch.diagonal(q.T @ k @ q).max().item()
                    shift = 1e-5 * 2.0 ** math.frexp(top)[1] if top > 0 else 0.0
                    bases[side] = torch.linalg.qr((k + shift * torch.eye(len(k), dtype=f64)) @ q[:, order]).Q
                else:
                    bases[side] = torch.linalg.qr(k @ q[:, order]).Q
            exp_avg = bases[0].T @ momentum @ bases[1]
        if skip_first_update and t == 1:
            theta = theta * (1 - lr * weight_decay)
            continue
        tau = t - 1 if skip_first_update else t
        projected = bases[0].T @ g @ bases[1]
        exp_avg = beta1 * exp_avg + (1 - beta1) * projected
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * projected**2
        if correct_bias:
            normalized = (exp_avg / (1 - beta1**tau)) / ((exp_avg_sq / (1 - beta2**tau)).sqrt() + eps)
        else:
            normalized = exp_avg / (exp_avg_sq.sqrt() + eps)
        update = bases[0] @ normalized @ bases[1].T
        if match_update_rms > 0:
            update = update * (match_update_rms / (update.square().mean().sqrt().item() + 1e-7))
        if max_update_rms > 0:
            rms = update.square().mean().sqrt().item()
            update = update * min(1.0, max_update_rms / (rms + 1e-7))
        theta = theta * (1 - lr * weight_decay) - lr * update
    return theta


def relative_to_change(got: Tensor, want: Tensor, p0: Tensor) -> float:
    """‖θ − θ_ref‖ / ‖θ_ref − θ₀‖ (the error measured against how far the steps moved θ)."""
    p0 = p0.to(torch.float64)
    return (torch.linalg.vector_norm(got.to(torch.float64) - want) / torch.linalg.vector_norm(want - p0)).item()


CASES = (
    [
        (variant, freq, bias, rms, 1e-2)
        for variant in ("soap", "klsoap")
        for freq, bias, rms in ((1, True, 0.0), (2, True, 0.0), (1, False, 0.0), (2, False, 0.0), (1, True, 0.5))
    ]
    + [
        (variant, freq, bias, rms, eps)
        for variant, eps in (("soap-eigh", 1e-2), ("rekls", 1.0))
        for freq, bias, rms in ((1, True, 0.0), (2, True, 0.0), (1, False, 0.0), (2, False, 0.0), (1, True, 0.5))
    ]
    + [("soap-cholqr", freq, bias, rms, 1e-2) for freq, bias, rms in ((1, True, 0.0), (2, False, 0.0), (1, True, 0.5))]
    + [("klsoap-cholqr", 1, True, 0.0, 1e-2)]
)


@pytest.mark.parametrize("variant, precondition_frequency, bias, max_update_rms, eps", CASES)
def test_one_process_equals_float64_reference(variant, precondition_frequency, bias, max_update_rms, eps):
    check_against_reference(variant, precondition_frequency, bias, eps, max_update_rms=max_update_rms)


@pytest.mark.parametrize("variant", ["soap", "klsoap"])
def test_update_rms_matching_equals_the_reference_and_sets_each_update_s_rms(variant):
    """match_update_rms = 0.2: against the float64 reference as above, and each step's update of each matrix,
    recovered as (θ_{t−1}·(1 − γλ) − θ_t)/γ, has an RMS of 0.2 (within float32 rounding)."""
    opt, named = check_against_reference(variant, 1, True, 1e-2, match_update_rms=0.2)
    group = next(g for g in opt.param_groups if g["use_muon"])
    lr, wd = group["lr"], group["weight_decay"]
    _, grads = integer_ish_problem()
    previous = [p.detach().clone() for _, p in named]
    for row in grads[:2]:  # two more steps, each checked
        for (_, p), g in zip(named, row):
            p.grad = g.clone()
        opt.step()
        for (name, p), before in zip(named, previous):
            update = (before * (1 - lr * wd) - p.detach()) / lr
            rms = update.square().mean().sqrt().item()
            assert abs(rms - 0.2) <= 1e-4, f"{variant} {name}: update RMS {rms}"
        previous = [p.detach().clone() for _, p in named]


def matched_and_clipped_steps(optimizer: type, monkeypatch: pytest.MonkeyPatch | None, **rms: float) -> list[Tensor]:
    """Parameters after 6 steps of ``optimizer`` (``basis="cholqr"``, refresh every 3) on 8 experts of 6×10 and a
    7×7 matrix, gradients scaled by 1e-12 … 1e12 and one expert's gradient zero; with ``monkeypatch`` the clip
    pass always runs (:data:`~dtensor_muon.rules.soap.CLIP_HEADROOM` infinite)."""
    if monkeypatch is not None:
        monkeypatch.setattr(soap_rule, "CLIP_HEADROOM", math.inf)
    g = torch.Generator().manual_seed(3)
    named = [
        ("layers.0.moe.experts.w1", torch.nn.Parameter(torch.randn(8, 6, 10, generator=g))),
        ("layers.0.attention.wq", torch.nn.Parameter(torch.randn(7, 7, generator=g))),
    ]
    opt = optimizer(named, lr=0.01, basis="cholqr", precondition_frequency=3, **rms)
    for scale in (1.0, 1e-12, 1e12, 1e-3, 1e3, 1.0):
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=g) * scale
        named[0][1].grad[2] = 0.0
        opt.step()
    return [p.detach().clone() for _, p in named]


@pytest.mark.parametrize("optimizer", [SOAP, KLSOAP], ids=["SOAP", "KLSOAP"])
def test_a_clip_that_cannot_bind_after_matching_is_skipped_with_the_same_bits(optimizer, monkeypatch):
    """max_update_rms = 1 ≥ 4 × match_update_rms = 0.2: the update is the same, bit for bit, with the clip's pass
    skipped and run; max_update_rms = 0.1 below the match still clips (each update's RMS 0.1, not 0.2)."""
    skipped = matched_and_clipped_steps(optimizer, None, match_update_rms=0.2, max_update_rms=1.0)
    run = matched_and_clipped_steps(optimizer, monkeypatch, match_update_rms=0.2, max_update_rms=1.0)
    for a, b in zip(skipped, run):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    monkeypatch.undo()  # the clip as the library decides it
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(7, 7, generator=g))
    opt = optimizer([("layers.0.attention.wq", p)], lr=0.01, weight_decay=0.0, match_update_rms=0.2, max_update_rms=0.1)
    for _ in range(2):  # step 1 only builds the basis
        before = p.detach().clone()
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    rms = ((before - p.detach()) / 0.01).square().mean().sqrt().item()
    assert abs(rms - 0.1) <= 1e-4, rms


@requires_cuda
def test_step_counts_stay_on_the_host_on_cuda_through_a_state_dict_round_trip():
    """On the GPU, SOAP's owner step counts are in host memory (each step reads them without a device sync), the
    rest of its owner state on the GPU; a state dict loaded into a fresh optimizer puts each back where it was,
    and both optimizers then take the same steps, bit for bit."""
    g = torch.Generator().manual_seed(5)
    initial = [torch.randn(8, 6, 10, generator=g), torch.randn(7, 7, generator=g)]
    grads = [[torch.randn(t.shape, generator=g) for t in initial] for _ in range(6)]

    def build(values: list[Tensor]) -> tuple[Any, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(v.cuda()) for v in values]
        names = ["layers.0.moe.experts.w1", "layers.0.attention.wq"]
        return SOAP(list(zip(names, params)), lr=0.01, basis="cholqr", precondition_frequency=2), params

    def steps(opt: Any, params: list[torch.nn.Parameter], rows: list[list[Tensor]]) -> None:
        for row in rows:
            for p, grad in zip(params, row):
                p.grad = grad.cuda()
            opt.step()

    opt, params = build(initial)
    steps(opt, params, grads[:3])
    resumed, resumed_params = build([p.detach().cpu() for p in params])
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint: torch's load keeps the tensors
    for optimizer in (opt, resumed):
        held = [t for p in optimizer.param_groups[0]["params"] for m in optimizer.state[p]["owner_state"].values()
                for t in m.items()]  # fmt: skip
        assert held and all((t.device.type == "cpu") == (name == "step") for name, t in held)
    steps(opt, params, grads[3:])
    steps(resumed, resumed_params, grads[3:])
    for a, b in zip(params, resumed_params):
        assert torch.equal(a.detach(), b.detach())


def check_against_reference(
    variant: str, precondition_frequency: int, bias: bool, eps: float, **rms: float
) -> tuple[Any, list[tuple[str, Tensor]]]:
    """Five steps on a wide (5×9), a tall (8×5) and a 4×13 matrix whose 13 columns exceed
    max_preconditioner_dim = 10: the float32 library against the float64 reference, θ within 1e-5 of the
    change θ_T − θ₀ (measured ≤ 2.7e-6 for SOAP, ≤ 1.3e-6 for KL-SOAP, ≤ 6.2e-6 for SOAP with basis="eigh",
    ≤ 2.6e-6 for REKLS, ≤ 2.9e-6 for SOAP with basis="cholqr" against the shifted Householder QR, ≤ 1.2e-6 for KL-SOAP with it).

    ε is large here because float32 rounding is divided by |G'| + ε: where G' = Q_Lᵀ·G·Q_R has an entry that
    is zero in exact arithmetic but not in float32 (the direction of a factor's null space, or a near-null
    one), Adam's N there is rounding/(|rounding| + ε), which is ±1 for ε = 1e-8 (measured with ε = 1e-8: up to
    2.9e-5 for SOAP on the wide matrix). REKLS needs ε = 1: KL's factors of one gradient are nearly whitened
    (G·(GᵀG)⁻¹·Gᵀ is a projection), so their eigenvalues are close, their eigenvectors sensitive, and the
    rounding that reaches G' is larger (measured with ε = 1e-2: up to 7.9e-5; with ε = 1e-4: up to 0.26).
    The long matrix keeps no factor, basis or estimate for its unpreconditioned side."""
    optimizer, fixed = VARIANTS[variant]
    params, grads = integer_ish_problem()
    options = dict(
        lr=0.05,
        betas=(0.9, 0.95),
        shampoo_beta=0.9,
        eps=eps,
        weight_decay=0.1,
        precondition_frequency=precondition_frequency,
        max_preconditioner_dim=MAX_DIM,
        correct_bias=bias,
    )
    extra = dict(correct_shampoo_beta_bias=bias, **{**PREVIOUS_DEFAULTS, **rms})
    named = [(name, p.clone().requires_grad_()) for (name, _), p in zip(SHAPES, params)]
    opt = optimizer(named, **options, **extra)
    for row in grads:
        for (_, p), g in zip(named, row):
            p.grad = g.clone()
        opt.step()
    for (name, p), p0, k in zip(named, params, range(len(SHAPES))):
        want = soap_reference(p0, [row[k] for row in grads], **options, **fixed, **extra)
        err = relative_to_change(p.detach(), want, p0)
        assert err <= 1e-5, f"{variant} {name}: {err:.2e}"
        assert math.isfinite(err)
    (long_state,) = opt.state[named[2][1]]["owner_state"].values()
    assert set(long_state) == {"step", "exp_avg", "exp_avg_sq", "L", "Q_L", "eig_L"}
    assert int(long_state["step"]) == STEPS
    return opt, named


def test_variants_differ_and_the_first_step_is_sign_adam_in_the_eigenbasis():
    """The three variants give different parameters (KL changes the factors, eigh the basis after step 1).
    Step 1 with bias correction: the bases are G₁'s singular vectors, G' = Q_Lᵀ·G₁·Q_R is diagonal and
    N = G'/(|G'| + ε), so O is G₁'s polar factor; here exactly, with a diagonal G₁ (with a dense G₁ the
    off-diagonal float32 rounding of G' is divided by |G'| + ε and gives entries near ±1 instead of 0)."""
    params, grads = integer_ish_problem(steps=3, seed=1)
    results = {}
    for key, (optimizer, _) in VARIANTS.items():
        named = [(name, p.clone().requires_grad_()) for (name, _), p in zip(SHAPES, params)]
        opt = optimizer(named, lr=0.05, weight_decay=0.0, max_preconditioner_dim=MAX_DIM, **PREVIOUS_DEFAULTS)
        for row in grads:
            for (_, p), g in zip(named, row):
                p.grad = g.clone()
            opt.step()
        results[key] = [p.detach() for _, p in named]
    for a, b in (("soap", "klsoap"), ("klsoap", "rekls")):
        assert all((x - y).abs().max() > 1e-4 for x, y in zip(results[a][:2], results[b][:2])), (a, b)
    p = torch.zeros(3, 3, requires_grad=True)
    opt = SOAP([("layers.0.w", p)], lr=1.0, weight_decay=0.0, **PREVIOUS_DEFAULTS)
    p.grad = torch.diag(torch.tensor([3.0, -2.0, 1.0]))
    opt.step()
    torch.testing.assert_close(p.detach(), -torch.diag(torch.tensor([1.0, -1.0, 1.0])), atol=1e-7, rtol=0)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(shampoo_beta=1.0), "shampoo_beta"),
        (dict(eps=0.0), "eps"),
        (dict(precondition_frequency=0), "precondition_frequency"),
        (dict(max_preconditioner_dim=0), "max_preconditioner_dim"),
        (dict(basis="svd"), "basis"),
        (dict(max_update_rms=-1.0), "max_update_rms"),
        (dict(match_update_rms=-0.2), "match_update_rms"),
        (dict(kl=1), "kl"),
        (dict(correct_bias=None), "correct_bias"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SOAP([("layers.0.w", torch.zeros(3, 3, requires_grad=True))], **kwargs)


@pytest.mark.parametrize("variant, eps", [("soap-eigh", 1e-2), ("rekls", 1.0)])
def test_eigh_refresh_sorts_the_second_moment_as_emerging_optimizers_0_3(variant, eps):
    """Five steps of SOAP(basis="eigh") and REKLS (one refresh a step) as in :func:`check_against_reference`:
    within 1e-5 of the reference that sorts V's axes by d = diag(Q_oldᵀ·K·Q_old) on every eigh refresh
    (measured ≤ 6.2e-6 and ≤ 1.8e-6), and far from the reference that keeps V's order (measured 0.077 to 0.67):
    the comparison sees the sort."""
    optimizer, fixed = VARIANTS[variant]
    params, grads = integer_ish_problem()
    options = dict(lr=0.05, betas=(0.9, 0.95), shampoo_beta=0.9, eps=eps, weight_decay=0.1)
    options.update(precondition_frequency=1, max_preconditioner_dim=MAX_DIM, correct_bias=True)
    named = [(name, p.clone().requires_grad_()) for (name, _), p in zip(SHAPES, params)]
    opt = optimizer(named, **options, correct_shampoo_beta_bias=True, **PREVIOUS_DEFAULTS)
    for row in grads:
        for (_, p), g in zip(named, row):
            p.grad = g.clone()
        opt.step()
    for (name, p), p0, k in zip(named, params, range(len(SHAPES))):
        steps = [row[k] for row in grads]
        sorted_v = soap_reference(p0, steps, **options, **fixed, correct_shampoo_beta_bias=True)
        kept_v = soap_reference(
            p0, steps, **options, **fixed, correct_shampoo_beta_bias=True, eigh_sorts_second_moment=False
        )
        assert relative_to_change(p.detach(), sorted_v, p0) <= 1e-5, name
        assert relative_to_change(p.detach(), kept_v, p0) >= 1e-2, name


def emerging_optimizers_0_3(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The installed Emerging-Optimizers 0.3.x (skips otherwise), importable on Python 3.11 (its ``soap.py``
    imports ``typing.override``, new in 3.12)."""
    import typing

    import typing_extensions

    if not hasattr(typing, "override"):
        monkeypatch.setattr(typing, "override", typing_extensions.override, raising=False)
    eo = pytest.importorskip("emerging_optimizers")
    if not getattr(eo, "__version__", "").startswith("0.3."):
        pytest.skip(f"Emerging-Optimizers 0.3 wanted, {getattr(eo, '__version__', '?')} installed")
    import emerging_optimizers.soap.rekls
    import emerging_optimizers.soap.soap

    return emerging_optimizers.soap


@pytest.mark.parametrize(
    "variant, eo_name, eo_kwargs, eps, tolerance",
    [
        ("soap", "SOAP", dict(), 1e-2, 1e-5),
        ("soap-eigh", "SOAP", dict(use_eigh=True), 1e-2, 1e-5),
        ("klsoap", "SOAP", dict(use_kl_shampoo=True), 1e-2, 1e-5),
        ("rekls", "REKLS", dict(), 1.0, 1e-5),
    ],
)
def test_equals_emerging_optimizers_0_3(monkeypatch, variant, eo_name, eo_kwargs, eps, tolerance):
    """Five steps (one refresh a step, bias corrections on, every side preconditioned) on the wide 5×9 and
    tall 8×5 matrices of :func:`integer_ish_problem`: θ within ``tolerance`` of Emerging-Optimizers 0.3's θ,
    relative to the change θ_T − θ₀ (both float32; measured ≤ 7.8e-7 for SOAP, ≤ 6.5e-7 for basis="eigh",
    ≤ 5.5e-7 for KL-SOAP, ≤ 1.3e-6 for REKLS; ε as in :func:`check_against_reference`). Skipped when it is
    not installed; it is not a dependency, since its wheel declares Python ≥ 3.12 and installs here only with
    ``pip install --ignore-requires-python emerging-optimizers==0.3.0``."""
    soap_module = emerging_optimizers_0_3(monkeypatch)
    eo_optimizer = getattr(soap_module, eo_name)
    optimizer, _ = VARIANTS[variant]
    params, grads = integer_ish_problem()
    params, grads = params[:2], [row[:2] for row in grads]
    hyper = dict(lr=0.05, betas=(0.9, 0.95), shampoo_beta=0.9, eps=eps, weight_decay=0.1)
    named = [(name, p.clone().requires_grad_()) for (name, _), p in zip(SHAPES, params)]
    theirs = [torch.nn.Parameter(p.clone()) for p in params]
    ours_opt = optimizer(named, **hyper, precondition_frequency=1, **PREVIOUS_DEFAULTS)
    their_opt = eo_optimizer(theirs, **hyper, **eo_kwargs)
    for row in grads:
        for (_, p), q, g in zip(named, theirs, row):
            p.grad, q.grad = g.clone(), g.clone()
        ours_opt.step()
        with torch._dynamo.config.patch(disable=True):  # its torch.compile'd Adam and RMS clip, run eagerly
            their_opt.step()
    for (name, p), q, p0 in zip(named, theirs, params):
        err = relative_to_change(p.detach(), q.detach().to(torch.float64), p0)
        assert err <= tolerance, f"{variant} {name}: {err:.2e}"


# ------------------------------------------------------------------- an MLP classifier trains at the defaults
MLP_SIZES = (64, 128, 128, 128, 10)
MLP_INPUTS = 256
MLP_STEPS = 20


def mlp(seed: int) -> torch.nn.Sequential:
    """64→128→128→128→10 with ReLU, nn.Linear's initialization (U(±1/√fan_in)) drawn from its own generator."""
    gen = torch.Generator().manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(MLP_SIZES):
        linear = torch.nn.utils.skip_init(torch.nn.Linear, fan_in, fan_out)
        bound = 1 / math.sqrt(fan_in)
        with torch.no_grad():
            linear.weight.copy_(torch.rand(fan_out, fan_in, generator=gen) * 2 * bound - bound)
            linear.bias.copy_(torch.rand(fan_out, generator=gen) * 2 * bound - bound)
        layers += [linear, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def mlp_data() -> tuple[Tensor, Tensor]:
    """256 N(0, 1) inputs labelled by a random teacher of the same shape (argmax of its logits)."""
    x = torch.randn(MLP_INPUTS, MLP_SIZES[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return x, mlp(100)(x).argmax(-1)


def mlp_losses(make: Any, steps: int = MLP_STEPS) -> Tensor:
    """The full-batch cross-entropy before each of ``steps`` steps and after the last (one thread)."""
    return mlp_train(make, steps)[0]


def mlp_train(make: Any, steps: int) -> tuple[Tensor, torch.nn.Module]:
    """:func:`mlp_losses` and the trained model."""
    x, y = mlp_data()
    model = mlp(1)
    opt = make(model)
    losses = []
    with one_thread():
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            losses.append(loss.detach())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            losses.append(torch.nn.functional.cross_entropy(model(x), y))
    return torch.stack(losses), model


MLP_OPTIMIZERS = [SOAP, KLSOAP, REKLS]

F32_UNIT = 2.0**-24
"""float32's unit roundoff u."""


def float32_gamma(n: int) -> float:
    """γₙ = n·u/(1 − n·u): a float32 sum of n products differs from the exact one by at most γₙ times the sum of
    their absolute values, whatever the order of the additions."""
    return n * F32_UNIT / (1 - n * F32_UNIT)


def float64_start() -> tuple[float, float]:
    """The untrained MLP's loss on its data in float64, and how far the float32 loss can be from it: a layer's
    outputs err by at most γ_{n+1}·(|W|·|h| + |b|) (n products and the bias) plus its input's error taken
    through |W| (ReLU is 1-Lipschitz); a sample's cross-entropy moves by at most 2·max|Δz| with its logits z;
    the float32 cross-entropy itself adds at most 16 roundings of max|z| + ln 10 (log-softmax over 10 classes,
    each exp and log within 4 ulps) and γ₂₅₆ of the loss (the mean)."""
    x, y = mlp_data()
    h, err = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    for layer in mlp(1):
        if isinstance(layer, torch.nn.Linear):
            w, b = layer.weight.detach().double(), layer.bias.detach().double()
            err = err @ w.abs().T + float32_gamma(w.shape[1] + 1) * ((h.abs() + err) @ w.abs().T + b.abs())
            h = h @ w.T + b
        else:
            h = h.relu()
    loss = torch.nn.functional.cross_entropy(h, y).item()
    bound = 2 * err.amax(-1).mean().item() + 16 * F32_UNIT * (h.abs().max().item() + math.log(10))
    return loss, bound + float32_gamma(MLP_INPUTS) * loss


def frozen_matrix_losses(lr: float) -> Tensor:
    """:func:`mlp_losses` with the four weight matrices frozen and the biases trained by torch's AdamW with the
    optimizers' settings for them (betas (0.9, 0.95), ε 1e-8, weight decay 0.1): the loss the matrices'
    updates have to improve on."""
    return mlp_losses(
        lambda model: torch.optim.AdamW(
            [p for p in model.parameters() if p.ndim == 1], lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
        )
    )


def assert_trains(losses: Tensor, frozen: Tensor) -> None:
    """Finite, below the start after every step, and ending below the run whose matrices stay frozen."""
    assert torch.isfinite(losses).all() and bool((losses[1:] < losses[0]).all()), losses
    assert losses[-1] < frozen[-1], (losses, frozen[-1])


@pytest.mark.parametrize("optimizer", MLP_OPTIMIZERS, ids=lambda o: o.__name__)
def test_mlp_trains_at_the_defaults_where_the_previous_defaults_diverged(optimizer):
    """A 64→128→128→128→10 ReLU classifier on 256 teacher-labelled inputs, 20 full-batch steps; the loss starts
    at 2.253, the float64 loss of the same model within the float32 forward's rounding (:func:`float64_start`).
    At the defaults (skip_first_update, max_update_rms 1) with lr 3e-3 the loss falls at every step and ends below
    the run that trains only the biases (:func:`frozen_matrix_losses`: 2.02 at lr 3e-3, 1.58 at 1e-2); at lr
    1e-2 it stays below the start and ends below that run too. With the previous defaults (Emerging-Optimizers
    0.3's: no skip, no clip) SOAP at lr 1e-2 diverges (its loss ends above 100× the start, or is not finite),
    while KL's factors alone keep KLSOAP and REKLS training. Float32 rounding steers these runs apart from one
    CPU instruction set to another; measured on three: the defaults end at 1.73–1.76 (SOAP), 0.41–0.44
    (KLSOAP), 0.36–0.40 (REKLS), at lr 1e-2 at 0.19–0.21, 9e-5–1.4e-4, 5e-5–3e-4 (torch's AdamW on every
    parameter: 0.459 at 3e-3, 0.088 at 1e-2); with the previous defaults SOAP reached 34–3056 at step 3 and
    6e8–2.5e10 at step 20, KLSOAP and REKLS 9e-5–4e-3."""
    start, bound = float64_start()
    at_default = mlp_losses(lambda model: optimizer(model.named_parameters(), lr=3e-3))
    assert abs(at_default[0].item() - start) <= bound, (at_default[0].item(), start, bound)
    assert_trains(at_default, frozen_matrix_losses(3e-3))
    # small steps: each lowers the loss by 0.01–0.1, far more than rounding moves it
    assert bool((at_default.diff() < 0).all()), at_default
    frozen = frozen_matrix_losses(1e-2)
    assert_trains(mlp_losses(lambda model: optimizer(model.named_parameters(), lr=1e-2)), frozen)
    before = mlp_losses(lambda model: optimizer(model.named_parameters(), lr=1e-2, **PREVIOUS_DEFAULTS))
    if optimizer is SOAP:  # the failure the new defaults remove; a 10-class cross-entropy of 100× the start
        # (225) needs logits hundreds apart, which no run that trains comes near
        assert not torch.isfinite(before).all() or before[-1] >= 100 * before[0], before
    else:
        assert_trains(before, frozen)


def weight_updates(before: list[Tensor], after: list[Tensor], lr: float, weight_decay: float) -> list[Tensor]:
    """(θ_{t−1}·(1 − γλ) − θ_t)/γ of each matrix, in float64: the applied update O."""
    return [(b.double() * (1 - lr * weight_decay) - a.double()) / lr for b, a in zip(before, after)]


def recovery_error(before: list[Tensor], updates: list[Tensor], lr: float, weight_decay: float) -> list[Tensor]:
    """A bound on each entry of |:func:`weight_updates` − O|. The float32 step θ_t = fl(fl(θ_{t−1}·d) − γ·O), with
    d = 1 − γλ and γ rounded to float32, rounds θ_{t−1}·d three times (d, the product, the sum) and γ·O three
    times (γ, the product, the sum): |recovered − O| ≤ 3u·(|θ_{t−1}·d|/γ + |O|) to first order; 4u covers the
    second order and |O| read as the recovered |O|."""
    return [4 * F32_UNIT * (b.double().abs() * (1 - lr * weight_decay) / lr + u.abs()) for b, u in zip(before, updates)]


def rms(tensors: list[Tensor]) -> float:
    """The RMS over all the entries of ``tensors``."""
    return math.sqrt(sum(t.square().sum().item() for t in tensors) / sum(t.numel() for t in tensors))


@pytest.mark.parametrize("previous", [False, True], ids=["defaults", "previous-defaults"])
def test_update_rms_metric_follows_each_soap_step(previous):
    """SOAP on the MLP above at lr 1e-2, 6 steps: ``muon/update_rms/soap`` / lr is, on every step, the RMS of
    the update recovered from the weights, (θ_{t−1}·(1 − γλ) − θ_t)/γ over the four matrices in float64, within
    the rounding of the metric's float32 norms and of that recovery (see the bounds below). With the defaults
    it is exactly 0 on step 1 (the skipped update) and positive after, each matrix's update at most RMS 1 (the
    clip; measured 0.78–1.0 over all four); with the previous defaults it shows the blow-up the clip removes:
    it exceeds 1 (measured on three CPU instruction sets: 0.75 on step 1, 11–13 on step 2, 20–7130 after)."""
    x, y = mlp_data()
    model = mlp(1)
    lr, weight_decay = 1e-2, 0.1
    options = PREVIOUS_DEFAULTS if previous else {}
    opt = SOAP(model.named_parameters(), lr=lr, weight_decay=weight_decay, **options)
    weights = [p for p in model.parameters() if p.ndim == 2]
    # the metric's float32 norm of a matrix sums its n squares (relative error ≤ γₙ, halved by the square root);
    # scaling by lr, squaring and adding the four add a few u: ≤ n·u relative, n the largest matrix's entries
    relative = max(w.numel() for w in weights) * F32_UNIT
    reported = []
    with one_thread():
        for step in range(1, 7):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            before = [w.detach().clone() for w in weights]
            opt.step()
            reported.append(opt.metrics["muon/update_rms/soap"] / lr)
            updates = weight_updates(before, [w.detach() for w in weights], lr, weight_decay)
            errors = recovery_error(before, updates, lr, weight_decay)
            # |RMS(recovered) − RMS(O)| ≤ RMS(recovered − O) ≤ RMS(errors)
            recovered, slack = rms(updates), rms(errors)
            assert abs(reported[-1] - recovered) <= relative * (recovered + slack) + slack, (step, reported, recovered)
            if not previous and step == 1:
                assert reported[-1] == 0.0, reported  # O = 0: every norm is exactly 0
            elif not previous:
                assert reported[-1] > 0, reported
                # the clip divides O by its float32 RMS (+ 1e-7), which errs by ≤ γₙ/2 + 2u: RMS(O) ≤ 1 + n·u
                for update, error in zip(updates, errors):
                    assert rms([update]) <= 1 + relative + rms([error]), (step, rms([update]))
    if previous:
        assert max(reported) > 1 + relative, reported  # no clip: the updates outgrow what it would allow


def mlp_fsdp(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """The MLP above under ``fully_shard`` (each Linear, then the whole), every rank on the whole batch, SOAP,
    KLSOAP and REKLS at their defaults: the losses and the full parameters of each."""
    from torch.distributed.fsdp import fully_shard

    x, y = mlp_data()
    out: dict[str, Any] = {}
    with one_thread():
        for optimizer in MLP_OPTIMIZERS:
            model = mlp(1)
            mesh = scenarios.make_mesh("shard0", world_size)
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = optimizer(model.named_parameters())
            losses = []
            for _ in range(steps):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                losses.append(loss.detach())
                opt.zero_grad()
                loss.backward()
                opt.step()
            out[optimizer.__name__] = {
                "losses": torch.stack(losses),
                "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            }
            del opt
    return out


MLP_FSDP_STEPS = 8


@pytest.mark.slow
def test_mlp_under_fsdp2_on_2_ranks_equals_one_process():
    """SOAP, KLSOAP and REKLS at their defaults, 8 steps of the MLP under FSDP2 on 2 gloo ranks (each rank on
    the whole batch, so the averaged gradient is the one-process gradient): every loss and every parameter
    bit for bit those of one process. The skipped first step and the clip act per matrix on its owner, from
    the matrix's own step count, so the world size does not change them."""
    results = run_distributed(mlp_fsdp, 2, MLP_FSDP_STEPS)
    for optimizer in MLP_OPTIMIZERS:
        losses, model = mlp_train(
            lambda model, optimizer=optimizer: optimizer(model.named_parameters()), MLP_FSDP_STEPS
        )
        want = losses[:-1]  # before each step, as the ranks report them
        assert want[-1] < want[0]
        for rank, result in enumerate(results):
            got = result[optimizer.__name__]
            assert torch.equal(got["losses"], want), (optimizer.__name__, rank, got["losses"], want)
            for name, p in model.named_parameters():
                a = got["params"][name]
                assert torch.equal(a, p.detach()), f"{optimizer.__name__}, rank {rank}, {name}: {(a - p).abs().max()}"


@pytest.mark.parametrize("variant", ["soap", "klsoap", "soap-eigh", "rekls", "soap-cholqr"])
@pytest.mark.parametrize("precondition_frequency", [1, 2])
def test_skipped_first_step_and_clip_equal_the_float64_reference(variant, precondition_frequency):
    """The new defaults (skip_first_update, max_update_rms 1) on the problem of :func:`check_against_reference`
    against the float64 reference with the same options: θ within 1e-5 of the change."""
    eps = 1.0 if variant == "rekls" else 1e-2
    check_against_reference(variant, precondition_frequency, True, eps, skip_first_update=True, max_update_rms=1.0)


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_skip_first_update_must_be_a_bool(value):
    with pytest.raises(ValueError, match="skip_first_update"):
        SOAP([("layers.0.w", torch.zeros(3, 3, requires_grad=True))], skip_first_update=value)


# ------------------------------------------------------------------------------- degenerate factors never raise
def degenerate_factors() -> dict[str, Tensor]:
    """8×8 float32 factors K = G·Gᵀ that a first gradient G can give: rank 1 (a gradient of rank 1), rank 1 of a
    tiny gradient (entries of 1e-20: K's entries ~1e-40, subnormal), zero (a zero gradient), ill-conditioned
    (eigenvalues 1e-20 … 1), rank 1 of a huge gradient whose largest eigenvalue (7e38) exceeds float32's range
    while every entry (≤ 3.3e38) does not, and NaN (what an overflowing G·Gᵀ leaves after the moving average:
    inf − inf)."""
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(8, 1, generator=gen)
    u, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64))
    ill = (u * torch.logspace(-20, 0, 8, dtype=torch.float64)) @ u.T
    huge = g / g.abs().max() * 1.8e19
    return {
        "rank-1": g @ g.T,
        "rank-1 tiny": (g * 1e-20) @ (g * 1e-20).T,
        "zero": torch.zeros(8, 8),
        "ill-conditioned": ill.float(),
        "rank-1 huge": huge @ huge.T,
        "nan": torch.full((8, 8), float("nan")),
    }


SUBNORMAL_STEPS = 2.0**-148
"""Two steps of float32's subnormal grid: eigenvalues of the tiny factor (~1e-40) are rounded to it."""


def orthogonality_error(q: Tensor) -> float:
    """max |QᵀQ − I| in float64."""
    q = q.to(torch.float64)
    return (q.mT @ q - torch.eye(q.shape[-1], dtype=torch.float64)).abs().max().item()


def off_diagonal(k: Tensor, q: Tensor) -> float:
    """max |offdiag(Qᵀ·K·Q)| / max(|K|) in float64 (0 for an eigenbasis of K; 0 for K = 0)."""
    k64, q64 = k.to(torch.float64), q.to(torch.float64)
    b = q64.mT @ k64 @ q64
    scale = k64.abs().max().item()
    return ((b - torch.diag(b.diagonal())).abs().max() / scale).item() if scale > 0 else 0.0


@pytest.mark.parametrize("name", list(degenerate_factors()))
def test_eigh_descending_never_raises_and_returns_an_orthogonal_eigenbasis(name):
    """Each degenerate factor: eigh_descending returns an orthogonal basis (|QᵀQ − I| ≤ 1e-6, measured ≤ 6e-7);
    on a finite factor it diagonalizes K (off-diagonal of QᵀKQ ≤ 1e-6·max|K|, measured ≤ 2e-7) and its
    eigenvalues are the float64 reference's (torch.linalg.eigh of the same K in float64, descending) within
    1e-6·max|λ| + 2⁻¹⁴⁸. The rank-1 huge factor, on which plain float32 eigh returns non-finite values, is
    solved after the power-of-two scaling; only its top eigenvalue (7e38) is +inf, out of float32's range. On
    the NaN factor plain torch.linalg.eigh raises the reported error in float32 and float64 alike;
    eigh_descending returns the fallback basis (the identity, or the one given) and NaN estimates."""
    from dtensor_muon.rules.soap import eigh_descending

    k = degenerate_factors()[name]
    values, q = eigh_descending(k)
    assert values.dtype == q.dtype == torch.float32
    assert orthogonality_error(q) <= 1e-6
    if name == "nan":
        for dtype in (torch.float32, torch.float64):
            with pytest.raises(torch.linalg.LinAlgError, match="failed to converge"):
                torch.linalg.eigh(k.to(dtype))
        assert torch.equal(q, torch.eye(8)) and values.isnan().all()
        basis = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(0))).Q
        values, q = eigh_descending(k, fallback=basis)
        assert torch.equal(q, basis) and values.isnan().all()
        return
    reference = torch.linalg.eigh(k.to(torch.float64)).eigenvalues.flip(-1)
    assert off_diagonal(k, q) <= 1e-6
    scale = reference.abs().max().item()
    if name == "rank-1 huge":
        assert not torch.isfinite(torch.linalg.eigh(k).eigenvalues).all()  # unscaled float32 eigh fails
        assert values[0] == float("inf")
        values, reference = values[1:], reference[1:]
    assert (values.to(torch.float64) - reference).abs().max().item() <= 1e-6 * scale + SUBNORMAL_STEPS


@pytest.mark.parametrize("name", [n for n in degenerate_factors() if n != "nan"])
def test_each_eigh_attempt_gives_the_eigendecomposition(name):
    """The three attempts of eigh_descending, each run directly (on CPU none of them fails on a finite factor
    once it is scaled, so the later ones are reached here only through this test): float32, float64, and
    float64 of the shifted K + s·I, all of K scaled by a power of two. Each gives an orthogonal basis that
    diagonalizes K and the float64 reference's eigenvalues ((λ − s)·scale) within 1e-6·max|λ| (float32) or
    1e-12·max|λ| (float64), + 2⁻¹⁴⁸."""
    from dtensor_muon.rules.soap import eigh_attempts

    k = degenerate_factors()[name]
    reference = torch.linalg.eigh(k.to(torch.float64)).eigenvalues
    scale = max(reference.abs().max().item(), torch.finfo(torch.float64).tiny)
    attempts = list(eigh_attempts(k))
    assert [x.dtype for x, _, _ in attempts] == [torch.float32, torch.float64, torch.float64]
    assert attempts[0][1] == attempts[1][1] == 0.0 and attempts[2][1] > 0.0
    for (x, shift, factor), tolerance in zip(attempts, (1e-6, 1e-12, 1e-12)):
        assert factor > 0 and math.log2(factor) == round(math.log2(factor))  # a power of two
        values, vectors = torch.linalg.eigh(x)
        assert orthogonality_error(vectors) <= (1e-6 if x.dtype == torch.float32 else 1e-12)
        assert off_diagonal(k, vectors) <= (1e-6 if x.dtype == torch.float32 else 1e-12)
        got = (values.to(torch.float64) - shift) * factor
        assert (got - reference).abs().max().item() <= tolerance * scale + SUBNORMAL_STEPS


@pytest.mark.parametrize("name", list(degenerate_factors()))
def test_qr_basis_is_orthogonal_on_degenerate_factors(name):
    """One power iteration and Householder QR from a random orthogonal basis: an orthogonal Q (≤ 1e-6) on every
    finite factor, rank-deficient and zero included; the NaN factor keeps the given basis exactly."""
    from dtensor_muon.rules.soap import qr_basis

    k = degenerate_factors()[name]
    basis = torch.linalg.qr(torch.randn(8, 8, generator=torch.Generator().manual_seed(0))).Q
    q = qr_basis(k, basis)
    if name in ("nan", "rank-1 huge"):  # K·Q overflows for the huge factor: the basis is kept
        assert torch.equal(q, basis)
    assert orthogonality_error(q) <= 1e-6


DEGENERATE_SHAPES = [("layers.0.zero", (6, 4)), ("layers.0.rank1", (5, 7)), ("layers.0.ill", (8, 8))]


def degenerate_first_gradients() -> list[list[Tensor]]:
    """Three steps of gradients for DEGENERATE_SHAPES: step 1 all zero, rank 1 of size 1e-20, and with singular
    values 1e-20 … 1; then dense N(0, 1) gradients."""
    gen = torch.Generator().manual_seed(5)
    u, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen, dtype=torch.float64))
    first = [
        torch.zeros(6, 4),
        1e-20 * torch.randn(5, 1, generator=gen) @ torch.randn(1, 7, generator=gen),
        ((u * torch.logspace(-20, 0, 8, dtype=torch.float64)) @ v.T).float(),
    ]
    later = [[torch.randn(shape, generator=gen) for _, shape in DEGENERATE_SHAPES] for _ in range(2)]
    return [first, *later]


@pytest.mark.parametrize("optimizer", [SOAP, KLSOAP, REKLS], ids=lambda o: o.__name__)
def test_degenerate_first_gradients_step_without_error(optimizer):
    """SOAP (defaults), KLSOAP and REKLS, three steps on one process: the first gradient of each matrix is
    zero, rank 1 of size 1e-20, or ill-conditioned, then dense. No error; after step 1 the matrix with the zero
    gradient has moved by weight decay only (θ₁ = θ₀·(1 − γλ) within 1 ulp: M = V = 0 give N = 0); after
    3 steps every θ is finite and every basis orthogonal (|QᵀQ − I| ≤ 1e-5)."""
    gen = torch.Generator().manual_seed(6)
    named = [(name, torch.randn(shape, generator=gen).requires_grad_()) for name, shape in DEGENERATE_SHAPES]
    p0 = [p.detach().clone() for _, p in named]
    opt = optimizer(named)
    group = next(g for g in opt.param_groups if g["use_muon"])
    for step, row in enumerate(degenerate_first_gradients()):
        for (_, p), g in zip(named, row):
            p.grad = g.clone()
        opt.step()
        if step == 0:
            shrunk = p0[0] * (1 - group["lr"] * group["weight_decay"])
            torch.testing.assert_close(named[0][1].detach(), shrunk, rtol=1.2e-7, atol=0)
    for name, p in named:
        assert torch.isfinite(p).all(), name
        for state in opt.state[p]["owner_state"].values():
            for key in ("Q_L", "Q_R"):
                assert orthogonality_error(state[key]) <= 1e-5, (name, key)


@pytest.mark.parametrize("optimizer", [SOAP, KLSOAP, REKLS], ids=lambda o: o.__name__)
def test_an_overflowing_first_gradient_does_not_raise(optimizer):
    """The reported error, reproduced on CPU: a rank-1 first gradient of size 1e20 makes G·Gᵀ overflow float32,
    the factors' moving average turns inf into NaN, and torch.linalg.eigh raises "failed to converge" on them
    in float32 and float64 (so did this library's refresh before). Now three steps run without an error and each
    basis stays a permutation of the identity (the kept step-1 basis, sorted); the parameter itself becomes NaN,
    since Adam's V = G'² overflows too (that is ``skip_nonfinite``'s business, not the basis')."""
    gen = torch.Generator().manual_seed(7)
    p = torch.randn(4, 6, generator=gen).requires_grad_()
    opt = optimizer([("layers.0.w", p)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the engine's one-time non-finite update warning
        for step in range(3):
            if step == 0:
                p.grad = 1e20 * torch.randn(4, 1, generator=gen) @ torch.randn(1, 6, generator=gen)
            else:
                p.grad = torch.randn(4, 6, generator=gen)
            opt.step()
            (state,) = opt.state[p]["owner_state"].values()
            if step == 0:
                assert not torch.isfinite(state["L"]).all()
                with pytest.raises(torch.linalg.LinAlgError, match="failed to converge"):
                    torch.linalg.eigh(state["L"])
            for key in ("Q_L", "Q_R"):
                q = state[key]
                assert ((q == 0) | (q == 1)).all() and torch.equal(q.sum(0), torch.ones(q.shape[0])), key
                assert torch.equal(q.sum(1), torch.ones(q.shape[0])), key


# ------------------------------------------------------------------------- distributed (Shard(0)) = one process
DIST_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "soap": (SOAP, dict(lr=0.01, precondition_frequency=2, max_preconditioner_dim=16)),
    "klsoap": (KLSOAP, dict(lr=0.01, max_update_rms=0.5)),
    "rekls": (REKLS, dict(lr=0.01, max_preconditioner_dim=16, correct_bias=False)),
    "soap-cholqr": (SOAP, dict(lr=0.01, basis="cholqr", max_preconditioner_dim=16)),
}
DIST_STEPS = 4


def one_process(optimizer: type, options: dict[str, Any], steps: int) -> list[Tensor]:
    with one_thread():
        params = [(n, p.clone().requires_grad_()) for n, p in scenarios.initial_params()]
        opt = optimizer(params, **options)
        for step in range(steps):
            for (_, p), g in zip(params, scenarios.gradients(step).values()):
                p.grad = g
            opt.step()
    return [p.detach() for _, p in params]


def soap_shard0(rank: int, world_size: int, steps: int) -> dict[str, list[Tensor]]:
    out = {}
    for key, (optimizer, options) in DIST_CONFIGS.items():
        params = scenarios.distributed_params("shard0", world_size)
        opt = optimizer(params, **options)
        for step in range(steps):
            scenarios.set_gradients(params, step)
            opt.step()
        out[key] = [p.full_tensor() for _, p in params]
        del opt
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shard0_equals_one_process_bitwise(world_size):
    """tests/scenarios.py's model (uneven 7/7/6 shards of the 20-row matrices, a 3×12 matrix, 5 experts, a
    4-D conv seen as 6×18, a matrix without gradient; empty shards at 4 ranks) as Shard(0) DTensors on 2, 3
    and 4 gloo ranks, 4 steps of each variant (with one side above max_preconditioner_dim = 16 for the 20×12
    and 6×18 matrices): bit for bit
    the one-process run. The gradient travels in float32 (no rounding), each owner runs the same float32
    direction on the same whole matrix, and the apply is element-wise."""
    results = run_distributed(soap_shard0, world_size, DIST_STEPS)
    names = [n for n, _ in scenarios.SHAPES]
    for key, (optimizer, options) in DIST_CONFIGS.items():
        want = one_process(optimizer, options, DIST_STEPS)
        for rank, result in enumerate(results):
            for name, a, b in zip(names, result[key], want):
                assert torch.equal(a, b), f"{key}, rank {rank}, {name}: max diff {(a - b).abs().max().item()}"


# ------------------------------------------------------------------------------- checkpoint across world sizes
DCP_OPTIONS = dict(lr=0.01, max_preconditioner_dim=16, kl=True)
SAVE_STEPS, RESUME_STEPS = 2, 2


@pytest.fixture(scope="module")
def soap_checkpoint() -> Iterator[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        run_distributed(scenarios.dcp_save, 4, path, SAVE_STEPS, SOAP, DCP_OPTIONS)
        yield path


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_dcp_saved_on_4_ranks_resumed_on_fewer_continues_exactly(soap_checkpoint, world_size):
    """Every SOAP tensor is owner state (factors, bases, eigenvalue estimates, both moments, the step count):
    saved by the owners of 4 ranks under each matrix's key, loaded by the owners the 2- or 3-rank plan gives them
    (matrices change owner), the run continues bit for bit like the uninterrupted one-process run."""
    results = run_distributed(
        scenarios.dcp_resume, world_size, soap_checkpoint, SAVE_STEPS, RESUME_STEPS, SOAP, DCP_OPTIONS
    )
    want = one_process(SOAP, DCP_OPTIONS, SAVE_STEPS + RESUME_STEPS)
    names = [n for n, _ in scenarios.SHAPES]
    for rank, result in enumerate(results):
        for name, a, b in zip(names, result, want):
            assert torch.equal(a, b), f"rank {rank}, {name}: max diff {(a - b).abs().max().item()}"
