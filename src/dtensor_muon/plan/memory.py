"""The optimizer's memory per rank: the bytes each rank holds for a matrix rule's plans, term by term.

Pure and CPU-only, like the rest of :mod:`dtensor_muon.plan`: it reads the plans (one per mesh, mesh ranks =
global ranks), the layouts of their parameters and of the AdamW parameters, and what the optimizer declares
(:class:`OptimizerMemory`, read from its rule by :meth:`OptimizerMemory.from_rule`). numel(P, r) is the number
of elements of parameter P in rank r's local shard (its box, :class:`~..distributed.layout.ParamLayout`);
a unit of B matrices computed as m×n (m ≤ n: Newton–Schulz works on the wide orientation) has B·m·n
elements. Per rank r:

- ``params_grads`` (reference, not the optimizer's) = 2·p·Σ_P numel(P, r) over every parameter: the model's
  parameters and gradients as FSDP keeps them (p = 4, float32 shards).
- ``shard_state`` = Σ_P [momentum(P, r) + s] over the matrix-rule parameters: the rule's shard state, kept in
  the parameter's layout (:meth:`~..rules.base.MatrixRule.init_shard_state`). momentum(P, r) is the momentum
  buffer of Muon, NorMuon and MOP in ``momentum_dtype``'s format (:mod:`..kernels.low_precision`): 4n
  (float32, the parameter's dtype), 2n (bfloat16), or n + 4·R·(⌈c₁/b⌉ − ⌊c₀/b⌋) (int8: one float32 scale per
  block of b = :data:`INT8_BLOCK` entries of the last dimension, blocks counted from global column 0, for the
  R rows of r's box and its last-dimension range [c₀, c₁)), n = numel(P, r); 0 for a rule without one (SOAP).
  s: the rule's 0-d entries per parameter (SOAP's step count: 4), kept on the host as torch keeps AdamW's.
- ``adamw_state`` = Σ_P [2·p·numel(P, r) + 4] over the AdamW parameters (embeddings, norms, output head):
  ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype (float32), and the 0-d ``step`` on the host.
- ``owner_state`` = Σ over the matrices r computes (owned, local, a tensor-parallel group's member) of the
  rule's declared owner-state bytes (:attr:`~..rules.base.MatrixCost.owner_state_bytes`: SOAP 4·(2mn + Σ_k
  (2k² + k)) + 8 over its preconditioned sides k, NorMuon 4m, Muon and MOP 0): the plan's
  :attr:`~.model.Plan.rank_owner_state_bytes`, which it balances.
- ``exchange`` = (u + w)·Σ_P numel(P, r) over the parameters not fully local to r (U, the prepared input,
  u = 4 for a new float32 tensor, 0 where ``prepare`` returns the gradient itself; the update buffer each
  return exchange lands in, in the wire dtype w)
  + w·(out_send + out_recv + back_send + back_recv) (elements of the pieces r sends to and receives from
  owners and of the pieces of O it sends back and receives, every bucket's: a step launches every bucket's
  exchange out at once and leaves every return exchange in flight until the updates are applied)
  + o·Σ_units B·m·n over the owned and tensor-parallel units r computes (their direction outputs O, in the
  rule's input dtype o, each held until its return exchange has packed it: counted as if all were alive)
  + max(w·assembled, u·local): the larger of the largest bucket's whole matrices assembled on r (one bucket
  at a time) and the fully local parameters' U alive at once (the local units run first; a parameter's U lives
  from its first call to its last, and a stack of short runs spans several parameters: :func:`local_inputs`).
  All of a step's exchange buffers counted as alive at once: an upper bound of their peak (NCCL frees a
  bucket's send buffer once it is waited for).
- ``ns_workspace`` = max over the calls r makes of B·ω·(2mn + 4m²), ω the Newton–Schulz working dtype's
  bytes (a call: a unit of B matrices, or with stacks, :mod:`..engine.stacks`, up to ``units_per_stack``
  same-size units of one shape where stacking pays, B their matrices together; counted as if every such unit of
  r joined a stack, an upper bound where a holder's long runs stack only within their parameter): the start
  X₀ and the current X, and the m×m matrices of the Gram form (R, Z, Q and a product; the standard form needs
  two: X·Xᵀ and b·A + c·A·A). 0 for a rule that runs no Newton–Schulz (MOP's SVD and
  SOAP's products: their direction workspace is not modelled).
- with ``offload="host"`` (:mod:`..engine.offload`) the momentum and AdamW's moments leave the device:
  ``shard_state`` keeps only the scalars s and ``adamw_state`` only the steps, and
  ``offload_staging`` = min(S, 3·max(b, S₁)) holds their device copies: a bucket being copied in, one being
  updated, one being copied back, each at most the state bucket b (the optimizer's ``bucket_size_mb``) or one
  parameter's momentum S₁ where that is larger (AdamW's moments go in pieces of at most b); S: all of them.
  ``host_state`` (host memory, not in the optimizer's device total) = 2·momentum over several ranks (the state
  and its spare: such a step writes the new momentum beside the old), 1·momentum on one process, + 2·p·Σ numel
  over the AdamW parameters.
- ``cuda_graphs`` = Σ over the distinct call signatures (B, m, n) r computes through the owner's runner
  (not ``tp_mode="distributed"``) with B·m²·n ≤ :data:`~..linalg.ns_graphs.MAX_GRAPH_WORK` of B·ω·(3mn + 4m²):
  per captured graph its start buffer outside its private pool, and the pool, which keeps the capture's
  peak (X, its next value, the m×m matrices). 0 without CUDA graphs or Newton–Schulz. Where an owner assembles
  a call's input in the runner's staging buffer (:meth:`~..engine.context.StepContext.input_buffer`), that buffer
  is the graph's start, and ``exchange``'s assembled term counts it a second time: an upper bound.

The optimizer's total is the sum of the terms after ``params_grads``; :func:`peak` takes each term's maximum
over the ranks and the largest total of one rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from ..distributed.layout import Box, ParamLayout, box_numel
from ..kernels.batching import group_into_stacks, holder_stack_keys, stacking_pays
from ..kernels.low_precision import INT8_BLOCK, MOMENTUM_DTYPES, int8_blocks
from ..linalg.newton_schulz import resolve_ns_dtype
from ..linalg.ns_graphs import MAX_GRAPH_WORK
from .model import Plan
from .placement import GatherAll, Local, Owned, TensorParallelGroup
from .views import matrix_shape_of_box

if TYPE_CHECKING:
    from ..rules.base import MatrixRule

PARAM_ITEMSIZE = 4
"""Bytes per element of the parameters, their gradients and AdamW's moments: float32 FSDP shards."""

ADAMW_STEP_BYTES = 4
"""AdamW's 0-d float32 ``step`` per parameter (on the host, as torch.optim.AdamW keeps it)."""


def momentum_bytes(box: Box, momentum_dtype: str = "float32") -> int:
    """Bytes of the momentum state of a shard holding ``box`` of its parameter (see the module docstring):
    4n, 2n, or n + 4·R·(⌈c₁/b⌉ − ⌊c₀/b⌋) for int8 (codes and float32 scales)."""
    numel = box_numel(box)
    if momentum_dtype == "float32":
        return PARAM_ITEMSIZE * numel
    if momentum_dtype == "bfloat16":
        return 2 * numel
    if momentum_dtype == "int8":
        if numel == 0:
            return 0
        (first, stop), rows = box[-1], numel // (box[-1][1] - box[-1][0])
        return numel + 4 * rows * (int8_blocks(stop) - first // INT8_BLOCK)
    raise ValueError(f"momentum_dtype: expected one of {MOMENTUM_DTYPES}, got {momentum_dtype!r}")


@dataclass(frozen=True)
class OptimizerMemory:
    """What the model reads of an optimizer (see the module docstring for each term)."""

    momentum: bool
    """Whether the shard state holds a buffer of the parameter's shape (Muon, NorMuon, MOP)."""
    shard_scalar_bytes: int
    """Bytes of the shard state's 0-d entries per parameter (SOAP's step count: 4)."""
    input_itemsize: int
    """u: bytes per element of U on the shard; 0 where ``prepare`` returns the gradient itself."""
    output_itemsize: int
    """o: bytes per element of the direction's output O (the rule's input dtype)."""
    wire_itemsize: int
    """w: bytes per element on the wire and in the update buffers."""
    ns_itemsize: int
    """ω: bytes per element of Newton–Schulz's working dtype; 0 for a rule that runs none."""
    momentum_dtype: str = "float32"
    cuda_graphs: bool = True
    """Whether owners replay Newton–Schulz from CUDA graphs (the optimizer's ``ns_cuda_graphs`` on CUDA)."""
    offload: bool = False
    """The optimizer's ``offload="host"``: momentum and AdamW moments in host memory, streamed through buckets."""
    bucket_bytes: int = 64 * 2**20
    """b: the optimizer's bucket (``bucket_size_mb``), which also bounds each streamed bucket of state."""
    units_per_stack: int = 1
    """Most same-size units of one shape in one call (:func:`..kernels.batching.units_per_stack`); 1: none stack."""

    def __post_init__(self) -> None:
        if self.momentum_dtype not in MOMENTUM_DTYPES:
            raise ValueError(f"momentum_dtype: expected one of {MOMENTUM_DTYPES}, got {self.momentum_dtype!r}")
        if self.units_per_stack < 1:
            raise ValueError(f"units_per_stack: expected an int >= 1, got {self.units_per_stack!r}")

    @classmethod
    def from_rule(
        cls,
        rule: MatrixRule,
        group: Mapping[str, Any],
        wire_itemsize: int,
        *,
        momentum_dtype: str = "float32",
        cuda_graphs: bool = True,
        offload: bool = False,
        bucket_bytes: int = 64 * 2**20,
        units_per_stack: int = 1,
    ) -> OptimizerMemory:
        """Read from the rule under ``group``'s settings: its shard state (``init_shard_state`` of a float32
        probe: entries of the probe's shape are the momentum buffer, the others per-parameter scalars), whether
        ``prepare`` allocates U (it returns the probe gradient itself, or a new tensor), its input dtype (O's),
        where the group holds ``ns_dtype``, Newton–Schulz's working dtype, and whether its units stack at all
        (``units_per_stack`` where they do, else 1)."""
        probe = torch.zeros(2, 3)
        state = rule.init_shard_state(probe, dict(group), "probe")
        u = rule.prepare(probe, state, dict(group))
        return cls(
            momentum=any(t.shape == probe.shape for t in state.values()),
            shard_scalar_bytes=sum(t.nbytes for t in state.values() if t.shape != probe.shape),
            input_itemsize=0 if u.data_ptr() == probe.data_ptr() else u.element_size(),
            output_itemsize=rule.input_dtype(dict(group)).itemsize,
            wire_itemsize=wire_itemsize,
            ns_itemsize=resolve_ns_dtype(group["ns_dtype"]).itemsize if "ns_dtype" in group else 0,
            momentum_dtype=momentum_dtype,
            cuda_graphs=cuda_graphs,
            offload=offload,
            bucket_bytes=bucket_bytes,
            units_per_stack=units_per_stack if rule.stacks_units(dict(group), (2, 3), 2, probe.device) else 1,
        )


@dataclass(frozen=True)
class MeshPlan:
    """One mesh's plan and the layouts of its parameters, by the ``param_index`` the plan's matrices carry."""

    plan: Plan
    layouts: Mapping[int, ParamLayout]


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds, per term (see the module docstring)."""

    params_grads: int
    shard_state: int
    adamw_state: int
    owner_state: int
    exchange: int
    ns_workspace: int
    cuda_graphs: int
    offload_staging: int = 0
    host_state: int = 0
    """Host memory (offload="host"), not in :attr:`optimizer`."""

    @property
    def optimizer(self) -> int:
        """The optimizer's device total: every term but ``params_grads`` and ``host_state``."""
        return (
            self.shard_state
            + self.adamw_state
            + self.owner_state
            + self.exchange
            + self.ns_workspace
            + self.cuda_graphs
            + self.offload_staging
        )


@dataclass(frozen=True)
class MemoryPeak:
    """Each term's maximum over the ranks (bytes; the busiest rank of one term need not be another's), the
    largest optimizer total of one rank, and the largest total with the rank's parameters and gradients."""

    params_grads: int
    shard_state: int
    adamw_state: int
    owner_state: int
    exchange: int
    ns_workspace: int
    cuda_graphs: int
    offload_staging: int
    host_state: int
    optimizer: int
    with_params_grads: int


def peak(ranks: Sequence[RankMemory]) -> MemoryPeak:
    """Per-term maxima over ``ranks`` and the largest per-rank totals."""
    terms = {f.name: max(getattr(r, f.name) for r in ranks) for f in fields(RankMemory)}
    return MemoryPeak(
        **terms,
        optimizer=max(r.optimizer for r in ranks),
        with_params_grads=max(r.optimizer + r.params_grads for r in ranks),
    )


def ns_workspace_bytes(batch: int, shape: tuple[int, int], itemsize: int) -> int:
    """B·ω·(2mn + 4m²) for B matrices of ``shape`` (m the shorter side)."""
    m, n = min(shape), max(shape)
    return batch * itemsize * (2 * m * n + 4 * m * m)


def graph_bytes(batch: int, shape: tuple[int, int], itemsize: int) -> int:
    """B·ω·(3mn + 4m²): one captured graph's start buffer and private pool for B matrices of ``shape``."""
    m, n = min(shape), max(shape)
    return batch * itemsize * (3 * m * n + 4 * m * m)


def memory_per_rank(
    meshes: Sequence[MeshPlan],
    adamw: Sequence[ParamLayout],
    optimizer: OptimizerMemory,
    world_size: int,
) -> list[RankMemory]:
    """Every rank's :class:`RankMemory` for these plans (each over ``world_size`` ranks) and AdamW parameters."""
    for mesh in meshes:
        if mesh.plan.world_size != world_size:
            raise ValueError(f"a plan over {mesh.plan.world_size} ranks in a model of {world_size} ranks")
    matrix_layouts = [layout for mesh in meshes for layout in mesh.layouts.values()]
    for layout in [*adamw, *matrix_layouts]:
        if layout.world_size != world_size:
            raise ValueError(f"parameter {layout.name!r} is laid out over {layout.world_size} ranks, not {world_size}")
    exchange = [0] * world_size
    computed: list[list[ComputedUnit]] = [[] for _ in range(world_size)]
    for mesh in meshes:
        for rank, nbytes in enumerate(exchange_per_rank(mesh, optimizer)):
            exchange[rank] += nbytes
        for rank, units in enumerate(units_per_rank(mesh.plan)):
            computed[rank].extend(units)
    ns = optimizer.ns_itemsize
    calls = [stacked(units, optimizer.units_per_stack) for units in computed]
    out = []
    for rank in range(world_size):
        matrix_numels = [box_numel(layout.boxes[rank]) for layout in matrix_layouts]
        adamw_numels = [box_numel(layout.boxes[rank]) for layout in adamw]
        scalars = optimizer.shard_scalar_bytes * len(matrix_numels)
        momenta = [
            momentum_bytes(layout.boxes[rank], optimizer.momentum_dtype) if optimizer.momentum else 0
            for layout in matrix_layouts
        ]
        moments = [2 * PARAM_ITEMSIZE * n for n in adamw_numels]
        steps = ADAMW_STEP_BYTES * len(adamw_numels)
        device_state = (scalars, steps) if optimizer.offload else (scalars + sum(momenta), steps + sum(moments))
        out.append(
            RankMemory(
                params_grads=2 * PARAM_ITEMSIZE * (sum(matrix_numels) + sum(adamw_numels)),
                shard_state=device_state[0],
                adamw_state=device_state[1],
                owner_state=sum(mesh.plan.rank_owner_state_bytes[rank] for mesh in meshes),
                exchange=exchange[rank],
                ns_workspace=max((ns_workspace_bytes(b, s, ns) for b, s, _ in calls[rank]), default=0),
                cuda_graphs=graphs_bytes(calls[rank], ns) if optimizer.cuda_graphs else 0,
                offload_staging=staging_bytes(momenta, moments, optimizer.bucket_bytes) if optimizer.offload else 0,
                host_state=(2 if world_size > 1 else 1) * sum(momenta) + sum(moments) if optimizer.offload else 0,
            )
        )
    return out


def staging_bytes(whole: Sequence[int], in_pieces: Sequence[int], bucket_bytes: int) -> int:
    """min(S, 3·max(b, S₁)): the device copies of streamed state, ``whole`` the per-parameter sizes streamed
    whole (momentum), ``in_pieces`` those streamed in pieces of at most b (AdamW's moments); see the module
    docstring."""
    total = sum(whole) + sum(in_pieces)
    return min(total, 3 * max(bucket_bytes, max(whole, default=0)))


ComputedUnit = tuple[int, tuple[int, int], bool]
"""(B, m×n shape, run through the owner's Newton–Schulz runner) of a unit a rank computes."""


def units_per_rank(plan: Plan) -> list[list[ComputedUnit]]:
    """The units each rank computes: its owned units, the local ones it holds, those of the tensor-parallel
    groups it is in (``distributed``: its block, not through the runner). A grouped split's parts are one
    matrix of their whole shape."""
    out: list[list[ComputedUnit]] = [[] for _ in range(plan.world_size)]
    for unit in plan.units:
        first = plan.routes[unit.members[0]]
        batch = len(unit.members) // first.spec.parts
        p = unit.placement
        if isinstance(p, GatherAll):
            raise ValueError(
                "the memory model covers owned, local and tensor-parallel units, not exchange='gather_all'"
            )
        if isinstance(p, TensorParallelGroup) and p.distributed:
            for member, target, _ in first.targets:
                out[member].append((batch, matrix_shape_of_box(target, len(target)), False))
            continue
        if isinstance(p, Owned):
            ranks: Iterable[int] = (p.rank,)
        elif isinstance(p, TensorParallelGroup):
            ranks = p.ranks
        else:  # Local: every holder
            ranks = dict.fromkeys(rank for rank, _ in first.holders)
        for rank in ranks:
            out[rank].append((batch, first.spec.whole_shape, True))
    return out


def stacked(units: list[ComputedUnit], units_per_stack: int) -> list[ComputedUnit]:
    """The calls that make ``units``: those of B ≥ 2 matrices run through the runner, in stacks of up to
    ``units_per_stack`` units of one (B, shape) where stacking pays, in their order, (k·B, shape); the others
    alone."""

    def key(unit: ComputedUnit) -> tuple | None:
        batch, shape, runner = unit
        return (batch, shape) if runner and stacking_pays(batch, shape) else None

    stacks = group_into_stacks(units, key, units_per_stack)
    return [(sum(batch for batch, _, _ in stack), stack[0][1], stack[0][2]) for stack in stacks]


def graphs_bytes(computed: list[ComputedUnit], itemsize: int) -> int:
    """Σ :func:`graph_bytes` over the distinct (B, m, n) run through the runner within MAX_GRAPH_WORK."""
    signatures = set()
    for batch, shape, runner in computed:
        m, n = min(shape), max(shape)
        if runner and batch * m * m * n <= MAX_GRAPH_WORK:
            signatures.add((batch, shape))
    return sum(graph_bytes(batch, shape, itemsize) for batch, shape in signatures)


def exchange_per_rank(mesh: MeshPlan, optimizer: OptimizerMemory) -> list[int]:
    """The ``exchange`` term of one mesh's plan on each rank (see the module docstring)."""
    plan = mesh.plan
    world = plan.world_size
    u, w, o = optimizer.input_itemsize, optimizer.wire_itemsize, optimizer.output_itemsize
    fully_local = plan.fully_local_params()
    routed = [0] * world  # elements of the shards of the parameters not fully local
    for k, layout in mesh.layouts.items():
        if k not in fully_local:
            for rank, box in enumerate(layout.boxes):
                routed[rank] += box_numel(box)
    local = local_inputs(mesh, optimizer.units_per_stack)
    wire = [0] * world  # elements sent and received, out and back
    outputs = [0] * world  # elements of O held
    for route in plan.routes:
        placement = plan.units[route.unit].placement
        if isinstance(placement, Owned):
            owner = placement.rank
            for box, source in route.pieces:
                wire[source] += box_numel(box)
                wire[owner] += box_numel(box)
            for holder, box in route.holders:
                wire[holder] += box_numel(box)
                wire[owner] += box_numel(box)
            outputs[owner] += route.spec.numel
        elif isinstance(placement, TensorParallelGroup):
            for member, target, pieces in route.targets:
                for box, source in pieces:
                    wire[source] += box_numel(box)
                    wire[member] += box_numel(box)
                outputs[member] += box_numel(target)
            for (holder, box), member in zip(route.holders, route.back_from):
                wire[holder] += box_numel(box)
                wire[member] += box_numel(box)
    assembled = [0] * world  # the largest bucket's whole matrices (or tensor-parallel targets)
    for bucket in [*plan.buckets, *plan.tensor_parallel_buckets]:
        for rank, elements in assembled_per_rank(plan, bucket).items():
            assembled[rank] = max(assembled[rank], elements)
    return [
        (u + w) * routed[r] + w * wire[r] + o * outputs[r] + max(w * assembled[r], u * local[r]) for r in range(world)
    ]


def local_inputs(mesh: MeshPlan, units_per_stack: int) -> list[int]:
    """Per rank, the most elements of fully local parameters' U alive at once while its local units run
    (:mod:`..engine.strategies.local`): a parameter's U from the call that takes its first unit to the one that
    takes its last. Calls are the holder's stacks (:func:`..kernels.batching.holder_stack_keys`: short runs of
    several parameters in one call, so every parameter a stack spans is alive together); without stacks, the
    largest fully local shard."""
    plan = mesh.plan
    fully_local = plan.fully_local_params()
    held: list[list[tuple[int, tuple[int, int] | None]]] = [[] for _ in range(plan.world_size)]
    for u in plan.units_placed(Local):
        route = plan.routes[plan.units[u].members[0]]
        batch, shape = len(plan.units[u].members), route.spec.shape
        key = (batch, shape) if route.spec.parts == 1 and stacking_pays(batch, shape) else None
        for rank in dict.fromkeys(rank for rank, _ in route.holders):
            held[rank].append((route.spec.param_index, key))
    out = []
    for rank, units in enumerate(held):
        params = [p for p, _ in units]
        keys = holder_stack_keys(params, [k for _, k in units])
        span: dict[int, list[int]] = {}  # fully local parameter: [first call, last call]
        for call, stack in enumerate(group_into_stacks(range(len(units)), keys.__getitem__, units_per_stack)):
            for i in stack:
                if params[i] in fully_local:
                    span.setdefault(params[i], [call, call])[1] = call
        alive = [0] * (max((last for _, last in span.values()), default=-1) + 1)
        for param, (first, last) in span.items():
            for call in range(first, last + 1):
                alive[call] += box_numel(mesh.layouts[param].boxes[rank])
        out.append(max(alive, default=0))
    return out


def assembled_per_rank(plan: Plan, bucket: list[int]) -> dict[int, int]:
    """Elements of the whole matrices (or tensor-parallel targets) each rank assembles for one bucket."""
    total: dict[int, int] = {}
    for i in bucket:
        route = plan.routes[i]
        if route.owner is not None:
            total[route.owner] = total.get(route.owner, 0) + route.spec.numel
        for member, target, _ in route.targets:
            total[member] = total.get(member, 0) + box_numel(target)
    return total
