"""The plan's data: the matrices (:class:`MatrixSpec`), how each travels (:class:`MatrixRoute`), the units computed
together (:class:`Unit`) and the whole :class:`Plan` of one mesh, with its load and bound queries."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..distributed.layout import Box, ParamLayout
from ..linalg.newton_schulz import ns_iteration_flops
from .balance import lower_bound, simple_lower_bound
from .placement import GatherAll, Local, Owned, Placement, TensorParallelGroup
from .views import MatrixSplit, parameter_matrices


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


def combined_lower_bounds(plans: list[Plan]) -> tuple[float, float]:
    """(:func:`.balance.lower_bound`, :func:`.balance.simple_lower_bound`) of the busiest rank's load summed over
    ``plans`` (plans over the same ranks, in one rank order): their pinned loads added per rank, their owned
    units pooled, as if one plan had placed them all."""
    world = plans[0].world_size
    pinned, owned = [0] * world, []
    for plan in plans:
        plan_pinned, plan_owned = plan._pinned_and_owned()
        pinned = [a + b for a, b in zip(pinned, plan_pinned)]
        owned += plan_owned
    return lower_bound(owned, pinned, world), simple_lower_bound(owned, pinned, world)
