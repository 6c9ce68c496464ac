"""SOAP's rule (Adam in the eigenbasis of Shampoo's Kronecker factors), with KL-Shampoo's factors as an option.

Everything runs on the matrix's owner, in float32, on the whole m×n gradient G (``prepare`` only casts the
gradient and counts the parameter's steps in its one shard-state entry, a 0-d ``step`` as torch's AdamW keeps:
the front end treats a parameter with empty state as frozen). Step t = 1, 2, … of one matrix, in Emerging-Optimizers' order (its
``soap.py``: factors, then the basis, then Adam in the refreshed basis):

1. Kronecker factors, β_t = 1 − (1 − β)/(1 − βᵗ) with ``correct_shampoo_beta_bias`` (so L₁ = G₁G₁ᵀ exactly:
   the bias-corrected EMA), else β_t = β (an EMA from zero: L₁ = (1 − β)·G₁G₁ᵀ), β = ``shampoo_beta``::

       SOAP:      L ← β_t·L + (1 − β_t)·G·Gᵀ                     R ← β_t·R + (1 − β_t)·Gᵀ·G
       KL (kl):   L ← β_t·L + (1 − β_t)/n·G·Q_R·Λ_R⁻¹·Q_Rᵀ·Gᵀ     R ← β_t·R + (1 − β_t)/m·Gᵀ·Q_L·Λ_L⁻¹·Q_Lᵀ·G

   with the bases Q of the previous step (the identity on step 1) and Λ = max(diag(Qᵀ·K·Q), ε) the
   eigenvalue estimates of the factors K *before* this update, clamped below at ε = ``eps`` (Adam's ε, as
   Emerging-Optimizers does; on step 1 the factors are 0, so Λ = ε).
2. Basis refresh on steps t with (t − 1) mod ``precondition_frequency`` = 0 (step 1 always), per side with
   the factor K just updated (1.) and the old basis Q_old, as Emerging-Optimizers 0.3 does for both bases (its
   ``soap/soap.py``, ``update_eigenbasis_and_exp_avgs``): d = diag(Q_oldᵀ·K·Q_old), and the columns of Q_old
   and V's matching axis are sorted by decreasing d (V is reordered, never rotated); then

       step 1, or basis="eigh":  Q = eigh(K), columns by decreasing eigenvalue
       basis="qr":               Q = qr(K·Q_old) of the sorted Q_old (one power iteration, Householder QR)
       basis="cholqr":           Q = qr((K + ρ·2ᵉ·I)·Q_old) of the sorted Q_old by Cholesky QR on matrix
                                 products, same-size factors of the call batched, M rotated as C_L·M·C_Rᵀ
                                 with C = Q_newᵀ·Q_old (the same rotation in one product per side); see
                                 :mod:`dtensor_muon.linalg.eigenbasis` for the shift, each phase's precision and
                                 where it falls back to eigh (its products are float32-accurate whatever
                                 torch's float32 matmul precision; C_L·M·C_Rᵀ, like the factors' and Adam's
                                 products of every basis, runs at that precision: float32 by default, TF32
                                 with torch.set_float32_matmul_precision("high"))

   and M is taken back to the parameter's basis with the old Q and into the new one,
   M ← Q_Lnewᵀ·Q_Lold·M·Q_Roldᵀ·Q_Rnew. The sort gives V's entry of the old column with the k-th largest d to
   the new column of the k-th largest eigenvalue: the same direction while the factor drifts slowly. On step 1
   V = 0 and the sort changes nothing.

   A refresh never raises. eigh runs on K·2⁻ᵉ, 2ᵉ the power of two nearest max|K| (exact; the eigenvectors
   are unchanged and the eigenvalues scaled back, so tiny and huge factors neither underflow nor overflow
   inside it), and is accepted when its output is finite and max|QᵀQ − I| ≤ 10⁻³ (float64): tried in float32,
   then in float64, then in float64 on K + s·I with s = 10⁻³·(|tr K|/k + 2⁻¹²⁶) for the scaled K (the same
   eigenvectors; s is taken off the eigenvalues, which may still overflow to ±inf in float32 when the top
   eigenvalue exceeds float32's range). A K with an inf or NaN, or one on which all three fail, keeps the
   sorted Q_old (on step 1 the identity) and d as its estimates: the basis M and V already live in, so the
   moments stay consistent, while a NaN K says nothing about a better one. The QR refresh keeps the
   sorted Q_old where qr(K·Q_old) is not finite; Householder QR itself does not fail on a rank-deficient (or
   zero) K·Q_old, whose Q is orthogonal whatever the rank (also on the tiny factors that break float32 eigh:
   docs/numerics.md "SOAP's basis refresh").
3. Adam in the basis, with τ = t − 1 under ``skip_first_update`` (step 1 then only builds the factors and
   the basis: M and V stay 0 and O = 0, so θ moves by the weight decay alone, as the original SOAP's first
   step, arXiv 2409.11321, which updates no parameter) and τ = t otherwise: G' = Q_Lᵀ·G·Q_R;
   M ← β₁M + (1 − β₁)G'; V ← β₂V + (1 − β₂)G'²;
   N = (M/(1 − β₁^τ)) / (√(V/(1 − β₂^τ)) + ε) (without ``correct_bias``: N = M/(√V + ε)); O = Q_L·N·Q_Rᵀ,
   scaled by min(1, ρ/(rms(O) + 1e-7)) when ``max_update_rms`` = ρ > 0 (rms over the matrix), or to an
   RMS of exactly ρ', O ← O·ρ'/(rms(O) + 1e-7), when ``match_update_rms`` = ρ' > 0 (so that AdamW's learning
   rate and schedule carry over: AdamW's updates have an RMS of about 0.2–0.4);
   θ ← θ·(1 − γλ) − γ·O.

   Why the front ends clip (``max_update_rms`` = 1) and skip step 1 by default: in a fixed basis Adam's N has
   entries of size about 1 or less, but here M is rotated into each new basis while V is only permuted, and
   G' = Q_Lᵀ·G·Q_R has float32 rounding (~1e-7·|G|) in directions where a factor has (almost) no mass; there V
   is tiny and N = M̂/(√V̂ + ε) grows far above 1. Without skip or clip, step 1 is sign-Adam (every entry of N
   is ±1 where |G'| > ε, rounding included) and later steps can diverge; the skip alone diverges too (the
   rotated M meets a V built from one gradient). The measured losses, on tests/test_soap.py's MLP:
   docs/optimizers.md "SOAP, KL-SOAP and REKLS".

A side longer than ``max_preconditioner_dim`` is not preconditioned: its Q is the identity and no factor, basis
or Λ is kept for it (with ``kl``, the other side's factor then uses Λ = 1 on it: L ← … + (1 − β_t)/n·G·Gᵀ).

Owner state per matrix (float32 unless said): ``exp_avg`` M and ``exp_avg_sq`` V [m, n]; per preconditioned
side ``L``/``R``, ``Q_L``/``Q_R`` and ``eig_L``/``eig_R`` (the eigenvalue estimates last computed: eigh's
eigenvalues, the QR path's (or a failed eigh's) sorted d, or KL's unclamped Λ); ``step`` (int64, the steps taken).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import Tensor
from torch.optim.optimizer import _to_scalar

from ..kernels.batching import group_into_stacks
from ..linalg.eigenbasis import LARGE_BATCH_ENTRIES, accurate_matmul, power_cholqr
from .base import Group, MatrixCost, MatrixRule, NewtonSchulzRunner

T = TypeVar("T")

SOAP_BASES = ("qr", "eigh", "cholqr")

EIGH_FLOPS_PER_CUBE = 9
"""FLOPs of a symmetric eigendecomposition with eigenvectors, per side³ (Golub–Van Loan's symmetric QR: 9k³)."""

QR_FLOPS_PER_CUBE = 8 / 3
"""Householder QR of a k×k matrix with Q formed: 4k³/3 for R and 4k³/3 to form Q."""

CHOLQR_ACCURATE_PER_CUBE = 2 + 2 + 2 + 2
"""basis="cholqr" per side k, per k³, from a warm basis: the float32-accurate products K·Q, the two Gram
matrices (of the Cholesky pass and of the series pass) and Q_newᵀ·Q_old (nominal FLOPs; on CUDA each runs as
2–3 TF32 products)."""
CHOLQR_CHOLESKY_PER_CUBE = 1 / 3
"""The Cholesky factorization of the first pass, per k³."""
CHOLQR_SOLVE_PER_CUBE = 1
"""The triangular solve Q·R⁻¹ of the first pass, per k³."""
CHOLQR_TF32_PER_CUBE = 3 * 2
"""The series pass's three TF32 products, per k³."""
CHOLQR_BATCH_SECONDS = 2.4e-3
"""The fixed time of one basis="cholqr" refresh batch besides its operations' FLOPs (at the rates of
:data:`OPERATION_TFLOPS`): the host's, which launches the refresh's many kernels and waits for the device.
Chosen by measurement: BENCHMARKS.md "Every rank timed: the slowest rank of each plan"."""

OPERATION_TFLOPS = {
    "product_highest": 49.0,
    "product_high": 380.0,
    "product_medium": 380.0,
    "accurate_product": 99.0,
    "cholesky": 12.7,
    "triangular_solve": 24.0,
    "eigh": 6.9,
    "householder_qr": 6.4,
}
"""Rates (TFLOP/s of nominal FLOPs) of SOAP's operations on float32 k×k matrices: a product at each torch
float32 matmul precision (float32; TF32), a float32-accurate split-TF32 product, ``cholesky_ex``,
``solve_triangular``, ``eigh`` (9k³) and Householder ``qr`` with Q formed (8k³/3).
The plan weighs each operation by them (:meth:`SOAPRule.cost`): a factorization's FLOP costs 15–60 TF32
product FLOPs, so a plan of nominal FLOPs loads the ranks that own square matrices (two factors of
4096 to refresh) far more than it thinks.
Chosen by measurement: BENCHMARKS.md "Every rank timed: the slowest rank of each plan" (re-measure:
tools/soap/refresh_ops.py)."""

UPDATE_RMS_EPS = 1e-7
"""Added to the update's RMS before clipping it (Emerging-Optimizers' value)."""

CLIP_HEADROOM = 4.0
"""On a matrix of N ≤ :data:`CLIP_SKIP_MAX_NUMEL` entries, a ``max_update_rms`` ρ at least this many times
``match_update_rms`` ρ' cannot bind, so its pass is skipped (the same bits). The matched update's computed RMS
is ρ'·r₂/r₁, where r₁, r₂ are the computed RMS of O and of the scaled O over their exact values; a float32 sum of
N non-negative terms in any order is within a factor e^{±N·u} of the exact sum (u = 2⁻²⁴), so each r within
e^{±N·u/2} and r₂/r₁ ≤ e^{N·u} ≤ e < 4 (with roundings of order u beside it). The clip's factor
min(1, ρ/(rms + ε)) is then exactly 1, and O·1 is O."""

CLIP_SKIP_MAX_NUMEL = 2**24
"""Largest matrix (entries) whose clip :data:`CLIP_HEADROOM` may skip: N·u ≤ 1 there."""


EIGH_SHIFT = 1e-3
"""δ of the last eigh attempt on K: K + δ·(|tr K|/k + tiny)·I (see :func:`eigh_descending`)."""

EIGH_ORTHOGONALITY_TOL = 1e-3
"""Largest max |QᵀQ − I| an eigh result may have. Float32 eigh on CUDA can return, without raising, bases far
from orthogonal on unscaled factors of tiny gradients; after the power-of-two scaling such factors give bases
well within it (docs/numerics.md "SOAP's basis refresh")."""


def preconditioned_sides(group: Group, shape: tuple[int, int]) -> tuple[bool, bool]:
    """(left, right): whether each side of an m×n matrix is at most ``max_preconditioner_dim`` long."""
    limit = group["max_preconditioner_dim"]
    return shape[0] <= limit, shape[1] <= limit


def rayleigh_diag(k: Tensor, q: Tensor) -> Tensor:
    """diag(Qᵀ·K·Q) (the eigenvalue estimates of K in the basis Q)."""
    return ((q.mT @ k) * q.mT).sum(-1)


def eigh_descending(k: Tensor, fallback: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eigenvalues and eigenvectors of the symmetric K, by decreasing eigenvalue, in K's dtype; never raises.

    K is first scaled by the power of two 2⁻ᵉ nearest to 1/max|K| (exact; the eigenvectors do not change and
    the eigenvalues are scaled back), so tiny or huge factors do not underflow or overflow inside eigh. Then,
    until one gives finite values and a basis within ``EIGH_ORTHOGONALITY_TOL`` of orthogonal (max |QᵀQ − I|
    in float64): eigh in K's dtype, eigh in float64, eigh in float64 of the shifted K + s·I with
    s = ``EIGH_SHIFT``·(|tr K|/k + tiny) (its eigenvalues less s). A K with an inf or NaN, or one on which all
    three fail, gives ``fallback`` (the identity if None) and diag(fallbackᵀ·K·fallback)."""
    if bool(torch.isfinite(k).all()):
        for x, offset, scale in eigh_attempts(k):
            try:
                values, vectors = torch.linalg.eigh(x)
            except torch.linalg.LinAlgError:
                continue
            if bool(torch.isfinite(values).all()) and orthogonality_defect(vectors) <= EIGH_ORTHOGONALITY_TOL:
                values = (values.to(torch.float64) - offset) * scale
                return values.to(k.dtype).flip(-1), vectors.to(k.dtype).flip(-1)
    basis = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device) if fallback is None else fallback
    return rayleigh_diag(k, basis), basis


def orthogonality_defect(q: Tensor) -> float:
    """max |QᵀQ − I| computed in float64 (inf where Q is not finite)."""
    q64 = q.to(torch.float64)
    gram = q64.mT @ q64 - torch.eye(q.shape[-1], dtype=torch.float64, device=q.device)
    return gram.abs().max().nan_to_num(float("inf")).item()


def eigh_attempts(k: Tensor) -> Iterator[tuple[Tensor, float, float]]:
    """(matrix, shift, scale) for :func:`eigh_descending`, each built only when the one before has failed:
    K's eigenvalues are (eigh(matrix)'s − shift)·scale, its eigenvectors eigh(matrix)'s; scale a power of two."""
    peak = k.abs().max().item()
    scale = 2.0 ** round(math.log2(peak)) if peak > 0 else 1.0
    wide = k.to(torch.float64) / scale  # exact: a power of two, in float64's range
    yield wide.to(k.dtype), 0.0, scale
    yield wide, 0.0, scale
    shift = EIGH_SHIFT * (wide.diagonal().sum().abs().item() / k.shape[-1] + torch.finfo(k.dtype).tiny)
    yield wide + shift * torch.eye(k.shape[-1], dtype=wide.dtype, device=wide.device), shift, scale


def qr_basis(k: Tensor, q: Tensor) -> Tensor:
    """The orthogonal factor of K·Q (one power iteration, Householder QR), or Q where that is not finite."""
    q_new = torch.linalg.qr(k @ q).Q
    return torch.where(torch.isfinite(q_new).all(), q_new, q)


def kl_inverse(k: Tensor, q: Tensor, eps: float, other_side: int) -> tuple[Tensor, Tensor]:
    """(Q·diag(1/(other_side·max(d, ε)))·Qᵀ, d) with d = diag(Qᵀ·K·Q): KL-Shampoo's scaled inverse factor."""
    d = rayleigh_diag(k, q)
    scale = 1.0 / (other_side * d.clamp_min(eps))
    return (q * scale.unsqueeze(-2)) @ q.mT, d


def shampoo_beta_at(group: Group, t: int) -> float:
    """β_t of step t (see the module formula)."""
    beta = group["shampoo_beta"]
    if group["correct_shampoo_beta_bias"]:
        return 1 - (1 - beta) / (1 - beta**t)
    return beta


FACTOR_KEYS = ("L", "R")
"""The owner-state entries :meth:`SOAPRule.update_factors` writes; with ``kl`` also :data:`KL_KEYS`, and it reads
:data:`BASIS_KEYS`."""
KL_KEYS = ("eig_L", "eig_R")
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
"""The owner-state entries :meth:`SOAPRule.adam_in_basis` writes (it also reads :data:`BASIS_KEYS`)."""
BASIS_KEYS = ("Q_L", "Q_R")


def chunks(items: list[T], size: int) -> list[list[T]]:
    """``items`` in consecutive runs of at most ``size``."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def stacked_rows(x: Tensor, rows: list[int]) -> Tensor:
    """``x[rows]`` for a [B, m, n] batch: the one matrix ([m, n]) for one row, the whole batch uncopied for all."""
    if len(rows) == 1:
        return x[rows[0]]
    return x if len(rows) == x.shape[0] else x[rows]


@contextmanager
def joint_states(
    states: list[dict[str, Tensor]], writes: tuple[str, ...], reads: tuple[str, ...] = ()
) -> Iterator[dict[str, Tensor]]:
    """One state dict for matrices that take the same step: the one matrix's own state, or the entries of
    ``writes`` and ``reads`` that the states hold, stacked to [B, …] (copies), those of ``writes`` copied back
    into every matrix's entry on leaving."""
    if len(states) == 1:
        yield states[0]
        return
    joint = {k: torch.stack([s[k] for s in states]) for k in (*writes, *reads) if k in states[0]}
    yield joint
    written = [k for k in writes if k in joint]  # one multi-tensor copy for every written entry
    torch._foreach_copy_([s[k] for k in written for s in states], [t for k in written for t in joint[k].unbind(0)])


def matrix_rms(x: Tensor) -> Tensor:
    """√mean(X²) of a matrix, or of each matrix of a [B, m, n] batch (shape [B, 1, 1])."""
    if x.dim() == 2:
        return x.square().mean().sqrt()
    return x.square().mean(dim=(-2, -1), keepdim=True).sqrt()


class SOAPRule(MatrixRule):
    """SOAP / KL-SOAP (see the module formula); shard state a step count, the rest on the owner."""

    name = "soap"
    shard_state_keys = ("step",)
    has_owner_state = True
    host_owner_state_keys = ("step",)

    def init_shard_state(self, param: Tensor, group: Group, name: str) -> dict[str, Tensor]:
        return {"step": torch.tensor(0.0, dtype=torch.float32)}

    def init_owner_state(self, shape: tuple[int, int], group: Group, device: torch.device) -> dict[str, Tensor]:
        m, n = shape
        left, right = preconditioned_sides(group, shape)
        f32 = dict(dtype=torch.float32, device=device)
        state = {
            "step": torch.zeros((), dtype=torch.int64),  # on the host (host_owner_state_keys)
            "exp_avg": torch.zeros(m, n, **f32),
            "exp_avg_sq": torch.zeros(m, n, **f32),
        }
        for side, k, keep in (("L", m, left), ("R", n, right)):
            if keep:
                state[side] = torch.zeros(k, k, **f32)
                state[f"Q_{side}"] = torch.eye(k, **f32)
                state[f"eig_{side}"] = torch.zeros(k, **f32)
        return state

    def can_batch(self, group: Group) -> bool:
        """basis="cholqr" takes a unit of same-shape matrices at once (its refresh is one batched operation per
        factor size); the reference bases run one matrix at a time."""
        return group["basis"] == "cholqr"

    def cost(self, group: Group, shape: tuple[int, int]) -> MatrixCost:
        """FLOPs per step: the factor products (2m²n + 2mn² each side, KL adds 4k³ per side for Λ and
        Q·Λ⁻¹·Qᵀ and 2mn·k for the extra product), the projections G' and O (4m²n + 4mn²) and, divided by
        ``precondition_frequency``, the refresh: the rotation of M (4m²n + 4mn²) and per side d = diag(Qᵀ·K·Q)
        for the sort (2k³), then eigh (9k³) or K·Q and QR (2k³ + 8k³/3); basis="cholqr": the rotation
        C_L·M·C_Rᵀ (2m²n + 2mn²) and per side 46k³/3 from a warm basis (K·Q 2, a Cholesky QR pass: Gram 2,
        Cholesky 1/3, triangular solve 1; a series pass: Gram 2, three products 6; Q_newᵀ·Q_old 2). Owner
        bytes: 4·(2mn + 2k² + k per preconditioned side k) + 8. The plan balances each operation's FLOPs at
        its rate (:data:`OPERATION_TFLOPS`; the products of the factors, projections and rotations at the rate of
        torch's float32 matmul precision when the optimizer is built), as FLOPs of TF32 products; with
        basis="cholqr" the fixed time of the refresh batches (:data:`CHOLQR_BATCH_SECONDS`, one per side
        length) is ``batch_flops``, which the matrices of a unit (stacked experts) share."""
        m, n = shape
        left, right = preconditioned_sides(group, shape)
        sides = [k for k, keep in ((m, left), (n, right)) if keep]
        mn = m * n
        product = "product_" + torch.get_float32_matmul_precision()
        product = product if product in OPERATION_TFLOPS else "product_highest"
        work: list[tuple[float, str]] = []  # (FLOPs, operation), refresh FLOPs already per step
        if left:
            work.append((2 * m * mn, product))
        if right:
            work.append((2 * n * mn, product))
        if group["kl"]:
            work.append((sum(4 * k**3 for k in sides) + 2 * mn * (m * left + n * right), product))
        projections = 2 * mn * (m * left + n * right)
        work.append((2 * projections, product))
        every = group["precondition_frequency"]
        cubes = sum(k**3 for k in sides)
        if group["basis"] == "cholqr":
            work += [
                (projections / every, product),
                (CHOLQR_ACCURATE_PER_CUBE * cubes / every, "accurate_product"),
                (CHOLQR_CHOLESKY_PER_CUBE * cubes / every, "cholesky"),
                (CHOLQR_SOLVE_PER_CUBE * cubes / every, "triangular_solve"),
                (CHOLQR_TF32_PER_CUBE * cubes / every, "product_high"),
            ]
        else:
            work += [(2 * projections / every, product), (2 * cubes / every, product)]
            if group["basis"] == "eigh":
                work.append((EIGH_FLOPS_PER_CUBE * cubes / every, "eigh"))
            else:
                work += [(2 * cubes / every, product), (QR_FLOPS_PER_CUBE * cubes / every, "householder_qr")]
        flops = sum(f for f, _ in work)
        balance = sum(f * OPERATION_TFLOPS["product_high"] / OPERATION_TFLOPS[op] for f, op in work)
        batch = 0.0
        if group["basis"] == "cholqr":  # one refresh batch per side length for the whole unit
            batch = len(set(sides)) * CHOLQR_BATCH_SECONDS * OPERATION_TFLOPS["product_high"] * 1e12 / every
        state_bytes = 4 * (2 * mn + sum(2 * k * k + k for k in sides)) + 8
        return MatrixCost(int(flops), state_bytes, int(balance), int(batch))

    def input_dtype(self, group: Group) -> torch.dtype:
        return torch.float32

    def prepare(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> Tensor:
        return grad.to(torch.float32)

    def advance(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> None:
        shard_state["step"].add_(1)

    def direction(
        self, u: Tensor, owner_states: list[dict[str, Tensor]], group: Group, runner: NewtonSchulzRunner
    ) -> Tensor:
        """The module formula's steps 1–3 on one matrix (``u`` [m, n]) or a unit of them ([B, m, n], one state
        each; basis="cholqr" only): :meth:`update_factors`, :meth:`refresh_bases` on the steps
        :meth:`refreshes_at` names, :meth:`adam_in_basis` (at Adam's step τ; with ``skip_first_update`` a zero
        update on the matrix's step 1); then each matrix's step count advances. Everything is per matrix, on its
        owner, from the owner state's ``step``: the same at every world size. A unit's matrices at the same step
        run as one batch (:func:`joint_states`: their states stacked, each product a batched one, and written
        back; at most ``LARGE_BATCH_ENTRIES`` entries per stacked tensor), so a unit of B experts takes the
        launches of one matrix rather than B times them; the cholqr refresh batches the same-size factors of the
        unit."""
        grads = u.to(torch.float32)
        grads = grads[None] if u.dim() == 2 else grads
        steps = [int(t) + 1 for t in torch.stack([s["step"] for s in owner_states]).tolist()]  # host: no sync
        largest = max(x.numel() for x in owner_states[0].values())  # all of a unit's states have one shape
        per_batch = max(1, LARGE_BATCH_ENTRIES // largest)
        same_step = group_into_stacks(range(len(steps)), steps.__getitem__, per_batch)
        batches = [(steps[chunk[0]], chunk) for chunk in same_step]
        factor_writes, factor_reads = (FACTOR_KEYS + KL_KEYS, BASIS_KEYS) if group["kl"] else (FACTOR_KEYS, ())
        for t, chunk in batches:
            states = [owner_states[i] for i in chunk]
            with joint_states(states, factor_writes, factor_reads) as joint:
                self.update_factors(stacked_rows(grads, chunk), joint, group, t)
        refreshing = [(s, t) for s, t in zip(owner_states, steps) if self.refreshes_at(group, t)]
        if refreshing:
            self.refresh_bases([s for s, _ in refreshing], group, [t for _, t in refreshing])
        pieces = []
        for t, chunk in batches:
            states = [owner_states[i] for i in chunk]
            if group["skip_first_update"] and t == 1:  # step 1 builds the factors and basis only
                update = torch.zeros_like(stacked_rows(grads, chunk))
            else:
                tau = t - 1 if group["skip_first_update"] else t  # Adam counts from step 2 under the skip
                with joint_states(states, MOMENT_KEYS, BASIS_KEYS) as joint:
                    update = self.adam_in_basis(stacked_rows(grads, chunk), joint, group, tau)
            pieces.append((chunk, update))
        torch._foreach_add_([s["step"] for s in owner_states], 1)
        if len(pieces) == 1:
            return pieces[0][1].reshape(u.shape)  # a batch of one matrix comes back as [1, m, n]
        updates = torch.empty_like(grads)
        for chunk, update in pieces:
            updates[chunk] = update
        return updates

    @staticmethod
    def refreshes_at(group: Group, t: int) -> bool:
        """Whether step t refreshes the basis: (t − 1) mod ``precondition_frequency`` = 0 (step 1 always)."""
        return (t - 1) % group["precondition_frequency"] == 0

    def update_factors(self, g: Tensor, s: dict[str, Tensor], group: Group, t: int) -> None:
        """Step 1: the factors L, R (KL-Shampoo's with ``kl``) take step t's float32 gradient ``g``, in place: one
        matrix ([m, n], its state) or a batch at the same step ([B, m, n], states stacked by :func:`joint_states`)."""
        m, n = g.shape[-2:]
        left, right = "L" in s, "R" in s
        weight = 1 - shampoo_beta_at(group, t)
        if group["kl"]:
            eps = group["eps"]
            inv_l = inv_r = None
            if left:
                inv_l, s_eig = kl_inverse(s["L"], s["Q_L"], eps, m)
                s["eig_L"].copy_(s_eig)
            if right:
                inv_r, s_eig = kl_inverse(s["R"], s["Q_R"], eps, n)
                s["eig_R"].copy_(s_eig)
            if left:
                s["L"].lerp_(g @ inv_r @ g.mT if inv_r is not None else (g @ g.mT) / n, weight)
            if right:
                s["R"].lerp_(g.mT @ inv_l @ g if inv_l is not None else (g.mT @ g) / m, weight)
        else:
            if left:
                s["L"].lerp_(g @ g.mT, weight)
            if right:
                s["R"].lerp_(g.mT @ g, weight)

    def refresh_bases(self, states: list[dict[str, Tensor]], group: Group, steps: list[int]) -> None:
        """Step 2 for matrices at steps ``steps``: :meth:`refresh_basis` one by one, or with basis="cholqr"
        one :func:`dtensor_muon.linalg.eigenbasis.power_cholqr` per factor size (in batches of at most
        ``LARGE_BATCH_ENTRIES`` entries per tensor) over every factor of these matrices past their step 1 (eigh on step 1, as the
        reference)."""
        if group["basis"] != "cholqr":
            for s, t in zip(states, steps):
                self.refresh_basis(s, group, t)
            return
        by_size: dict[int, list[tuple[dict[str, Tensor], str, int]]] = {}
        later = []
        for s, t in zip(states, steps):
            if t == 1:
                self.refresh_basis(s, group, t)
                continue
            later.append(s)
            for side, axis in (("L", 0), ("R", 1)):
                if side in s:
                    by_size.setdefault(s[side].shape[0], []).append((s, side, axis))
        rotation: dict[tuple[int, str], Tensor] = {}
        batches = []
        for size, jobs in by_size.items():
            per_batch = max(1, LARGE_BATCH_ENTRIES // size**2)
            batches.extend(chunks(jobs, per_batch))
        for jobs in batches:
            k = torch.stack([s[side] for s, side, _ in jobs])
            q_old = torch.stack([s[f"Q_{side}"] for s, side, _ in jobs])
            q_new, values, order, _ = power_cholqr(k, q_old, lambda k_i, q_i: eigh_descending(k_i, fallback=q_i))
            c = accurate_matmul(q_new.mT, q_old)  # C = Q_newᵀ·Q_old
            for i, (s, side, axis) in enumerate(jobs):
                s["exp_avg_sq"].copy_(s["exp_avg_sq"].index_select(axis, order[i]))
                s[f"Q_{side}"].copy_(q_new[i])
                s[f"eig_{side}"].copy_(values[i])
                rotation[(id(s), side)] = c[i]
        for s in later:
            momentum = s["exp_avg"]
            if "Q_L" in s:
                momentum = rotation[(id(s), "L")] @ momentum
            if "Q_R" in s:
                momentum = momentum @ rotation[(id(s), "R")].mT
            s["exp_avg"].copy_(momentum)

    def refresh_basis(self, s: dict[str, Tensor], group: Group, t: int) -> None:
        """Step 2 at step t: V's axes sorted by the old bases' estimates d, new bases Q_L, Q_R from the factors
        (eigh, or one power iteration and QR, from the sorted old bases), the eigenvalue estimates, and M rotated
        into the new basis, in place; never raises (see the module formula). With basis="cholqr" after step 1:
        :meth:`refresh_bases` of this matrix alone."""
        if t > 1 and group["basis"] == "cholqr":
            self.refresh_bases([s], group, [t])
            return
        momentum = self._to_parameter_basis(s["exp_avg"], s)
        for side, axis in (("L", 0), ("R", 1)):
            if side not in s:
                continue
            k, q = s[side], s[f"Q_{side}"]
            d = rayleigh_diag(k, q)
            order = torch.argsort(d, descending=True)
            s["exp_avg_sq"].copy_(s["exp_avg_sq"].index_select(axis, order))
            q_sorted = q[:, order]
            if t == 1 or group["basis"] == "eigh":
                values, q_new = eigh_descending(k, fallback=q_sorted)
            else:
                values, q_new = d[order], qr_basis(k, q_sorted)
            q.copy_(q_new)
            s[f"eig_{side}"].copy_(values)
        s["exp_avg"].copy_(self._to_eigenbasis(momentum, s))

    def adam_in_basis(self, g: Tensor, s: dict[str, Tensor], group: Group, t: int) -> Tensor:
        """Step 3 at Adam's step t (τ of the module formula; bias corrections 1 − βᵗ): Adam's moments take
        G' = Q_Lᵀ·g·Q_R (in place); returns the update O in the parameter's basis, its RMS matched or clipped as
        the group says, per matrix (the step count is not advanced). ``g`` is one matrix or a batch at the same
        step, as in :meth:`update_factors`."""
        beta1, beta2 = group["betas"]
        eps = group["eps"]
        projected = self._to_eigenbasis(g, s)
        exp_avg, exp_avg_sq = s["exp_avg"], s["exp_avg_sq"]
        exp_avg.lerp_(projected, 1 - beta1)
        exp_avg_sq.lerp_(projected.square(), 1 - beta2)
        if group["correct_bias"]:
            normalized = (exp_avg / (1 - beta1**t)) / ((exp_avg_sq / (1 - beta2**t)).sqrt() + eps)
        else:
            normalized = exp_avg / (exp_avg_sq.sqrt() + eps)
        update = self._to_parameter_basis(normalized, s)
        target = group["match_update_rms"]
        if target > 0:
            update = update * (target / (matrix_rms(update) + UPDATE_RMS_EPS))
        max_rms = group["max_update_rms"]
        cannot_bind = (
            target > 0 and max_rms >= CLIP_HEADROOM * target and g.shape[-2] * g.shape[-1] <= CLIP_SKIP_MAX_NUMEL
        )
        if max_rms > 0 and not cannot_bind:
            rms = matrix_rms(update)
            update = update * (max_rms / (rms + UPDATE_RMS_EPS)).clamp(max=1.0)
        return update

    @staticmethod
    def _to_eigenbasis(x: Tensor, s: dict[str, Tensor]) -> Tensor:
        """Q_Lᵀ·X·Q_R (a side without a basis: the identity)."""
        if "Q_L" in s:
            x = s["Q_L"].mT @ x
        if "Q_R" in s:
            x = x @ s["Q_R"]
        return x

    @staticmethod
    def _to_parameter_basis(x: Tensor, s: dict[str, Tensor]) -> Tensor:
        """Q_L·X·Q_Rᵀ (a side without a basis: the identity)."""
        if "Q_L" in s:
            x = s["Q_L"] @ x
        if "Q_R" in s:
            x = x @ s["Q_R"].mT
        return x

    def adjusted_lr(self, group: Group, shape: tuple[int, int]) -> float | Tensor:
        return _to_scalar(group["lr"])
