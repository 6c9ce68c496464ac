"""Newton–Schulz on a matrix split along its long side over a tensor-parallel group (Megatron's "distributed" mode).

The whole m×n matrix G (m ≤ n in its wide orientation) is split along n into blocks G = [G_0 | G_1 | … ], one per
rank of the group; rank j holds G_j (m×n_j) and only ever gets back its own block of the result. Since
X·Xᵀ = Σ_j X_j·X_jᵀ, every iteration needs only the small m×m Gram matrix summed over the group:

    X_j ← G_j / max(‖G‖_F, eps)                 ‖G‖_F² = Σ_j ‖G_j‖_F²   (all-reduce of 1 element)
    per iteration (a, b, c):
        A   = Σ_j X_j·X_jᵀ                       local partial, then all-reduce (SUM, m×m)
        P   = a·I + b·A + c·A·A                  computed redundantly on every rank: A, hence P, is the same
        X_j ← P·X_j  (= a·X_j + B·X_j, B = b·A + c·A·A)                              local

The blocks of the result are, up to the all-reduce's summation order, the blocks of the single-process iteration
on G (:func:`.newton_schulz.newton_schulz`): the same coefficient specs, the same start X₀ = round(G) /
max(‖G‖_F, eps) with the norm rounded to the working dtype, the same iterations in the same order. Each
iteration takes the products of the standard form as the Gram form's one-iteration segment does (``gram``,
``poly``, ``apply`` of the :class:`..kernels.Backend`: a·I is folded into P, rounded once), so it differs from
the single-process standard form by that rounding too (about one unit roundoff of the working dtype).

Collectives: ``steps + 1`` all-reduces, one per iteration (the m×m partial Gram, in the working dtype: m²·itemsize
bytes each, e.g. 32 MiB for m = 4096 in bf16; a ring all-reduce sends and receives about twice that per rank)
and one of a single float32 element for the norm. The norm gets its own collective rather than riding on the
first Gram's trace (‖X‖_F² = trace(X·Xᵀ)) because folding it would change the start: the first Gram would be
that of round(G) instead of X₀, rescaled afterwards — no longer the single-process X₀ = round(G / ‖G‖), and in
float16 the unnormalized Gram overflows for entries of G around √(65504 / n). One 4-byte all-reduce costs only
its latency, small beside the m²-element ones.

Cost per rank and iteration, in multiply-adds: m²·n_j for the partial Gram (half of it on the SYRK kernels), m³ for
A·A in P (the same on every rank: the part tensor parallelism does not split), and m²·n_j for P·X_j; against
2m²·n + m³ for the whole matrix on one rank.

:func:`distributed_newton_schulz` is one rank's call, with the all-reduce injected (``torch.distributed.all_reduce``
on the tensor-parallel group, in place). :func:`distributed_newton_schulz_blocks` runs all ranks' blocks in one
process, in lockstep, the all-reduce emulated by a sum over the list: the single-process emulation the tests and
``bench/bench_tp_newton_schulz.py`` use. Both drive the same per-rank iteration (:func:`_rank_iterations`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

import torch
from torch import Tensor

from ..kernels import select_backend
from .newton_schulz import KELLER_COEFFICIENTS, CoefficientSpec, Triple, iteration_schedule, resolve_ns_dtype

AllReduce = Callable[[Tensor], None]
"""An in-place SUM of a tensor over the tensor-parallel group (e.g. ``torch.distributed.all_reduce``)."""

RankIterations = Generator[Tensor, None, Tensor]
"""One rank's iteration: yields each tensor to be all-reduced in place (the norm's sum of squares, then one
partial Gram per iteration) and resumes once it has been; returns the rank's block of the result."""


def distributed_newton_schulz(
    block: Tensor,
    *,
    long_dim: int,
    all_reduce: AllReduce,
    coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """This rank's block of the Newton–Schulz polar factor of the matrix whose long side is split over the group.

    ``block``: this rank's 2-D block of G, split along ``long_dim`` (0 or 1, or -2/-1), the long side of the whole
    matrix (of the block itself not necessarily: an m×n_j block may have n_j < m); with ``long_dim = 0`` the block
    is given in the tall orientation and the iteration runs on its transpose. ``all_reduce``: an in-place SUM over
    the group, called ``steps + 1`` times in the same order on every rank. ``coefficients``, ``steps``, ``eps``,
    ``dtype``: as :func:`.newton_schulz.newton_schulz`. Returns the result's block, ``block``'s shape, in ``dtype``.
    """
    (out,) = _lockstep([_rank_iterations(block, long_dim, coefficients, steps, eps, dtype)], lambda t: all_reduce(t[0]))
    return out


def distributed_newton_schulz_blocks(
    blocks: Sequence[Tensor],
    *,
    long_dim: int,
    coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Tensor]:
    """Every rank's :func:`distributed_newton_schulz` in one process: the single-process emulation (tests, the
    benchmark). ``blocks``: the blocks of G in rank order along ``long_dim``. Each all-reduce is emulated by
    the sum of the ranks' tensors in rank order, in their dtype, written back into every rank's tensor."""
    if not blocks:
        raise ValueError("distributed_newton_schulz_blocks: no blocks")
    if len({b.shape[1 - long_dim % 2] for b in blocks if b.ndim == 2}) > 1:
        raise ValueError(
            f"distributed_newton_schulz_blocks: blocks of one matrix split along dim {long_dim} must agree on the "
            f"other dim, got shapes {[tuple(b.shape) for b in blocks]}"
        )
    ranks = [_rank_iterations(b, long_dim, coefficients, steps, eps, dtype) for b in blocks]
    return _lockstep(ranks, _sum_into_each)


def _rank_iterations(
    block: Tensor, long_dim: int, coefficients: CoefficientSpec, steps: int, eps: float, dtype: torch.dtype
) -> RankIterations:
    """One rank's start and iterations (module docstring), pausing at each all-reduce."""
    if block.ndim != 2:
        raise ValueError(f"distributed_newton_schulz expects a 2-D block, got shape {tuple(block.shape)}")
    if long_dim not in (0, 1, -2, -1):
        raise ValueError(f"distributed_newton_schulz: long_dim must be 0 or 1 (or -2, -1), got {long_dim}")
    schedule: tuple[Triple, ...] = iteration_schedule(block, coefficients, steps)
    start = block.to(resolve_ns_dtype(dtype), copy=True)
    x = start.mT if long_dim % 2 == 0 else start  # the wide working view: m×n_j, split along dim 1
    square_sum = torch.linalg.vector_norm(x, dtype=torch.float32).square()
    yield square_sum
    x.div_(square_sum.sqrt().to(x.dtype).clamp(min=eps))  # as torch.optim.Muon: the norm rounded to the dtype
    backend = select_backend(x)
    for a, b, c in schedule:
        gram = backend.gram(x)
        yield gram
        # P's backend is chosen from the m×m A alone, identical on every rank, so P is identical too.
        x = backend.apply(select_backend(gram).poly(gram, a, b, c), x)
    return x.mT if long_dim % 2 == 0 else x


def _lockstep(ranks: list[RankIterations], all_reduce: Callable[[list[Tensor]], None]) -> list[Tensor]:
    """Runs the ranks' iterations side by side: at each pause, ``all_reduce`` on the list of their tensors (one
    per rank, reduced in place), then every rank resumes. Returns their results in order."""
    pending = [next(rank) for rank in ranks]
    while True:
        all_reduce(pending)
        resumed = [_resume(rank) for rank in ranks]
        finished = {done for done, _ in resumed}
        if len(finished) > 1:
            raise RuntimeError("distributed_newton_schulz: the ranks disagree on the number of all-reduces")
        pending = [t for _, t in resumed]
        if finished == {True}:
            return pending


def _resume(rank: RankIterations) -> tuple[bool, Tensor]:
    """(False, the next tensor to all-reduce) or (True, the rank's result)."""
    try:
        return False, next(rank)
    except StopIteration as done:
        return True, done.value


def _sum_into_each(tensors: list[Tensor]) -> None:
    """The emulated all-reduce: every tensor ← t_0 + t_1 + … (summed in rank order, in their dtype)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    for t in tensors:
        t.copy_(total)
