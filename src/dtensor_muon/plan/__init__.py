"""The plan: which rank orthogonalizes each matrix, which pieces move where, and in which buckets.

Unit: a matrix (a 2-D parameter, one expert ``[e]`` of a 3-D ``[E, m, n]`` parameter, or a ≥4-D parameter
viewed as ``(shape[0], -1)``). Cost of one Newton–Schulz iteration on an m×n matrix (m ≤ n after
transposing): ``4m²n + 2m³`` FLOPs.

A matrix that every rank holding any part of it holds whole is *local*: each holder computes it without
communication, and its cost is pinned load on those ranks. The others get an owner by longest-processing-
time greedy: matrices by decreasing cost (ties by name), each to the rank with the least load so far (ties:
the rank holding most of the matrix, then the lowest rank). Buckets group the non-local matrices in
parameter (forward-execution) order up to a byte budget. The plan depends only on names, shapes, boxes and
world size, so every rank builds the same one; its digest is compared across ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch

from ..layout import Box, ParamLayout, box_numel


def ns_iteration_flops(shape: tuple[int, int]) -> int:
    """FLOPs of one Newton–Schulz iteration on an m×n matrix: 4m²n + 2m³ with m = min(dims)."""
    m, n = min(shape), max(shape)
    return 4 * m * m * n + 2 * m**3


@dataclass(frozen=True)
class MatrixSpec:
    """One unit of orthogonalization: ``box`` inside parameter ``param_index``, reshaped to ``shape``."""

    name: str
    param_index: int
    box: Box
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def cost(self) -> int:
        return ns_iteration_flops(self.shape)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of one matrix of a parameter: itself (2-D), one expert (3-D), (shape[0], rest) (≥4-D)."""
    if len(shape) < 2:
        raise ValueError(f"Muon needs ≥2 dims, got shape {tuple(shape)}")
    if len(shape) == 3:
        return (shape[1], shape[2])
    return (shape[0], prod(shape[1:]))


def matrices_of(param_index: int, layout: ParamLayout) -> list[MatrixSpec]:
    """The matrices of one parameter: itself (2-D), one per expert (3-D), or a (shape[0], -1) view (≥4-D)."""
    shape = layout.global_shape
    if len(shape) < 2:
        raise ValueError(f"parameter {layout.name!r}: Muon needs ≥2 dims, got shape {shape}")
    full: Box = tuple((0, s) for s in shape)
    if len(shape) == 3:
        return [
            MatrixSpec(f"{layout.name}[{e}]", param_index, ((e, e + 1),) + full[1:], matrix_shape(shape))
            for e in range(shape[0])
        ]
    return [MatrixSpec(layout.name, param_index, full, matrix_shape(shape))]


@dataclass(frozen=True)
class MatrixRoute:
    """How one matrix travels: pieces (box, source rank) out to ``owner``, and each holder's box back.

    ``owner`` is None for a local matrix (every holder holds it whole and computes it itself).
    """

    spec: MatrixSpec
    owner: int | None
    pieces: tuple[tuple[Box, int], ...]
    holders: tuple[tuple[int, Box], ...]

    @property
    def is_local(self) -> bool:
        return self.owner is None


@dataclass
class Plan:
    """Owners, routes and buckets for the matrices of one mesh; ``digest`` identifies it across ranks."""

    world_size: int
    routes: list[MatrixRoute]
    buckets: list[list[int]]
    rank_flops: list[int]
    rank_bytes_sent: list[int]
    rank_bytes_received: list[int]
    digest: str = field(default="")

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank Newton–Schulz cost (1.0 is perfect balance)."""
        mean = sum(self.rank_flops) / max(1, len(self.rank_flops))
        return max(self.rank_flops) / mean if mean > 0 else 1.0

    def owned_by(self, rank: int) -> list[int]:
        """Indices of the routed (non-local) matrices whose owner is ``rank``."""
        return [i for i, r in enumerate(self.routes) if r.owner == rank]

    def local_to(self, rank: int) -> list[int]:
        """Indices of the local matrices that ``rank`` holds (and so computes)."""
        return [i for i, r in enumerate(self.routes) if r.is_local and any(h == rank for h, _ in r.holders)]


def _holder_boxes(spec: MatrixSpec, boxes: torch.Tensor) -> list[tuple[int, Box]]:
    """(rank, intersection box) for every rank whose box meets the matrix box; boxes is [W, ndim, 2]."""
    mbox = torch.tensor(spec.box, dtype=torch.int64)
    lo = torch.maximum(boxes[:, :, 0], mbox[:, 0])
    hi = torch.minimum(boxes[:, :, 1], mbox[:, 1])
    nonempty = (lo < hi).all(dim=1)
    out = []
    for rank in nonempty.nonzero().flatten().tolist():
        out.append((rank, tuple(zip(lo[rank].tolist(), hi[rank].tolist()))))
    return out


def build_plan(
    layouts: list[ParamLayout],
    param_indices: list[int],
    bucket_bytes: int,
    wire_itemsize: int,
) -> Plan:
    """Plan the Muon matrices of ``layouts`` (all on one mesh of the same world size)."""
    world = layouts[0].world_size if layouts else 1
    specs: list[MatrixSpec] = []
    for index, layout in zip(param_indices, layouts):
        if layout.world_size != world:
            raise ValueError(f"parameter {layout.name!r}: world size {layout.world_size} != {world}")
        specs.extend(matrices_of(index, layout))
    by_param = {index: layout for index, layout in zip(param_indices, layouts)}
    box_tensors = {i: torch.tensor(layout.boxes, dtype=torch.int64) for i, layout in by_param.items()}

    holders = [_holder_boxes(s, box_tensors[s.param_index]) for s in specs]
    load = [0] * world
    local = [all(box == s.box for _, box in h) for s, h in zip(specs, holders)]
    for s, h, is_local in zip(specs, holders, local):
        if is_local:
            for rank, _ in h:
                load[rank] += s.cost
    owners: list[int | None] = [None] * len(specs)
    order = sorted((i for i in range(len(specs)) if not local[i]), key=lambda i: (-specs[i].cost, specs[i].name))
    for i in order:
        held = {rank: box_numel(box) for rank, box in holders[i]}
        best = min(range(world), key=lambda r: (load[r], -held.get(r, 0), r))
        owners[i] = best
        load[best] += specs[i].cost

    routes: list[MatrixRoute] = []
    sent = [0] * world
    received = [0] * world
    for s, h, owner in zip(specs, holders, owners):
        if owner is None:
            routes.append(MatrixRoute(s, None, (), tuple(h)))
            continue
        pieces: dict[Box, int] = {}
        for rank, box in h:
            if box not in pieces or rank == owner:
                pieces[box] = rank
        for box, source in pieces.items():
            if source != owner:
                nbytes = box_numel(box) * wire_itemsize
                sent[source] += nbytes
                received[owner] += nbytes
        for rank, box in h:
            if rank != owner:
                nbytes = box_numel(box) * wire_itemsize
                sent[owner] += nbytes
                received[rank] += nbytes
        routes.append(MatrixRoute(s, owner, tuple(pieces.items()), tuple(h)))

    routed = [i for i, route in enumerate(routes) if not route.is_local]
    buckets = chunk_by_budget(routed, bucket_bytes, lambda i: routes[i].spec.numel * wire_itemsize)

    plan = Plan(world, routes, buckets, load, sent, received)
    plan.digest = _digest(plan)
    return plan


def chunk_by_budget(items: list, budget: int, size: Callable[[Any], int]) -> list[list]:
    """Consecutive groups of ``items`` whose ``size`` sums to at most ``budget`` (at least one item each)."""
    out: list[list] = []
    current: list = []
    total = 0
    for item in items:
        n = size(item)
        if current and total + n > budget:
            out.append(current)
            current, total = [], 0
        current.append(item)
        total += n
    if current:
        out.append(current)
    return out


def _digest(plan: Plan) -> str:
    text = repr(
        (
            plan.world_size,
            [(r.spec, r.owner, r.pieces, r.holders) for r in plan.routes],
            plan.buckets,
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()
