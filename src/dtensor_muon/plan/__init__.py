"""The plan: which matrices are computed together, where, which pieces move where, and in which buckets.

Matrices (see :mod:`dtensor_muon.plan.views`) are grouped into **units**, computed as one batch: consecutive
matrices of one parameter (its experts, or the equal blocks of a split), of a shape where batching pays
(:mod:`..kernels.batching`), in groups of G, the largest power of two ≤ min(:data:`MAX_BATCH`, n /
:data:`UNITS_PER_PARAMETER`) for a parameter of n such matrices (64 experts: units of 8; 4 experts: one by
one). A unit never spans parameters and depends only on its parameter's shape and split, never on the world
size or on which other parameters an optimizer holds (a pipeline stage, a param group), so every placement
computes the same batches as one process: the same bits.

A unit whose matrices every holder holds whole is :class:`~.placement.Local` (its cost is pinned load on
each holder). The others get :class:`~.placement.GatherAll` when asked, else an :class:`~.placement.Owned`
rank from :func:`.balance.assign_owners` (longest-processing-time, refined toward the lower bound, with
owner-state bytes as a second constraint); before them, the units of parameters whose ``tp_mode`` computes
them on a tensor-parallel group get a :class:`~.placement.TensorParallelGroup`, the group whose busiest
member is least loaded (:func:`tensor_parallel_mode` says which form each matrix takes). Buckets group the
owned units in parameter (forward-execution) order up to a byte budget. The plan is a pure function of names, shapes, boxes, options and world size, so
every rank builds the same one; its digest is compared across ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..distributed.layout import Box, ParamLayout, TensorParallelLayout, box_numel, intersect
from ..kernels.batching import MAX_BATCH, batching_pays
from ..linalg.newton_schulz import ns_iteration_flops
from .balance import assign_owners, lower_bound, simple_lower_bound
from .placement import GatherAll, Local, Owned, Placement, TensorParallelGroup
from .views import MatrixSplit, parameter_matrices

UNITS_PER_PARAMETER = 8
"""A parameter's batchable matrices form at least this many units (when it has that many), so that units stay
small against a rank's share of the work and whole-expert shards of up to 1/8 of the experts hold whole units."""


@dataclass(frozen=True)
class MatrixSpec:
    """One matrix: ``box`` inside parameter ``param_index``, viewed as ``shape``; ``key`` names it there.

    A part of a grouped split's matrix (``parts > 1``, :class:`~dtensor_muon.plan.views.MatrixView`) is a spec of its
    own (its box travels like any matrix); its unit holds all ``parts`` of the matrix, in order, and computes
    them as the one ``whole_shape`` matrix their rows stack into."""

    name: str
    param_index: int
    box: Box
    shape: tuple[int, int]
    key: str = "m0"
    part: int = 0
    parts: int = 1

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def whole_shape(self) -> tuple[int, int]:
        """The shape of the matrix the rule computes: ``shape``, or for a part ``(parts·rows, cols)``."""
        return (self.parts * self.shape[0], self.shape[1])

    @property
    def cost(self) -> int:
        """FLOPs of one Newton–Schulz iteration (the plan's default cost)."""
        return ns_iteration_flops(self.shape)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Shape of one matrix of an unsplit parameter: itself (2-D), one expert (3-D), (shape[0], rest) (≥4-D)."""
    return parameter_matrices("", tuple(shape))[0].shape


def matrices_of(param_index: int, layout: ParamLayout, split: MatrixSplit | None = None) -> list[MatrixSpec]:
    """The matrices of one parameter (see :mod:`dtensor_muon.plan.views`), named ``name``, ``name[e]`` (expert e)
    and ``name/j`` (matrix j of a split; the parts of a grouped split's matrix share its name)."""
    shape = layout.global_shape
    views = parameter_matrices(layout.name, shape, split)
    per_base = len(views) // (shape[0] if len(shape) == 3 else 1)
    out = []
    for i, view in enumerate(views):
        name = layout.name
        if len(shape) == 3:
            name = f"{name}[{i // per_base}]"
        if split is not None:
            name = f"{name}/{(i % per_base) // view.parts}"
        out.append(MatrixSpec(name, param_index, view.box, view.shape, view.key, view.part, view.parts))
    return out


@dataclass(frozen=True)
class MatrixRoute:
    """How one matrix travels: pieces (box, source rank) out to ``owner``, and each holder's box back.

    ``owner`` is None unless the matrix's unit is :class:`~.placement.Owned`; ``unit`` indexes ``Plan.units``.
    For a :class:`~.placement.TensorParallelGroup` unit, ``targets`` lists each member, the box it computes
    on (the whole matrix, or its TP block) and the pieces (box, source) it receives, and ``back_from[i]`` is the
    member that sends holder i its box back (the member of the holder's TP coordinate).
    """

    spec: MatrixSpec
    owner: int | None
    pieces: tuple[tuple[Box, int], ...]
    holders: tuple[tuple[int, Box], ...]
    unit: int = 0
    targets: tuple[tuple[int, Box, tuple[tuple[Box, int], ...]], ...] = ()
    back_from: tuple[int, ...] = ()

    @property
    def is_local(self) -> bool:
        return self.owner is None and not self.targets


@dataclass(frozen=True)
class Unit:
    """Matrices (indices into ``Plan.routes``) computed together in one call, and where."""

    members: tuple[int, ...]
    placement: Placement
    cost: int


@dataclass
class Plan:
    """Units, placements, routes and buckets for the matrices of one mesh; ``digest`` identifies it."""

    world_size: int
    routes: list[MatrixRoute]
    units: list[Unit]
    buckets: list[list[int]]
    rank_flops: list[int]
    rank_bytes_sent: list[int]
    rank_bytes_received: list[int]
    rank_owner_state_bytes: list[int] = field(default_factory=list)
    tensor_parallel_buckets: list[list[int]] = field(default_factory=list)
    """Route indices of the :class:`~.placement.TensorParallelGroup` units, grouped like ``buckets``."""
    digest: str = field(default="")

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank cost (1.0 is perfect balance)."""
        mean = sum(self.rank_flops) / max(1, len(self.rank_flops))
        return max(self.rank_flops) / mean if mean > 0 else 1.0

    def _pinned_and_owned(self) -> tuple[list[int], list[int]]:
        pinned = [0] * self.world_size
        for unit in self.units:
            if isinstance(unit.placement, Local):
                for rank, _ in self.routes[unit.members[0]].holders:
                    pinned[rank] += unit.cost
            elif isinstance(unit.placement, GatherAll):
                pinned = [x + unit.cost for x in pinned]
            elif isinstance(unit.placement, TensorParallelGroup):
                ranks = unit.placement.ranks
                for rank in ranks:  # distributed: about an even share each (the bound stays a bound)
                    pinned[rank] += unit.cost // len(ranks) if unit.placement.distributed else unit.cost
        return pinned, [u.cost for u in self.units if isinstance(u.placement, Owned)]

    @property
    def lower_bound(self) -> float:
        """No assignment of these units beats this busiest-rank cost (:func:`.balance.lower_bound`)."""
        pinned, owned = self._pinned_and_owned()
        return lower_bound(owned, pinned, self.world_size)

    @property
    def simple_lower_bound(self) -> float:
        """max(mean load, costliest unit, largest pinned load) (:func:`.balance.simple_lower_bound`)."""
        pinned, owned = self._pinned_and_owned()
        return simple_lower_bound(owned, pinned, self.world_size)

    def owned_by(self, rank: int) -> list[int]:
        """Indices of the routes of matrices owned by ``rank``."""
        return [i for i, r in enumerate(self.routes) if r.owner == rank]

    def local_to(self, rank: int) -> list[int]:
        """Indices of the routes of local matrices that ``rank`` holds (and so computes)."""
        return [
            i
            for i, r in enumerate(self.routes)
            if isinstance(self.units[r.unit].placement, Local) and any(h == rank for h, _ in r.holders)
        ]

    def computed_by(self, rank: int) -> list[int]:
        """Indices of the routes of the matrices ``rank`` computes: those it owns, the local ones it holds, and
        every gather-all one (where it keeps their owner state)."""
        out = []
        for unit in self.units:
            p = unit.placement
            if (
                isinstance(p, GatherAll)
                or (isinstance(p, Owned) and p.rank == rank)
                or (isinstance(p, TensorParallelGroup) and rank in p.ranks)
                or (isinstance(p, Local) and any(r == rank for r, _ in self.routes[unit.members[0]].holders))
            ):
                out.extend(unit.members)
        return out

    def fully_local_params(self) -> set[int]:
        """Parameter indices all of whose matrices are in local units (computed and applied in place)."""
        params = {r.spec.param_index for r in self.routes}
        for unit in self.units:
            if not isinstance(unit.placement, Local):
                params -= {self.routes[i].spec.param_index for i in unit.members}
        return params

    def units_placed(self, kind: type) -> list[int]:
        """Indices of the units whose placement is of type ``kind``."""
        return [i for i, u in enumerate(self.units) if isinstance(u.placement, kind)]


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


def group_units(specs: Sequence[MatrixSpec], batchable: set[int]) -> list[list[int]]:
    """Indices of ``specs`` (in parameter order) grouped into units (see the module docstring), in order;
    only the matrices of parameters in ``batchable`` are stacked. The parts of one grouped-split matrix
    (consecutive specs) are one unit of their own: one matrix, never a batch."""
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
        size = 1
        while key in count and size * 2 <= min(MAX_BATCH, count[key] // UNITS_PER_PARAMETER):
            size *= 2
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
    them.
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
    groups = group_units(specs, {index for index, ok in zip(param_indices, batchable) if ok})
    for group in groups:  # a unit's shared cost once, spread over its members
        fixed = max(shared[i] for i in group)
        for position, i in enumerate(group):
            costs[i] += fixed // len(group) + (fixed % len(group) if position == 0 else 0)

    box_tensors = {i: torch.tensor(layout.boxes, dtype=torch.int64) for i, layout in zip(param_indices, layouts)}
    holders = [_holder_boxes(s, box_tensors[s.param_index]) for s in specs]
    load = [0] * world
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
                cost * _block_fraction(specs[groups[g][0]], tpl, t) if distributed else cost
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
            route = _tensor_parallel_route(s, h, placement, tensor_parallel[k][1], unit_of_spec[i])  # type: ignore[index]
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

    plan = Plan(world, routes, units, buckets, load, sent, received, rank_state, tp_buckets)
    plan.digest = _digest(plan)
    return plan


def _matrix_dim(spec: MatrixSpec, tensor_dim: int, ndim: int) -> int | None:
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
    dim = _matrix_dim(spec, tpl.dim, len(spec.box))
    long_side = dim is not None and spec.shape[dim] >= spec.shape[1 - dim]
    if requested == "auto":
        return "distributed" if long_side and distributed_pays(spec.shape, len(tpl.groups[0])) else "owned"
    if requested == "distributed" and long_side:
        return "distributed"
    return "duplicated"


def _block_fraction(spec: MatrixSpec, tpl: TensorParallelLayout, t: int) -> float:
    """The share of the matrix inside TP block t."""
    lo, hi = spec.box[tpl.dim]
    b_lo, b_hi = tpl.blocks[t]
    return max(0, min(hi, b_hi) - max(lo, b_lo)) / max(1, hi - lo)


def _tensor_parallel_route(
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
