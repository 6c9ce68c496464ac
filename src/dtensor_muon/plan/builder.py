"""Building the plan (:func:`build_plan`): units, placements, routes and buckets from names, shapes, boxes, options
and the world size (the package docstring says how)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..distributed.layout import Box, ParamLayout, TensorParallelLayout, box_numel
from ..kernels.batching import MAX_BATCH, batching_pays
from ..linalg.newton_schulz import ns_iteration_flops
from .balance import assign_owners
from .model import MatrixRoute, MatrixSpec, Plan, Unit, matrices_of
from .placement import GatherAll, Local, Owned, Placement, TensorParallelGroup
from .tensor_parallel import block_fraction, tensor_parallel_mode, tensor_parallel_route
from .views import MatrixSplit

UNITS_PER_PARAMETER = 8
"""A parameter's batchable matrices form at least this many units (when it has that many), so that units stay
small against a rank's share of the work and whole-expert shards of up to 1/8 of the experts hold whole units."""


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


def unit_size(count: int, max_batch: int = MAX_BATCH, units_per_parameter: int = UNITS_PER_PARAMETER) -> int:
    """Matrices per unit for ``count`` batchable matrices of one shape in one parameter: the largest power of two
    ≤ min(``max_batch``, count / ``units_per_parameter``), at least 1."""
    size = 1
    while size * 2 <= min(max_batch, count // units_per_parameter):
        size *= 2
    return size


def group_units(
    specs: Sequence[MatrixSpec],
    batchable: set[int],
    *,
    max_batch: int = MAX_BATCH,
    units_per_parameter: int = UNITS_PER_PARAMETER,
) -> list[list[int]]:
    """Indices of ``specs`` (in parameter order) grouped into units (see the module docstring), in order;
    only the matrices of parameters in ``batchable`` are stacked, n matrices of one shape in units of the
    largest power of two ≤ min(``max_batch``, n / ``units_per_parameter``). The parts of one grouped-split
    matrix (consecutive specs) are one unit of their own: one matrix, never a batch."""
    for label, value in (("max_batch", max_batch), ("units_per_parameter", units_per_parameter)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"group_units: {label} must be an int >= 1, got {value!r}")
    count: dict[tuple[int, tuple[int, int]], int] = {}
    for spec in specs:
        if spec.parts == 1 and spec.param_index in batchable and batching_pays(spec.shape):
            key = (spec.param_index, spec.shape)
            count[key] = count.get(key, 0) + 1
    open_groups: dict[tuple[int, tuple[int, int]], list[int]] = {}
    groups: list[list[int]] = []
    for i, spec in enumerate(specs):
        if spec.parts > 1:
            if spec.part == 0:
                groups.append([])
            groups[-1].append(i)
            continue
        key = (spec.param_index, spec.shape)
        size = unit_size(count[key], max_batch, units_per_parameter) if key in count else 1
        group = open_groups.get(key)
        if group is None or len(group) == size:
            group = open_groups[key] = []
            groups.append(group)
        group.append(i)
    return groups


def build_plan(
    layouts: list[ParamLayout],
    param_indices: list[int],
    bucket_bytes: int,
    wire_itemsize: int,
    *,
    splits: Sequence[MatrixSplit | None] | None = None,
    batchable: Sequence[bool] | None = None,
    cost_fn: Callable[[int, tuple[int, int]], tuple[int, ...]] | None = None,
    gather_all: bool = False,
    tensor_parallel: Sequence[tuple[str, TensorParallelLayout] | None] | None = None,
    max_batch: int = MAX_BATCH,
    units_per_parameter: int = UNITS_PER_PARAMETER,
    base_load: Sequence[int] | None = None,
) -> Plan:
    """Plan the matrices of ``layouts`` (all on one mesh of the same world size).

    ``splits[k]`` cuts parameter k into views; ``batchable[k]``: whether its rule may stack its matrices
    (default: yes); ``cost_fn(k, shape)`` gives (FLOPs, owner-state bytes) of one
    matrix of parameter k (default: one Newton–Schulz iteration, no state), counted on the first part of a
    grouped split's matrix at its whole shape, or (FLOPs, bytes, shared FLOPs): a fixed cost the matrices of
    one unit share (the largest of its members', counted once per unit, spread over its members).
    ``gather_all``: units that are not local are computed on every rank. ``tensor_parallel[k]``: (``tp_mode``: "duplicated", "distributed" or
    "auto"; TP layout) to compute parameter k's units on one TP group where :func:`tensor_parallel_mode` says
    so, the group chosen per unit by least busiest-member load, before the owned units are balanced around
    them. ``max_batch`` and ``units_per_parameter``: the unit sizes (:func:`group_units`; the engine plans with
    the defaults, other values are for the simulator's studies). ``base_load[r]``: FLOPs that mesh rank r
    already computes in plans of other meshes over the same ranks; the TP groups and owners balance the sum,
    and the plan's ``rank_flops`` count its own units only.
    """
    world = layouts[0].world_size if layouts else 1
    splits = list(splits) if splits is not None else [None] * len(layouts)
    batchable = list(batchable) if batchable is not None else [True] * len(layouts)
    specs: list[MatrixSpec] = []
    costs: list[int] = []
    shared: list[int] = []
    state_bytes: list[int] = []
    for k, (index, layout) in enumerate(zip(param_indices, layouts)):
        if layout.world_size != world:
            raise ValueError(f"parameter {layout.name!r}: world size {layout.world_size} != {world}")
        for spec in matrices_of(index, layout, splits[k]):
            if spec.part > 0:
                flops, nbytes, fixed = 0, 0, 0
            elif cost_fn is not None:
                flops, nbytes, *rest = cost_fn(k, spec.whole_shape)
                fixed = rest[0] if rest else 0
            else:
                flops, nbytes, fixed = ns_iteration_flops(spec.whole_shape), 0, 0
            specs.append(spec)
            costs.append(flops)
            shared.append(fixed)
            state_bytes.append(nbytes)
    batching = {index for index, ok in zip(param_indices, batchable) if ok}
    groups = group_units(specs, batching, max_batch=max_batch, units_per_parameter=units_per_parameter)
    for group in groups:  # a unit's shared cost once, spread over its members
        fixed = max(shared[i] for i in group)
        for position, i in enumerate(group):
            costs[i] += fixed // len(group) + (fixed % len(group) if position == 0 else 0)

    box_tensors = {i: torch.tensor(layout.boxes, dtype=torch.int64) for i, layout in zip(param_indices, layouts)}
    holders = [_holder_boxes(s, box_tensors[s.param_index]) for s in specs]
    if base_load is not None and len(base_load) != world:
        raise ValueError(f"base_load: expected {world} entries (one per rank of the mesh), got {len(base_load)}")
    base = list(base_load) if base_load is not None else [0] * world
    load = list(base)  # the balance is of the sum; the plan's own share is load − base
    unit_local: list[bool] = []
    for group in groups:
        ranks = {rank for rank, _ in holders[group[0]]}
        whole = all(
            {rank for rank, _ in holders[i]} == ranks and all(box == specs[i].box for _, box in holders[i])
            for i in group
        )
        unit_local.append(whole)
        if whole:
            for rank in ranks:
                load[rank] += sum(costs[i] for i in group)
    param_position = {index: k for k, index in enumerate(param_indices)}
    tp_of_group: dict[int, TensorParallelGroup] = {}
    if tensor_parallel is not None and not gather_all:
        candidates = []
        for g, group in enumerate(groups):
            choice = tensor_parallel[param_position[specs[group[0]].param_index]]
            if not unit_local[g] and choice is not None:
                mode = tensor_parallel_mode(choice[0], specs[group[0]], choice[1])
                if mode != "owned":
                    candidates.append((sum(costs[i] for i in group), g, choice[1], mode == "distributed"))
        for cost, g, tpl, distributed in sorted(candidates, key=lambda c: (-c[0], c[1])):
            share = [
                cost * block_fraction(specs[groups[g][0]], tpl, t) if distributed else cost
                for t in range(len(tpl.groups[0]))
            ]
            best = min(tpl.groups, key=lambda ranks: max(load[r] + share[t] for t, r in enumerate(ranks)))
            tp_of_group[g] = TensorParallelGroup(best, distributed, tpl.dim)
            for t, r in enumerate(best):
                load[r] += int(share[t])
    routed = [g for g, is_local in enumerate(unit_local) if not is_local and g not in tp_of_group]
    owner_of_group: dict[int, int] = {}
    if routed and not gather_all:
        held = []
        for g in routed:
            counts: dict[int, int] = {}
            for i in groups[g]:
                for rank, box in holders[i]:
                    counts[rank] = counts.get(rank, 0) + box_numel(box)
            held.append(counts)
        owners = assign_owners(
            [sum(costs[i] for i in groups[g]) for g in routed],
            [specs[groups[g][0]].name for g in routed],
            world,
            list(load),
            held,
            [sum(state_bytes[i] for i in groups[g]) for g in routed],
        )
        owner_of_group = dict(zip(routed, owners))

    units: list[Unit] = []
    unit_of_spec = [0] * len(specs)
    rank_state = [0] * world
    for g, group in enumerate(groups):
        placement: Placement
        if unit_local[g]:
            placement = Local()
        elif g in tp_of_group:
            placement = tp_of_group[g]
        elif gather_all:
            placement = GatherAll()
        else:
            placement = Owned(owner_of_group[g])
        cost = sum(costs[i] for i in group)
        nbytes = sum(state_bytes[i] for i in group)
        if isinstance(placement, Owned):
            load[placement.rank] += cost
            rank_state[placement.rank] += nbytes
        elif isinstance(placement, GatherAll):
            load = [x + cost for x in load]
            rank_state = [x + nbytes for x in rank_state]
        elif isinstance(placement, TensorParallelGroup):  # load added when the group was chosen
            for rank in placement.ranks:
                rank_state[rank] += nbytes
        else:
            for rank, _ in holders[group[0]]:
                rank_state[rank] += nbytes
        for i in group:
            unit_of_spec[i] = len(units)
        units.append(Unit(tuple(group), placement, cost))

    routes: list[MatrixRoute] = []
    sent = [0] * world
    received = [0] * world
    for i, (s, h) in enumerate(zip(specs, holders)):
        placement = units[unit_of_spec[i]].placement
        if isinstance(placement, TensorParallelGroup):
            k = param_position[s.param_index]
            route = tensor_parallel_route(s, h, placement, tensor_parallel[k][1], unit_of_spec[i])  # type: ignore[index]
            for member, _, pieces in route.targets:
                for box, source in pieces:
                    if source != member:
                        sent[source] += box_numel(box) * wire_itemsize
                        received[member] += box_numel(box) * wire_itemsize
            for (rank, box), member in zip(route.holders, route.back_from):
                if rank != member:
                    sent[member] += box_numel(box) * wire_itemsize
                    received[rank] += box_numel(box) * wire_itemsize
            routes.append(route)
            continue
        if not isinstance(placement, Owned):
            routes.append(MatrixRoute(s, None, (), tuple(h), unit_of_spec[i]))
            continue
        owner = placement.rank
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
        routes.append(MatrixRoute(s, owner, tuple(pieces.items()), tuple(h), unit_of_spec[i]))
    # unit members are spec indices, which are route indices (one route per spec, in order)

    owned_units = [u for u in units if isinstance(u.placement, Owned)]
    unit_chunks = chunk_by_budget(
        owned_units, bucket_bytes, lambda u: sum(routes[i].spec.numel for i in u.members) * wire_itemsize
    )
    buckets = [[i for u in chunk for i in u.members] for chunk in unit_chunks]

    tp_units = [u for u in units if isinstance(u.placement, TensorParallelGroup)]
    tp_chunks = chunk_by_budget(
        tp_units, bucket_bytes, lambda u: sum(routes[i].spec.numel for i in u.members) * wire_itemsize
    )
    tp_buckets = [[i for u in chunk for i in u.members] for chunk in tp_chunks]

    own = [total - earlier for total, earlier in zip(load, base)]
    plan = Plan(world, routes, units, buckets, own, sent, received, rank_state, tp_buckets)
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
            [(r.spec, r.owner, r.pieces, r.holders, r.unit, r.targets, r.back_from) for r in plan.routes],
            [(u.members, u.placement) for u in plan.units],
            plan.buckets,
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()
