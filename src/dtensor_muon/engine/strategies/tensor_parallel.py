"""Strategy for :class:`~dtensor_muon.plan.placement.TensorParallelGroup` units: one TP group computes each unit.

Per bucket: one variable-size all-to-all over the mesh carries to every member of the unit's TP group the
pieces of its target (the whole matrix, or its TP block in distributed mode); each member computes —
duplicated: the rule's direction on the whole matrix, as an owner would; distributed: its block of the
Newton–Schulz result with the group's other members, one all-reduce of the small Gram matrix per iteration
over the TP group (:mod:`dtensor_muon.linalg.distributed_ns`) — and one all-to-all back carries each
holder its piece from the member of its own TP coordinate. The return exchanges are packed, launched and left in
flight as in :mod:`.owned`.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import Tensor

from ...distributed.exchange import PackedExchange, PendingExchange, pack_all_to_all
from ...distributed.layout import TENSOR_PARALLEL_DIM, box_numel, box_shape, relative_slices
from ...plan import MatrixRoute
from ...plan.placement import TensorParallelGroup
from ...plan.views import matrix_shape_of_box
from ..context import MeshWork, StepContext
from ..pending import BackExchange
from .owned import active_routes, exchange_buckets, inputs_sent_through, sent_bytes


def run(ctx: StepContext, work: MeshWork) -> list[BackExchange]:
    """Exchange out, compute this rank's share of each TP unit, pack the return exchanges; U of a parameter is
    let go once the last bucket with a piece of it is launched (this is the last strategy to read U)."""
    plan, me = work.plan, work.comm.mesh_rank
    return exchange_buckets(
        ctx,
        work,
        plan.tensor_parallel_buckets,
        _launch_out,
        _compute,
        _pack_back,
        _unpack_back,
        inputs_sent_through(
            ctx,
            work,
            plan.tensor_parallel_buckets,
            lambda route: any(source == me for _, _, pieces in route.targets for _, source in pieces),
            set(),
        ),
    )


def _launch_out(ctx: StepContext, work: MeshWork, bucket: list[int], device: torch.device) -> PendingExchange:
    me = work.comm.mesh_rank
    send: dict[int, list[Tensor]] = defaultdict(list)
    recv: dict[int, int] = defaultdict(int)
    for route in active_routes(ctx, work, bucket):
        e = ctx.entries[route.spec.param_index]
        for member, _, pieces in route.targets:
            for box, source in pieces:
                if source == me:
                    send[member].append(ctx.inputs[e.index][relative_slices(box, e.layout.local_box)])
                if member == me:
                    recv[source] += box_numel(box)
    ctx.stats.bytes_sent += sent_bytes(send, me, work.wire_dtype.itemsize)
    return pack_all_to_all(work.comm, send, recv, work.wire_dtype, device).start()


def _compute(
    ctx: StepContext,
    work: MeshWork,
    buckets: list[list[int]],
    receiveds: list[dict[int, Tensor]],
    device: torch.device,
) -> dict[int, Tensor]:
    """This rank's output on its target of each unit of ``buckets`` it is a member of, per ``id(route)``, in the
    target's shape; bucket by bucket (``receiveds``: per bucket, what each source sent)."""
    out: dict[int, Tensor] = {}
    for bucket, received in zip(buckets, receiveds):
        out.update(_compute_bucket(ctx, work, bucket, received, device))
    return out


def _compute_bucket(
    ctx: StepContext, work: MeshWork, bucket: list[int], received: dict[int, Tensor], device: torch.device
) -> dict[int, Tensor]:
    """:func:`_compute` on one bucket."""
    me = work.comm.mesh_rank
    offsets: dict[int, int] = defaultdict(int)
    by_unit: dict[int, list[tuple[MatrixRoute, Tensor]]] = defaultdict(list)
    for route in active_routes(ctx, work, bucket):
        for member, target, pieces in route.targets:
            if member != me:
                continue
            whole = torch.empty(box_shape(target), dtype=work.wire_dtype, device=device)
            for box, source in pieces:
                n = box_numel(box)
                part = whole[relative_slices(box, target)]
                part.copy_(received[source][offsets[source] : offsets[source] + n].view(part.shape))
                offsets[source] += n
            by_unit[route.unit].append((route, whole))
    out: dict[int, Tensor] = {}
    for unit, members in by_unit.items():
        placement = work.plan.units[unit].placement
        assert isinstance(placement, TensorParallelGroup)
        if placement.distributed:
            for route, block in members:
                out[id(route)] = _distributed_direction(ctx, work, route, block)
            continue
        jobs = [(route.spec, whole) for route, whole in members]
        for (route, _), o in zip(members, ctx.compute(jobs)):
            out[id(route)] = o.reshape(box_shape(route.spec.box))
    return out


def _distributed_direction(ctx: StepContext, work: MeshWork, route: MatrixRoute, block: Tensor) -> Tensor:
    """This member's block of the direction, computed with the rest of its TP group."""
    e = ctx.entries[route.spec.param_index]
    placement = work.plan.units[route.unit].placement
    assert isinstance(placement, TensorParallelGroup)
    ndim = len(route.spec.box)
    long_dim = placement.dim if ndim == 2 else placement.dim - 1
    group = work.mesh.get_group(TENSOR_PARALLEL_DIM)
    shape = matrix_shape_of_box(next(t for m, t, _ in route.targets if m == work.comm.mesh_rank), ndim)
    o = ctx.rule.distributed_direction(  # type: ignore[attr-defined]
        block.reshape(shape), long_dim, lambda t: _all_reduce_in_float32(t, group), e.group
    )
    ctx.stats.add_flops(ctx.rule.cost(e.group, route.spec.shape).flops // len(route.targets))
    return o.reshape(block.shape)


def _all_reduce_in_float32(t: Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``t`` over ``group`` in place, adding in float32 (a bf16 sum would round each partial Gram matrix's
    addition to 8 bits, which Newton–Schulz then amplifies)."""
    if t.dtype == torch.float32:
        dist.all_reduce(t, group=group)
        return
    wide = t.float()
    dist.all_reduce(wide, group=group)
    t.copy_(wide)


def _pack_back(
    ctx: StepContext, work: MeshWork, routes: list[MatrixRoute], outputs: dict[int, Tensor], device: torch.device
) -> PackedExchange:
    me = work.comm.mesh_rank
    send: dict[int, list[Tensor]] = defaultdict(list)
    recv: dict[int, int] = defaultdict(int)
    for route in routes:
        target = next((t for m, t, _ in route.targets if m == me), None)
        for (holder, box), member in zip(route.holders, route.back_from):
            if member == me:
                assert target is not None
                send[holder].append(outputs[id(route)][relative_slices(box, target)])
            if holder == me:
                recv[member] += box_numel(box)
    ctx.stats.bytes_sent += sent_bytes(send, me, work.wire_dtype.itemsize)
    return pack_all_to_all(work.comm, send, recv, work.wire_dtype, device, launched_later=ctx.hold_backs)


def _unpack_back(ctx: StepContext, work: MeshWork, routes: list[MatrixRoute], received: dict[int, Tensor]) -> None:
    """Copy one bucket's received update pieces into the per-parameter update buffers."""
    me = work.comm.mesh_rank
    offsets: dict[int, int] = defaultdict(int)
    for route in routes:
        e = ctx.entries[route.spec.param_index]
        for (holder, box), member in zip(route.holders, route.back_from):
            if holder != me:
                continue
            n = box_numel(box)
            target = ctx.updates[e.index][relative_slices(box, e.layout.local_box)]
            target.copy_(received[member][offsets[member] : offsets[member] + n].view(target.shape))
            offsets[member] += n
