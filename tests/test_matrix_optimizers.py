"""MOP, NorMuon and fused-matrix views (MatrixSplit): float64 references, distributed equality, DCP resume.

The references below are written from the formulas alone (no library code). A parameter holds matrices: a
2-D [m, n] one, a 3-D [E, m, n] E of them, a ≥4-D one the single matrix (shape[0], -1). With gradient g,
momentum buffer B, momentum μ, learning rate γ and weight decay λ, both optimizers start from Muon's

    B ← B + (1 − μ)(g − B);   U = g + μ(B − g) if nesterov else B

MOP: U = P·diag(S)·Qᵀ (thin SVD), O = P·Qᵀ; θ ← θ(1 − γλ) − γ·ΣS·O ("nuclear") or − γ'·O ("shape").
NorMuon: O = NS(U); v ← β₂v + (1 − β₂)·mean over columns of O²; Ô = O/(√v + ε) row-wise, rescaled to ‖O‖_F;
θ ← θ(1 − γλ) − γ'·Ô. γ' is Muon's adjusted lr: γ·√max(1, rows/cols), or γ·0.2·√max(rows, cols).

Distributed runs are compared with one process bit for bit. The one-process runs they are compared with use
one thread, as the gloo workers do (tests/dist_harness.py): on CPU a float32 (6×6)·(6×18) product, the
conv of tests/scenarios.py, already rounds differently with 2 threads than with 1.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import scenarios
import torch
from dist_harness import one_thread, run_distributed
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import MOP, MatrixSplit, Muon, NorMuon

KELLER = (3.4445, -4.7750, 2.0315)


# ---------------------------------------------------------------------------------------------- references
def as_matrices(t: Tensor) -> Tensor:
    """The matrices a parameter holds, as a batch: [m, n] → [1, m, n]; [E, m, n] as is; ≥4-D → [1, shape[0], rest]."""
    if t.ndim == 2:
        return t.unsqueeze(0)
    if t.ndim == 3:
        return t
    return t.reshape(1, t.shape[0], -1)


def momentum_update(grad: Tensor, buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """B ← B + (1 − μ)(g − B), in place on ``buf``; returns U = g + μ(B − g) if nesterov, else a copy of B."""
    buf += (1 - momentum) * (grad - buf)
    return grad + momentum * (buf - grad) if nesterov else buf.clone()


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """Muon's γ' for a rows×cols matrix: None/"original" γ·√max(1, rows/cols); "match_rms_adamw" γ·0.2·√max(rows, cols)."""
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    assert adjust_lr_fn == "match_rms_adamw", adjust_lr_fn
    return lr * 0.2 * math.sqrt(max(rows, cols))


def svd_polar(u: Tensor) -> tuple[Tensor, Tensor]:
    """For each matrix of a batch [B, m, n], the thin SVD U = P·diag(S)·Qᵀ: returns (O = P·Qᵀ, ΣS)."""
    p, s, qh = torch.linalg.svd(u, full_matrices=False)
    return p @ qh, s.sum(-1)


def newton_schulz_reference(
    u: Tensor, coefficients: tuple[float, float, float] = KELLER, steps: int = 5, eps: float = 1e-7
) -> Tensor:
    """Newton–Schulz on each matrix of a batch [B, m, n], in u's dtype.

    X = U / (‖U‖_F + eps), as Xᵀ when m > n (so X is wide); ``steps`` times A = X·Xᵀ, X ← a·X + (b·A + c·A·A)·X;
    transposed back to m×n.
    """
    a, b, c = coefficients
    tall = u.shape[-2] > u.shape[-1]
    x = u / (torch.linalg.matrix_norm(u, keepdim=True) + eps)
    if tall:
        x = x.mT
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def normuon_normalize(o: Tensor, v: Tensor, beta2: float, eps: float) -> Tensor:
    """NorMuon's row normalization of a batch O [B, m, n] with its state v [B, m] (updated in place).

    v ← β₂·v + (1 − β₂)·mean_j O²_ij;  Ô = O / (√v + eps) row by row;  returns Ô·(‖O‖_F / ‖Ô‖_F) per matrix, and
    0 for a matrix whose O is 0.
    """
    v.mul_(beta2).add_((1 - beta2) * (o * o).mean(-1))
    o_hat = o / (v.sqrt() + eps).unsqueeze(-1)
    hat_norm = torch.linalg.matrix_norm(o_hat)
    ratio = torch.linalg.matrix_norm(o) / torch.where(hat_norm > 0, hat_norm, 1.0)
    return o_hat * ratio[:, None, None]


def mop_reference(
    params: list[Tensor],
    grads: list[list[Tensor]],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    scale: str,
    adjust_lr_fn: str | None = None,
    dtype: torch.dtype = torch.float64,
) -> list[Tensor]:
    """MOP on matrix parameters, ``grads[step][i]`` the gradient of ``params[i]``; returns the parameters (dtype).

    Per matrix: momentum as Muon; U = P·diag(S)·Qᵀ, O = P·Qᵀ;
    "nuclear": θ ← θ(1 − γλ) − γ·(ΣS)·O;  "shape": θ ← θ(1 − γλ) − γ'·O, γ' = :func:`adjusted_lr`.
    """
    thetas = [p.to(dtype) for p in params]
    bufs = [torch.zeros_like(t) for t in thetas]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            u = as_matrices(momentum_update(g.to(dtype), bufs[i], momentum, nesterov))
            o, nuclear = svd_polar(u)
            rows, cols = u.shape[-2:]
            if scale == "nuclear":
                update = (lr * nuclear[:, None, None]) * o
            else:
                assert scale == "shape", scale
                update = adjusted_lr(lr, adjust_lr_fn, rows, cols) * o
            thetas[i] = thetas[i] * (1 - lr * weight_decay) - update.reshape(thetas[i].shape)
    return thetas


def normuon_reference(
    params: list[Tensor],
    grads: list[list[Tensor]],
    *,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    beta2: float,
    normuon_eps: float = 1e-8,
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
    normalize: bool = True,
    dtype: torch.dtype = torch.float64,
) -> list[Tensor]:
    """NorMuon on matrix parameters (``grads[step][i]`` for ``params[i]``); ``normalize=False`` is plain Muon.

    Per matrix: momentum as Muon; O = NS(U) (:func:`newton_schulz_reference`, Keller's coefficients);
    Ô = :func:`normuon_normalize` (v starts at zeros, one entry per row); θ ← θ(1 − γλ) − γ'·Ô.
    """
    thetas = [p.to(dtype) for p in params]
    bufs = [torch.zeros_like(t) for t in thetas]
    vs = [torch.zeros(as_matrices(t).shape[:-1], dtype=dtype) for t in thetas]
    for step_grads in grads:
        for i, g in enumerate(step_grads):
            u = as_matrices(momentum_update(g.to(dtype), bufs[i], momentum, nesterov))
            o = newton_schulz_reference(u, KELLER, ns_steps, eps)
            if normalize:
                o = normuon_normalize(o, vs[i], beta2, normuon_eps)
            rows, cols = u.shape[-2:]
            update = adjusted_lr(lr, adjust_lr_fn, rows, cols) * o
            thetas[i] = thetas[i] * (1 - lr * weight_decay) - update.reshape(thetas[i].shape)
    return thetas


# ------------------------------------------------------------------------------- one process vs references
# tall, wide, experts (tall), a conv viewed (4, 8); then AdamW by name (embedding, head) and by rank (norm)
MATRIX_SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("layers.0.attention.wq.weight", (10, 6)),
    ("layers.0.attention.wo.weight", (5, 9)),
    ("layers.0.moe.experts", (3, 6, 4)),
    ("layers.0.conv.weight", (4, 2, 2, 2)),
]
ADAMW_SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("tok_embeddings.weight", (11, 6)),
    ("layers.0.norm.weight", (6,)),
    ("output.weight", (11, 6)),
]
ADAMW_OPTIONS = dict(adamw_lr=0.01, adamw_weight_decay=0.05)  # betas (0.9, 0.95) and eps 1e-8: the defaults
STEPS = 4


def integer_ish_problem(steps: int = STEPS) -> tuple[list[tuple[str, Tensor]], list[list[Tensor]]]:
    """Parameters k/4 and gradients k/2 (k small integers: exact in float32, so both sides start equal)."""
    gen = torch.Generator().manual_seed(7)
    shapes = MATRIX_SHAPES + ADAMW_SHAPES
    init = [(n, torch.randint(-8, 9, s, generator=gen).float() / 4) for n, s in shapes]
    grads = [[torch.randint(-4, 5, s, generator=gen).float() / 2 for _, s in shapes] for _ in range(steps)]
    return init, grads


def run_library(optimizer: type, init: list[tuple[str, Tensor]], grads: list[list[Tensor]], **options: Any):
    params = [(n, t.clone().requires_grad_()) for n, t in init]
    opt = optimizer(params, **options)
    for step_grads in grads:
        for (_, p), g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for _, p in params]


def run_torch_adamw(init: list[Tensor], grads: list[list[Tensor]]) -> list[Tensor]:
    params = [t.clone().requires_grad_() for t in init]
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.05, betas=(0.9, 0.95), eps=1e-8)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def relative_error(got: Tensor, want: Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def assert_matrices_close(got, want, init, names, *, param_rtol: float, delta_rtol: float) -> None:
    """Parameters within ``param_rtol`` element-wise, and their change θ_T − θ_0 within ``delta_rtol`` in norm."""
    for name, a, b, p0 in zip(names, got, want, init):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a.double(), b, rtol=param_rtol, atol=param_rtol, msg=name)
        error = relative_error(a - p0, b - p0.double())
        assert error <= delta_rtol, f"{name}: change off by {error:.2e} relative"


def split_problem(init, grads):
    n = len(MATRIX_SHAPES)
    return init[:n], [g[:n] for g in grads], [t for _, t in init[n:]], [g[n:] for g in grads]


@pytest.mark.parametrize(
    "scale, nesterov, adjust_lr_fn, lr",
    [
        ("nuclear", False, None, 0.05),
        ("nuclear", True, None, 0.05),
        ("shape", False, None, 0.2),
        ("shape", True, "match_rms_adamw", 0.2),
        ("shape", False, "original", 0.2),
    ],
)
def test_mop_one_process_equals_float64_reference(scale, nesterov, adjust_lr_fn, lr):
    """SVD and products in float32 against float64, 4 steps: parameters within 1e-5 element-wise, each change
    θ_T − θ_0 (8% to 24% of ‖θ_0‖) within 1e-5 of its norm. Measured with these formulas run in float32 against
    float64: ≤ 1.7e-7 and ≤ 8.5e-7 (the change is large enough that θ's own float32 rounding stays below 1e-6
    of it); σ_min/σ_max of every U here is above 0.04, so the polar factor is well conditioned."""
    init, grads = integer_ish_problem()
    options = dict(lr=lr, weight_decay=0.1, momentum=0.9, nesterov=nesterov, scale=scale, adjust_lr_fn=adjust_lr_fn)
    got = run_library(MOP, init, grads, **options, **ADAMW_OPTIONS)
    matrices, matrix_grads, adamw_init, adamw_grads = split_problem(init, grads)
    want = mop_reference([t for _, t in matrices], matrix_grads, **options)
    n = len(matrices)
    assert_matrices_close(
        got[:n], want, [t for _, t in matrices], [m for m, _ in matrices], param_rtol=1e-5, delta_rtol=1e-5
    )
    for (name, _), a, b in zip(ADAMW_SHAPES, got[n:], run_torch_adamw(adamw_init, adamw_grads)):
        assert torch.equal(a, b), name


def test_mop_nuclear_scale_is_the_sum_of_singular_values_on_a_hand_case():
    """One step from θ = I with g = diag(3, −2), μ = 0.5 (no nesterov), γ = 0.1, λ = 0.5: U = B = diag(1.5, −1),
    O = diag(1, −1), ΣS = 2.5, so θ = 0.95·I − 0.1·2.5·O = diag(0.7, 1.2); with scale="shape" (square: γ' = γ)
    θ = 0.95·I − 0.1·O = diag(0.85, 1.05)."""
    for scale, want in (("nuclear", (0.7, 1.2)), ("shape", (0.85, 1.05))):
        p = torch.eye(2, requires_grad=True)
        opt = MOP([("layers.0.w", p)], lr=0.1, weight_decay=0.5, momentum=0.5, nesterov=False, scale=scale)
        p.grad = torch.tensor([[3.0, 0.0], [0.0, -2.0]])
        opt.step()
        torch.testing.assert_close(p.detach(), torch.diag(torch.tensor(want)), msg=scale)


@pytest.mark.parametrize(
    "nesterov, adjust_lr_fn, beta2, momentum",
    [(True, None, 0.95, 0.95), (False, "match_rms_adamw", 0.5, 0.9)],
)
def test_normuon_one_process_equals_float64_reference(nesterov, adjust_lr_fn, beta2, momentum):
    """ns_dtype=float32 against Newton–Schulz in float64, 5 steps: parameters within 1e-5 element-wise, each
    change θ_T − θ_0 (7% to 13% of ‖θ_0‖) within 3e-5 of its norm. Five Keller iterations amplify the rounding
    of a small singular value by up to p'(0)⁵ = 3.4⁵ ≈ 500, and the row normalization divides by √v; measured
    with these formulas run in float32 against float64: ≤ 2e-7 and ≤ 1.5e-6 (these U are well conditioned, so
    far below the 500× bound); 20× margin for the library's own float32 order of operations. NorMuon's change
    is ≥ 3e-2 away from Muon's and ≥ 1.3e-2 from a NorMuon whose v forgets (β₂ = 0): both ≫ the tolerance."""
    steps = 5
    init, grads = integer_ish_problem(steps)
    options = dict(lr=0.1, weight_decay=0.1, momentum=momentum, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    fp32 = dict(ns_dtype=torch.float32, wire_dtype=None)
    got = run_library(NorMuon, init, grads, beta2=beta2, **options, **fp32, **ADAMW_OPTIONS)
    matrices, matrix_grads, adamw_init, adamw_grads = split_problem(init, grads)
    mats, names, n = [t for _, t in matrices], [m for m, _ in matrices], len(matrices)
    want = normuon_reference(mats, matrix_grads, beta2=beta2, **options)
    assert_matrices_close(got[:n], want, mats, names, param_rtol=1e-5, delta_rtol=3e-5)
    for (name, _), a, b in zip(ADAMW_SHAPES, got[n:], run_torch_adamw(adamw_init, adamw_grads)):
        assert torch.equal(a, b), name
    # the normalization is applied (not plain Muon) and v accumulates over steps (not β₂ = 0 every step)
    muon = run_library(Muon, init, grads, **options, **fp32, **ADAMW_OPTIONS)
    muon_ref = normuon_reference(mats, matrix_grads, beta2=beta2, normalize=False, **options)
    no_memory = normuon_reference(mats, matrix_grads, beta2=0.0, **options)
    for name, a, m, m_ref, nm, b, p0 in zip(names, got, muon, muon_ref, no_memory, want, mats):
        assert relative_error(m - p0, m_ref - p0.double()) <= 3e-5, f"{name}: Muon vs its reference"
        assert relative_error(a - p0, m_ref - p0.double()) > 1e-2, f"{name}: NorMuon's update is Muon's"
        assert relative_error(b - p0.double(), nm - p0.double()) > 1e-3, f"{name}: v does not matter here"
        assert relative_error(a - p0, nm - p0.double()) > 1e-3, f"{name}: v is not accumulated"


def test_normuon_expert_with_a_zero_gradient_is_only_decayed_and_the_others_follow_the_reference():
    """A MoE expert that no token reaches has a zero gradient, so its U and O are zero and NorMuon's renormalization
    ‖O‖/‖Ô‖ is 0/0. Here expert 1 of 3 gets no gradient for two steps, then one: it must stay finite, take only the
    weight decay while its momentum is zero (θ·(1 − γλ)ᵏ, the same float32 operations as the library's: bitwise),
    and every parameter must follow the float64 reference (tolerances of the test above)."""
    torch.manual_seed(0)
    init = [("layers.0.moe.experts", torch.randn(3, 6, 4))]
    grads = [[torch.randn(3, 6, 4)] for _ in range(3)]
    for step in (0, 1):
        grads[step][0][1] = 0.0
    options = dict(lr=0.1, weight_decay=0.1, momentum=0.95, nesterov=True, beta2=0.95)
    fp32 = dict(ns_dtype=torch.float32, wire_dtype=None)
    after_two = run_library(NorMuon, init, grads[:2], **options, **fp32)[0]
    assert torch.isfinite(after_two).all()
    decayed = init[0][1][1] * (1 - 0.1 * 0.1) * (1 - 0.1 * 0.1)
    assert torch.equal(after_two[1], decayed)
    got = run_library(NorMuon, init, grads, **options, **fp32)
    want = normuon_reference([init[0][1]], [[g[0]] for g in grads], **options)
    assert torch.isfinite(got[0]).all()
    assert_matrices_close(got, want, [init[0][1]], ["experts"], param_rtol=1e-5, delta_rtol=3e-5)


# ------------------------------------------------------------------------- distributed (Shard(0)) = one process
DIST_CONFIGS: dict[str, tuple[type, dict[str, Any]]] = {
    "mop_nuclear": (MOP, dict(lr=1e-3, weight_decay=0.1, nesterov=True)),
    "mop_shape": (MOP, dict(lr=0.02, weight_decay=0.1, momentum=0.9, scale="shape", adjust_lr_fn="match_rms_adamw")),
    "normuon": (NorMuon, dict(lr=0.02, weight_decay=0.1, beta2=0.9, adjust_lr_fn="match_rms_adamw")),
    "muon": (Muon, dict(scenarios.OPTIONS)),
    "normuon_gather_all": (NorMuon, dict(lr=0.02, beta2=0.9, adjust_lr_fn="match_rms_adamw", exchange="gather_all")),
    "mop_gather_all": (MOP, dict(lr=1e-3, exchange="gather_all")),
}


def scenario_one_process(optimizer: type, options: dict[str, Any], steps: int) -> list[Tensor]:
    """tests/scenarios.py's model on plain tensors, one thread: what every distributed run must reproduce."""
    with one_thread():
        params = [(n, p.clone().requires_grad_()) for n, p in scenarios.initial_params()]
        opt = optimizer(params, **options)
        for step in range(steps):
            for (_, p), g in zip(params, scenarios.gradients(step).values()):
                p.grad = g
            opt.step()
    return [p.detach() for _, p in params]


def scenario_shard0(rank: int, world_size: int, steps: int) -> dict[str, list[Tensor]]:
    """Every optimizer of DIST_CONFIGS on scenarios' model as Shard(0) DTensors; full parameters after ``steps``."""
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


def assert_bitwise(got: list[Tensor], want: list[Tensor], names: list[str], what: str) -> None:
    for name, a, b in zip(names, got, want):
        assert torch.equal(a, b), f"{what}: {name}: max diff {(a - b).abs().max().item()}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size, steps", [(2, 3), (3, 3), (4, 3), (8, 2)])
def test_shard0_equals_one_process_bitwise(world_size, steps):
    """Bit for bit, every configuration (the three optimizers on owners, MOP and NorMuon with every rank computing
    every matrix), on tests/scenarios.py's model: uneven shards (the 20-row matrices 7/7/6 on
    3 ranks and 3×6/2/0 on 8, the 50-row embedding and 11-row head everywhere), empty shards (the 3×12 matrix and
    the 6-row conv at 4 and 8 ranks) and 5 experts, a count no world size divides (3/2, 2/2/1, 2/2/1/0, 1×5/0×3).

    Bitwise is expected as for Muon (tests/test_engine_distributed.py): momentum, v and the final update are
    row-wise or element-wise, the exchange of MOP is float32 (its default wire dtype) and of NorMuon bf16 (its
    Newton–Schulz input dtype), and each owner runs the same SVD / Newton–Schulz on the same whole matrix."""
    results = run_distributed(scenario_shard0, world_size, steps)
    names = [n for n, _ in scenarios.SHAPES]
    for key, (optimizer, options) in DIST_CONFIGS.items():
        want = scenario_one_process(optimizer, options, steps)
        for rank, result in enumerate(results):
            assert_bitwise(result[key], want, names, f"{key} at world size {world_size}, rank {rank}")


# ----------------------------------------------------------------------------------------------- NorMuon DCP
NORMUON_DCP = dict(lr=0.02, weight_decay=0.1, beta2=0.9, adjust_lr_fn="match_rms_adamw")
SAVE_STEPS, RESUME_STEPS = 2, 2


@pytest.fixture(scope="module")
def normuon_checkpoint() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as path:
        run_distributed(scenarios.dcp_save, 4, path, SAVE_STEPS, NorMuon, NORMUON_DCP)
        assert os.listdir(path)
        yield path


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_normuon_dcp_saved_on_4_resumed_on_fewer_ranks_continues_exactly(normuon_checkpoint, world_size):
    """Momentum and v (one entry per row, experts and the conv included) survive resharding: the resumed run
    equals the uninterrupted one-process run of SAVE_STEPS + RESUME_STEPS steps bit for bit."""
    results = run_distributed(
        scenarios.dcp_resume, world_size, normuon_checkpoint, SAVE_STEPS, RESUME_STEPS, NorMuon, NORMUON_DCP
    )
    want = scenario_one_process(NorMuon, NORMUON_DCP, SAVE_STEPS + RESUME_STEPS)
    names = [n for n, _ in scenarios.SHAPES]
    for rank, result in enumerate(results):
        assert_bitwise(result, want, names, f"resumed on {world_size} ranks, rank {rank}")


# ------------------------------------------------------------------------------------------------ fused views
class Fused(NamedTuple):
    name: str  # the fused parameter
    shape: tuple[int, ...]
    split: MatrixSplit
    dim: int  # the same split, spelled out for torch.split
    sizes: tuple[int, ...]
    parts: tuple[str, ...]  # the separate parameters it equals
    pattern: str  # fnmatch pattern for the matrix_splits keyword


FUSED: dict[str, Fused] = {
    "qkv": Fused(
        "layers.0.attention.wqkv.weight",
        (32, 12),
        MatrixSplit(0, sizes=(16, 8, 8)),
        0,
        (16, 8, 8),
        ("layers.0.attention.wq.weight", "layers.0.attention.wk.weight", "layers.0.attention.wv.weight"),
        "layers.*.attention.wqkv.weight",
    ),
    "heads": Fused(
        "layers.1.attention.wq.weight",
        (12, 10),
        MatrixSplit(0, block=4),
        0,
        (4, 4, 4),
        ("layers.1.attention.wq_h0.weight", "layers.1.attention.wq_h1.weight", "layers.1.attention.wq_h2.weight"),
        "layers.*.attention.wq.weight",
    ),
    "swiglu": Fused(
        "layers.0.feed_forward.w13.weight",
        (40, 12),
        MatrixSplit(0, sizes=(20, 20)),
        0,
        (20, 20),
        ("layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w3.weight"),
        "layers.*.feed_forward.w13.weight",
    ),
    "columns": Fused(
        "layers.1.attention.wo.weight",
        (12, 20),
        MatrixSplit(1, sizes=(8, 12)),
        1,
        (8, 12),
        ("layers.1.attention.wo_a.weight", "layers.1.attention.wo_b.weight"),
        "layers.*.attention.wo.weight",
    ),
}
FUSED_OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    # "original" adjust: √max(1, rows/cols) differs between a block (16×12) and the whole (32×12)
    "muon": (Muon, dict(lr=0.02, weight_decay=0.1)),
    "normuon": (NorMuon, dict(lr=0.02, weight_decay=0.1, beta2=0.9, adjust_lr_fn="match_rms_adamw")),
}
FUSED_STEPS = 3


def fused_init(case: Fused) -> Tensor:
    return torch.randn(case.shape, generator=torch.Generator().manual_seed(len(case.name) * 31 + case.shape[0]))


def fused_grad(case: Fused, step: int) -> Tensor:
    gen = torch.Generator().manual_seed(5000 + 100 * step + case.shape[0] + case.shape[1])
    return torch.randn(case.shape, generator=gen)


def run_fused_cases(
    optimizer: type, options: dict[str, Any], cases: list[Fused], form: str, steps: int, mesh=None
) -> list[Tensor]:
    """Run ``cases`` in one optimizer; returns each fused parameter's final value (separate parts concatenated).

    ``form``: "separate" (each part its own parameter), "group" (the ``matrix_split`` group key), "keyword" (the
    ``matrix_splits`` front-end keyword), "unsplit" (the fused parameter as one matrix). With ``mesh``: Shard(0)
    DTensors.
    """

    def place(t: Tensor) -> Tensor:
        return t.clone() if mesh is None else distribute_tensor(t, mesh, [Shard(0)])

    def pieces(t: Tensor, case: Fused) -> list[Tensor]:
        return list(torch.split(t, case.sizes, case.dim)) if form == "separate" else [t]

    params = [[nn.Parameter(place(piece.contiguous())) for piece in pieces(fused_init(case), case)] for case in cases]
    if form == "separate":
        groups: list[dict[str, Any]] = [
            {"params": [(n, p) for case, ps in zip(cases, params) for n, p in zip(case.parts, ps)]}
        ]
    elif form == "group":
        groups = [{"params": [(case.name, ps[0])], "matrix_split": case.split} for case, ps in zip(cases, params)]
    else:
        groups = [{"params": [(case.name, ps[0]) for case, ps in zip(cases, params)]}]
    extra = {"matrix_splits": {case.pattern: case.split for case in cases}} if form == "keyword" else {}
    opt = optimizer(groups, **options, **extra)
    for step in range(steps):
        for case, ps in zip(cases, params):
            for p, g in zip(ps, pieces(fused_grad(case, step), case)):
                p.grad = place(g.contiguous())
        opt.step()
    full = [[p.full_tensor() if mesh is not None else p.detach() for p in ps] for ps in params]
    return [torch.cat(ps, dim=case.dim) for case, ps in zip(cases, full)]


@pytest.mark.parametrize("optimizer_key", list(FUSED_OPTIMIZERS))
@pytest.mark.parametrize("case_key", list(FUSED))
def test_matrix_split_equals_separate_parameters_one_process(case_key, optimizer_key):
    """q/k/v by sizes, heads by block, SwiGLU's w1/w3, and a split along columns: bit for bit the same parameters
    as the separate matrices (each block its own Newton–Schulz, lr adjustment and NorMuon rows); the group key
    and the keyword agree; without the split the fused matrix moves differently."""
    case = FUSED[case_key]
    optimizer, options = FUSED_OPTIMIZERS[optimizer_key]
    want = run_fused_cases(optimizer, options, [case], "separate", FUSED_STEPS)[0]
    for form in ("group", "keyword"):
        got = run_fused_cases(optimizer, options, [case], form, FUSED_STEPS)[0]
        assert torch.equal(got, want), f"{form}: max diff {(got - want).abs().max().item()}"
    unsplit = run_fused_cases(optimizer, options, [case], "unsplit", FUSED_STEPS)[0]
    assert (unsplit - want).abs().max() > 1e-3


def test_matrix_splits_keyword_matches_every_layer_and_only_matching_names():
    """``layers.*.attention.wqkv.weight`` splits both layers' wqkv; a wo that does not match stays one matrix."""
    gen = torch.Generator().manual_seed(3)
    init = {
        "layers.0.attention.wqkv.weight": torch.randn(32, 12, generator=gen),
        "layers.1.attention.wqkv.weight": torch.randn(32, 12, generator=gen),
        "layers.0.attention.wo.weight": torch.randn(12, 20, generator=gen),
    }
    grads = [{n: torch.randn(t.shape, generator=gen) for n, t in init.items()} for _ in range(FUSED_STEPS)]
    split = MatrixSplit(0, sizes=(16, 8, 8))

    def run(separate: bool) -> dict[str, Tensor]:
        params = {}
        for n, t in init.items():
            pieces = torch.split(t, (16, 8, 8)) if separate and "wqkv" in n else [t]
            params[n] = [torch.nn.Parameter(piece.clone()) for piece in pieces]
        named = [(f"{n}.{i}" if separate else n, p) for n, ps in params.items() for i, p in enumerate(ps)]
        extra = {} if separate else {"matrix_splits": {"layers.*.attention.wqkv.weight": split}}
        opt = Muon(named, lr=0.02, weight_decay=0.1, **extra)
        for step_grads in grads:
            for n, ps in params.items():
                chunks = torch.split(step_grads[n], (16, 8, 8)) if separate and "wqkv" in n else [step_grads[n]]
                for p, g in zip(ps, chunks):
                    p.grad = g.clone()
            opt.step()
        return {n: torch.cat([p.detach() for p in ps]) for n, ps in params.items()}

    got, want = run(separate=False), run(separate=True)
    for n in init:
        assert torch.equal(got[n], want[n]), n


def fused_shard0(rank: int, world_size: int, steps: int) -> dict[str, list[Tensor]]:
    """All FUSED cases in one optimizer on Shard(0) DTensors, for each optimizer and form."""
    mesh = init_device_mesh("cpu", (world_size,))
    cases = list(FUSED.values())
    return {
        f"{key}/{form}": run_fused_cases(optimizer, options, cases, form, steps, mesh)
        for key, (optimizer, options) in FUSED_OPTIMIZERS.items()
        for form in ("separate", "group", "keyword")
    }


@pytest.mark.slow
def test_matrix_split_under_shard0_at_world_size_3_equals_separate_one_process():
    """wqkv's 32 rows shard 11/11/10 and w13's 40 rows 14/14/12 (blocks cross ranks), wo is split along columns
    inside each shard, the separate 4-row heads shard 2/2/0: the fused views under Shard(0) (group key and keyword)
    equal the separate parameters in one process bit for bit, as do the separate parameters under Shard(0)."""
    results = run_distributed(fused_shard0, 3, FUSED_STEPS)
    cases = list(FUSED.values())
    for key, (optimizer, options) in FUSED_OPTIMIZERS.items():
        with one_thread():
            want = run_fused_cases(optimizer, options, cases, "separate", FUSED_STEPS)
        for form in ("separate", "group", "keyword"):
            for rank, result in enumerate(results):
                assert_bitwise(result[f"{key}/{form}"], want, [c.name for c in cases], f"{key}/{form}, rank {rank}")


@pytest.mark.parametrize(
    "split, how",
    [
        (MatrixSplit(0, sizes=(16, 8, 7)), "group"),  # 31 of 32 rows
        (MatrixSplit(0, sizes=(16, 8, 8, 8)), "keyword"),  # 40 of 32 rows
        (MatrixSplit(1, sizes=(6, 5)), "group"),  # 11 of 12 columns
        (MatrixSplit(0, block=5), "keyword"),  # 32 rows are not blocks of 5
    ],
)
def test_bad_split_raises_value_error_naming_the_parameter(split, how):
    name = "layers.3.attention.wqkv.weight"
    param = nn.Parameter(torch.zeros(32, 12))
    with pytest.raises(ValueError, match=re.escape(name)):
        if how == "group":
            Muon([{"params": [(name, param)], "matrix_split": split}])
        else:
            Muon([(name, param)], matrix_splits={"layers.*.attention.wqkv.weight": split})


@pytest.mark.parametrize("optimizer_name", ["NorMuon", "SOAP"])
@pytest.mark.parametrize("flatten", [False, True])
def test_owner_state_round_trips_through_get_and_set_optimizer_state_dict(optimizer_name, flatten):
    """torchtitan saves optimizers through get_optimizer_state_dict(flatten_optimizer_state_dict=True): owner
    state (NorMuon's v, all of SOAP's state) comes back and the next step equals the uninterrupted one."""
    import copy

    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    import dtensor_muon

    cls = getattr(dtensor_muon, optimizer_name)
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
        return model, cls(model.named_parameters(), lr=0.01)

    model, opt = model_and_optimizer()
    for step in range(2):
        torch.manual_seed(10 + step)
        model(torch.randn(3, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt, options=options))
    assert any("owner_state" in str(key) for key in (saved if flatten else saved["state"]["0.weight"]))
    resumed_model, resumed = model_and_optimizer()
    resumed_model.load_state_dict(model.state_dict())
    set_optimizer_state_dict(resumed_model, resumed, saved, options=options)
    torch.manual_seed(20)
    x = torch.randn(3, 8)
    for m, o in ((model, opt), (resumed_model, resumed)):
        m(x).sum().backward()
        o.step()
    for (name, a), b in zip(model.named_parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), name
