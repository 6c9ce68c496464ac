"""Newton–Schulz orthogonalization: coefficient tables, the iteration, and the exact polar factor.

For a matrix G = U·S·Vᵀ, Muon wants the polar factor U·Vᵀ. The quintic Newton–Schulz iteration
approximates it with matrix products only:

    X₀ = G / max(‖G‖_F, eps)                     (Xᵀ first when G is tall, so X is m×n with m ≤ n)
    A  = X·Xᵀ
    B  = b·A + c·A·A
    X ← a·X + B·X                                 (one iteration; coefficients (a, b, c) per iteration)

Each iteration maps every singular value σ of X to p(σ) = aσ + bσ³ + cσ⁵; the coefficient sets trade how
fast small σ grow against how close to 1 the result lands. The same iterations can run in Gram form
(:mod:`.gram`: on the m×m X·Xᵀ, touching X once per few iterations), fewer FLOPs on
rectangular matrices and equal in exact arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..kernels import Backend, select_backend, use_gram
from .gram import gram_newton_schulz

Triple = tuple[float, float, float]
CoefficientSpec = str | Triple | Sequence[Triple]

KELLER_COEFFICIENTS: Triple = (3.4445, -4.775, 2.0315)

NAMED_COEFFICIENTS: dict[str, tuple[Triple, ...]] = {
    # Keller Jordan's fixed quintic (the torch.optim.Muon default); σ lands in about [0.68, 1.15].
    "simple": (KELLER_COEFFICIENTS,),
    # modded-nanogpt's per-iteration schedule.
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    # Polar Express (arXiv 2505.16932), safety factor 1.01 folded in; converges to σ = 1.
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    # CANS (arXiv 2506.10935).
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
}

SUPPORTED_NS_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
}


def ns_iteration_flops(shape: tuple[int, int]) -> int:
    """FLOPs of one Newton–Schulz iteration on an m×n matrix: 4m²n + 2m³ with m = min(dims)."""
    m, n = min(shape), max(shape)
    return 4 * m * m * n + 2 * m**3


def _as_triple(value: object, what: str) -> Triple:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise ValueError(f"{what} must be a triple (a, b, c) of floats, got {value!r}")
    try:
        triple = tuple(float(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be a triple (a, b, c) of floats, got {value!r}") from exc
    return triple  # type: ignore[return-value]


def resolve_coefficients(spec: CoefficientSpec) -> tuple[Triple, ...]:
    """Turn a coefficient spec into a non-empty tuple of (a, b, c) triples.

    ``spec`` is a name from :data:`NAMED_COEFFICIENTS`, one triple (used for every iteration), or a sequence
    of triples (iteration i uses triple i; the last one repeats past the end).
    """
    if isinstance(spec, str):
        if spec not in NAMED_COEFFICIENTS:
            raise ValueError(
                f"ns_coefficients: unknown name {spec!r}; expected one of {sorted(NAMED_COEFFICIENTS)} "
                "or a triple (a, b, c) or a list of triples"
            )
        return NAMED_COEFFICIENTS[spec]
    if not isinstance(spec, (tuple, list)) or len(spec) == 0:
        raise ValueError(f"ns_coefficients must be a name, a triple or a list of triples, got {spec!r}")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spec):
        return (_as_triple(spec, "ns_coefficients"),)
    return tuple(_as_triple(t, f"ns_coefficients[{i}]") for i, t in enumerate(spec))


def coefficients_at(coefficients: Sequence[Triple], iteration: int) -> Triple:
    """The triple used at ``iteration`` (0-based): ``coefficients[min(iteration, len - 1)]``."""
    return coefficients[min(iteration, len(coefficients) - 1)]


def gram_segments(steps: int) -> list[int]:
    """Segment lengths for ``steps`` iterations in Gram form: segments of 2, a last one of 1 for an odd count
    (5 → [2, 2, 1]). Longer segments overflow on low-rank inputs (:mod:`.gram`)."""
    return [2] * (steps // 2) + [1] * (steps % 2)


def gram_validated(triples: Sequence[Triple]) -> bool:
    """Whether ``ns_algorithm="auto"`` may take the Gram form for this schedule: Keller's fixed triple, the
    default (its bf16 error stays near the standard form's: docs/kernels.md "The Gram form";
    tests/test_gram_newton_schulz.py bounds it at 2×). Other schedules run in Gram form only when asked for
    (quintic and 8-step Polar Express measured as accurate; 5-step Polar Express and CANS not)."""
    return all(tuple(t) == KELLER_COEFFICIENTS for t in triples)


def resolve_ns_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Working dtype of the iteration: bfloat16 (default), float32 or float16, as a dtype or its name."""
    if isinstance(dtype, str):
        if dtype not in SUPPORTED_NS_DTYPES:
            raise ValueError(f"ns_dtype: expected one of {sorted(SUPPORTED_NS_DTYPES)}, got {dtype!r}")
        return SUPPORTED_NS_DTYPES[dtype]
    if dtype not in SUPPORTED_NS_DTYPES.values():
        raise ValueError(f"ns_dtype: expected one of {sorted(SUPPORTED_NS_DTYPES)}, got {dtype!r}")
    return dtype


def newton_schulz(
    g: Tensor,
    coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
    algorithm: str = "auto",
) -> Tensor:
    """Approximate the polar factor U·Vᵀ of ``g`` ([m, n], or a batch [B, m, n] of matrices).

    Returns a tensor of ``g``'s shape in ``dtype``. Tall matrices (m > n) are transposed before the
    iteration and back after, so the Gram matrix is always the smaller min(m, n)². Each matrix of a batch
    is normalized by its own Frobenius norm. ``algorithm``: "standard" (X ← a·X + (b·A + c·A²)·X),
    "gram" (the same iterations in Gram form, segments of :func:`gram_segments`) or "auto" (Gram form for
    Keller's coefficients where it is faster: large rectangular matrices on the GPU backend, see
    :func:`..kernels.use_gram`). On CPU, and for 2-D input with the default arguments, the result equals
    ``torch.optim.Muon``'s bit for bit.
    """
    schedule = iteration_schedule(g, coefficients, steps)
    _, x, backend, scale = normalized_start(g, dtype, eps)
    return in_layout_of(iterate(x, schedule, backend, algorithm, scale), g)


def iteration_schedule(g: Tensor, coefficients: CoefficientSpec, steps: int) -> tuple[Triple, ...]:
    """Checks ``g`` (2-D or 3-D) and ``steps`` (>= 1); the (a, b, c) of each of the ``steps`` iterations."""
    if g.ndim not in (2, 3):
        raise ValueError(f"newton_schulz expects a 2-D matrix or a 3-D batch, got shape {tuple(g.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz: steps must be >= 1, got {steps}")
    triples = resolve_coefficients(coefficients)
    return tuple(coefficients_at(triples, i) for i in range(steps))


def normalized_start(
    g: Tensor, dtype: torch.dtype, eps: float, *, own_buffer: bool = False
) -> tuple[Tensor, Tensor, Backend, Tensor | None]:
    """The start of the iteration: a new buffer in ``dtype`` and ``g``'s layout, the wide (m ≤ n) view of it
    the iteration works on (the buffer itself, or its transpose for a tall ``g``), the backend chosen for
    that view, and the scale: None when the buffer holds X₀ = G / max(‖G‖_F, eps), else the per-matrix
    s = 1 / max(‖G‖_F, eps) with the buffer holding round(G) and X₀ = s·buffer (GPU backend, SYRK sizes:
    the first products fold s in; see ``Backend.start_into``). Where ``g`` is already in ``dtype`` and the scale
    is folded, the buffer is ``g`` itself, read and never written (``Backend.start_scale``): one pass of writes
    less, the same bits; ``own_buffer`` always gives a new one (a CUDA graph's input, written again each replay)."""
    if g.dtype == dtype and not own_buffer:
        x = in_layout_of(g, g)
        backend = select_backend(x)
        scale = backend.start_scale(g, x, eps)
        if scale is not None:
            return g, x, backend, scale
    start = torch.empty_like(g, dtype=dtype)
    x = in_layout_of(start, g)
    backend = select_backend(x)
    scale = backend.start_into(g, start, x, eps)
    return start, x, backend, scale


def in_layout_of(x: Tensor, g: Tensor) -> Tensor:
    """``x`` transposed when ``g`` is tall: from g's orientation to the wide working one, and back."""
    return x.mT if g.size(-2) > g.size(-1) else x


def iterate(
    x: Tensor, schedule: Sequence[Triple], backend: Backend, algorithm: str, scale: Tensor | None = None
) -> Tensor:
    """The iterations of ``schedule`` from the normalized wide X₀ = s·x (x itself without ``scale``), in the
    form ``algorithm`` picks for it (:func:`..kernels.use_gram`); X in x's layout."""
    if use_gram(algorithm, x, backend, gram_validated(schedule)):
        return gram_newton_schulz(x, schedule, backend, gram_segments(len(schedule)), scale)
    for i, (a, b, c) in enumerate(schedule):
        x = backend.iteration(x, a, b, c, scale if i == 0 else None)
    return x


def polar_factor(g: Tensor) -> Tensor:
    """Exact polar factor U·Vᵀ of ``g`` (2-D or batched) from a float64 SVD, returned in float64."""
    u, _, vh = torch.linalg.svd(g.to(torch.float64), full_matrices=False)
    return u @ vh
