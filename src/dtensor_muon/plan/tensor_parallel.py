"""Tensor-parallel matrices in the plan: which form each takes (``tp_mode``), the cost model of ``"auto"``, and the
routes of a :class:`~.placement.TensorParallelGroup` unit."""

from __future__ import annotations

from ..distributed.layout import Box, TensorParallelLayout, intersect
from .model import MatrixRoute, MatrixSpec
from .placement import TensorParallelGroup


def matrix_dim(spec: MatrixSpec, tensor_dim: int, ndim: int) -> int | None:
    """Which dim of the matrix view a tensor dim is (None for the expert dim or a ≥4-D weight's merged dims)."""
    if ndim == 2:
        return tensor_dim
    if ndim == 3:
        return tensor_dim - 1 if tensor_dim > 0 else None
    return 0 if tensor_dim == 0 else None


AUTO_FLOPS_PER_SECOND = 700e12
"""``tp_mode="auto"``'s Newton–Schulz speed per rank (bf16). Chosen by measurement: BENCHMARKS.md "Newton–Schulz"."""
AUTO_ALL_REDUCE_BYTES_PER_SECOND = 100e9
"""``tp_mode="auto"``'s all-reduce bus bandwidth within a TP group."""
AUTO_ALL_REDUCE_LATENCY_SECONDS = 30e-6
"""``tp_mode="auto"``'s latency of one all-reduce."""
AUTO_ITERATIONS = 5


def distributed_pays(shape: tuple[int, int], degree: int) -> bool:
    """``tp_mode="auto"``'s cost model: for an m×n matrix (m ≤ n after orientation) over ``degree`` TP ranks,
    distributed Newton–Schulz costs each rank k·((4m²n/T + 2m³)/P + α + 2·m²·2 bytes/B) (its share of the
    products, the whole m×m A·A, one bf16 all-reduce of the Gram matrix per iteration) against k·(4m²n +
    2m³)/P on one owner; distributed when that is less (P, B, α, k: the ``AUTO_*`` constants)."""
    m, n = min(shape), max(shape)
    owned = (4 * m * m * n + 2 * m**3) / AUTO_FLOPS_PER_SECOND
    compute = (4 * m * m * n / degree + 2 * m**3) / AUTO_FLOPS_PER_SECOND
    communicate = AUTO_ALL_REDUCE_LATENCY_SECONDS + 2 * m * m * 2 / AUTO_ALL_REDUCE_BYTES_PER_SECOND
    return AUTO_ITERATIONS * (compute + communicate) < AUTO_ITERATIONS * owned


def tensor_parallel_mode(requested: str, spec: MatrixSpec, tpl: TensorParallelLayout) -> str:
    """How one matrix of a ``tp_mode`` group is computed: ``"duplicated"`` as requested; ``"distributed"``
    when requested and TP splits the matrix's long side (so the Gram matrix is the short side squared), else
    ``"duplicated"``; for ``"auto"``, ``"distributed"`` where it splits the long side and
    :func:`distributed_pays`, else ``"owned"``. The parts of a grouped split's matrix are never distributed
    (``"auto"``: owned; otherwise duplicated)."""
    if spec.parts > 1:
        return "owned" if requested == "auto" else "duplicated"
    dim = matrix_dim(spec, tpl.dim, len(spec.box))
    long_side = dim is not None and spec.shape[dim] >= spec.shape[1 - dim]
    if requested == "auto":
        return "distributed" if long_side and distributed_pays(spec.shape, len(tpl.groups[0])) else "owned"
    if requested == "distributed" and long_side:
        return "distributed"
    return "duplicated"


def block_fraction(spec: MatrixSpec, tpl: TensorParallelLayout, t: int) -> float:
    """The share of the matrix inside TP block t."""
    lo, hi = spec.box[tpl.dim]
    b_lo, b_hi = tpl.blocks[t]
    return max(0, min(hi, b_hi) - max(lo, b_lo)) / max(1, hi - lo)


def tensor_parallel_route(
    spec: MatrixSpec,
    holders: list[tuple[int, Box]],
    placement: TensorParallelGroup,
    tpl: TensorParallelLayout,
    unit: int,
) -> MatrixRoute:
    """Targets (member, box computed on, pieces received) and the member answering each holder."""
    targets = []
    for t, member in enumerate(placement.ranks):
        target = spec.box
        if placement.distributed:
            target = spec.box[: tpl.dim] + (tpl.blocks[t],) + spec.box[tpl.dim + 1 :]
            target = intersect(target, spec.box) or tuple((lo, lo) for lo, _ in spec.box)
        pieces: dict[Box, int] = {}
        for rank, box in holders:
            part = intersect(box, target)
            if part is not None and (part not in pieces or rank == member):
                pieces[part] = rank
        targets.append((member, target, tuple(pieces.items())))
    back_from = tuple(placement.ranks[tpl.coordinate[rank]] for rank, _ in holders)
    return MatrixRoute(spec, None, (), tuple(holders), unit, tuple(targets), back_from)
