"""SOAP, KL-SOAP and REKLS: a float64 reference written from the formulas, Shard(0) DTensors = one process.

The reference below uses no library code. Per m×n matrix G at step t = 1, 2, … (β = shampoo_beta, ε = eps):

    β_t = 1 − (1 − β)/(1 − βᵗ) with the factors' bias correction, else β
    SOAP: L ← β_t·L + (1 − β_t)·G·Gᵀ,  R ← β_t·R + (1 − β_t)·Gᵀ·G               (L, R start at 0)
    KL:   L ← β_t·L + (1 − β_t)/n·G·Q_R·Λ_R⁻¹·Q_Rᵀ·Gᵀ,  R likewise with 1/m and Λ_L,
          Λ = max(diag(Qᵀ·K·Q), ε) of the factors before the update, Q of the previous step (I at t = 1)
    refresh when (t − 1) mod precondition_frequency = 0: M back with the old Q, into the new one;
          t = 1 or basis "eigh": Q = eigenvectors of K by decreasing eigenvalue;
          "qr": d = diag(Q_oldᵀ·K·Q_old), Q_old's columns and V's axis sorted by decreasing d, Q = qr(K·Q_old)
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
matters), and later gradients are dense.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import scenarios
import torch
from dist_harness import run_distributed
from torch import Tensor

from dtensor_muon import KLSOAP, REKLS, SOAP

SHAPES = [("layers.0.wide", (5, 9)), ("layers.0.tall", (8, 5)), ("layers.0.long", (4, 13))]
MAX_DIM = 10  # the long matrix's 13 columns are not preconditioned
STEPS = 5
FIRST_DIAGONAL = torch.tensor([3.0, -2.5, 2.0, 1.5, -1.0])  # distinct squares: distinct first eigenvalues
VARIANTS: dict[str, tuple[type, dict[str, Any]]] = {
    "soap": (SOAP, dict(kl=False, basis="qr")),
    "klsoap": (KLSOAP, dict(kl=True, basis="qr")),
    "rekls": (REKLS, dict(kl=True, basis="eigh")),
}


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
) -> Tensor:
    """θ after SOAP's steps on one matrix, in float64 (see the module docstring)."""
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
                k = factors[side]
                if t == 1 or basis == "eigh":
                    values, vectors = torch.linalg.eigh(k)
                    bases[side] = vectors[:, torch.argsort(values, descending=True)]
                else:
                    q = bases[side]
                    order = torch.argsort(torch.diagonal(q.T @ k @ q), descending=True)
                    exp_avg_sq = exp_avg_sq.index_select(side, order)
                    bases[side] = torch.linalg.qr(k @ q[:, order]).Q
            exp_avg = bases[0].T @ momentum @ bases[1]
        projected = bases[0].T @ g @ bases[1]
        exp_avg = beta1 * exp_avg + (1 - beta1) * projected
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * projected**2
        if correct_bias:
            normalized = (exp_avg / (1 - beta1**t)) / ((exp_avg_sq / (1 - beta2**t)).sqrt() + eps)
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


@contextmanager
def single_thread() -> Iterator[None]:
    """One intra-op thread, as in the gloo workers (float32 CPU products can round by thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def relative_to_change(got: Tensor, want: Tensor, p0: Tensor) -> float:
    """‖θ − θ_ref‖ / ‖θ_ref − θ₀‖ (the error measured against how far the steps moved θ)."""
    p0 = p0.to(torch.float64)
    return (torch.linalg.vector_norm(got.to(torch.float64) - want) / torch.linalg.vector_norm(want - p0)).item()


CASES = [
    (variant, freq, bias, rms, 1e-2)
    for variant in ("soap", "klsoap")
    for freq, bias, rms in ((1, True, 0.0), (2, True, 0.0), (1, False, 0.0), (2, False, 0.0), (1, True, 0.5))
] + [("rekls", 1, True, 0.0, 1.0), ("rekls", 1, False, 0.0, 1.0), ("rekls", 1, True, 0.5, 1.0)]


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


def check_against_reference(
    variant: str, precondition_frequency: int, bias: bool, eps: float, **rms: float
) -> tuple[Any, list[tuple[str, Tensor]]]:
    """Five steps on a wide (5×9), a tall (8×5) and a 4×13 matrix whose 13 columns exceed
    max_preconditioner_dim = 10: the float32 library against the float64 reference, θ within 1e-5 of the
    change θ_T − θ₀ (measured ≤ 3.3e-6 for SOAP, ≤ 1.3e-6 for KL-SOAP, ≤ 2.6e-6 for REKLS).

    ε is large here because float32 rounding is divided by |G'| + ε: where G' = Q_Lᵀ·G·Q_R has an entry that
    is zero in exact arithmetic but not in float32 (the direction of a factor's null space, or a near-null
    one), Adam's N there is rounding/(|rounding| + ε), which is ±1 for ε = 1e-8 (measured with ε = 1e-8: up to
    2.9e-5 for SOAP on the wide matrix). REKLS needs ε = 1 and one refresh a step: KL's factors of one
    gradient are nearly whitened (G·(GᵀG)⁻¹·Gᵀ is a projection), so their eigenvalues are close and an eigh
    basis, re-sorted from scratch, swaps columns under rounding while V keeps its order (the QR refresh
    follows the old basis continuously and does not); measured with ε = 1e-2 or every 2 steps: 1e-4 to 0.35.
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
    extra = dict(correct_shampoo_beta_bias=bias, **rms)
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
        opt = optimizer(named, lr=0.05, weight_decay=0.0, max_preconditioner_dim=MAX_DIM)
        for row in grads:
            for (_, p), g in zip(named, row):
                p.grad = g.clone()
            opt.step()
        results[key] = [p.detach() for _, p in named]
    for a, b in (("soap", "klsoap"), ("klsoap", "rekls")):
        assert all((x - y).abs().max() > 1e-4 for x, y in zip(results[a][:2], results[b][:2])), (a, b)
    p = torch.zeros(3, 3, requires_grad=True)
    opt = SOAP([("layers.0.w", p)], lr=1.0, weight_decay=0.0)
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


# ------------------------------------------------------------------------- distributed (Shard(0)) = one process
DIST_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "soap": (SOAP, dict(lr=0.01, precondition_frequency=2, max_preconditioner_dim=16)),
    "klsoap": (KLSOAP, dict(lr=0.01, max_update_rms=0.5)),
    "rekls": (REKLS, dict(lr=0.01, max_preconditioner_dim=16, correct_bias=False)),
}
DIST_STEPS = 4


def one_process(optimizer: type, options: dict[str, Any], steps: int) -> list[Tensor]:
    with single_thread():
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
