"""Strategy for :class:`~dtensor_muon.placement.Owned` units: gathered whole to one owner, computed once there.

Per bucket of the plan: one variable-size all-to-all carries every source rank's pieces of U to their
owners, each owner assembles its matrices (pieces in route order per source), computes its units, and one
all-to-all back carries each holder's part of O. The return exchanges are left in flight: the engine's
pending updates unpack and apply them (at once, or in the next forward with overlap).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

from ..exchange import PendingExchange, start_all_to_all
from ..layout import box_numel, box_shape, relative_slices
from ..pending import BackExchange
from ..plan import MatrixRoute
from ..step_context import MeshWork, StepContext, local


def run(ctx: StepContext, work: MeshWork) -> list[BackExchange]:
    """Exchange out, compute owned units, launch the return exchanges (see the module docstring)."""
    return exchange_buckets(ctx, work, work.plan.buckets, _launch_out, _compute_owned, _launch_back, _unpack_back)


def exchange_buckets(
    ctx: StepContext,
    work: MeshWork,
    buckets: list[list[int]],
    launch_out: Callable[[StepContext, MeshWork, list[int], torch.device], PendingExchange],
    compute: Callable[[StepContext, MeshWork, list[int], dict[int, Tensor], torch.device], dict[int, Tensor]],
    launch_back: Callable[[StepContext, MeshWork, list[MatrixRoute], dict[int, Tensor], torch.device], PendingExchange],
    unpack_back: Callable[[StepContext, MeshWork, list[MatrixRoute], dict[int, Tensor]], None],
) -> list[BackExchange]:
    """Every bucket's exchange out launched at once, then per bucket: wait, compute, launch the exchange back
    (left in flight as a :class:`BackExchange` that ``unpack_back`` completes; with ``ctx.hold_backs`` left
    for the engine to launch once every rank's directions succeeded). Shared by the owned and the
    tensor-parallel strategies, which differ in what they send, compute and send back."""
    if not buckets:
        return []
    device = local(work.entries[0].param).device
    with ctx.timer.phase("exchange_out_launch"):
        pending_out = [launch_out(ctx, work, bucket, device) for bucket in buckets]
    backs: list[BackExchange] = []
    for bucket, pending in zip(buckets, pending_out):
        with ctx.timer.phase("exchange_out_wait"):
            received = pending.wait()
        with ctx.timer.phase("owner_compute"):
            outputs = compute(ctx, work, bucket, received, device)
        with ctx.timer.phase("exchange_back_launch"):
            routes = active_routes(ctx, work, bucket)
            indices = tuple(dict.fromkeys(r.spec.param_index for r in routes))
            back = BackExchange(
                lambda routes=routes, outputs=outputs: launch_back(ctx, work, routes, outputs, device),
                indices,
                lambda got, routes=routes: unpack_back(ctx, work, routes, got),
            )
            if not ctx.hold_backs:
                back.start()
            backs.append(back)
    return backs


def active_routes(ctx: StepContext, work: MeshWork, bucket: list[int]) -> list[MatrixRoute]:
    """The routes of ``bucket`` whose parameter takes part in this step."""
    return [work.plan.routes[i] for i in bucket if work.plan.routes[i].spec.param_index in ctx.active]


def sent_bytes(send: dict[int, list[Tensor]], me: int, itemsize: int) -> int:
    """Bytes of ``send`` that leave this rank (pieces to itself excluded)."""
    return sum(p.numel() for rank, parts in send.items() if rank != me for p in parts) * itemsize


def _launch_out(ctx: StepContext, work: MeshWork, bucket: list[int], device: torch.device) -> PendingExchange:
    me = work.comm.mesh_rank
    send: dict[int, list[Tensor]] = defaultdict(list)
    recv: dict[int, int] = defaultdict(int)
    for route in active_routes(ctx, work, bucket):
        e = ctx.entries[route.spec.param_index]
        for box, source in route.pieces:
            if source == me:
                send[route.owner].append(ctx.inputs[e.index][relative_slices(box, e.layout.local_box)])
            if route.owner == me:
                recv[source] += box_numel(box)
    ctx.stats.bytes_sent += sent_bytes(send, me, work.wire_dtype.itemsize)
    return start_all_to_all(work.comm, send, recv, work.wire_dtype, device)


def _compute_owned(
    ctx: StepContext, work: MeshWork, bucket: list[int], received: dict[int, Tensor], device: torch.device
) -> dict[int, Tensor]:
    """Assemble each owned matrix from its pieces, compute its unit; O per ``id(route)``, in the box's shape."""
    me = work.comm.mesh_rank
    offsets: dict[int, int] = defaultdict(int)
    by_unit: dict[int, list[tuple[int, Tensor]]] = defaultdict(list)
    for i in bucket:
        route = work.plan.routes[i]
        if route.spec.param_index not in ctx.active or route.owner != me:
            continue
        full = torch.empty(box_shape(route.spec.box), dtype=work.wire_dtype, device=device)
        for box, source in route.pieces:
            n = box_numel(box)
            chunk = received[source][offsets[source] : offsets[source] + n]
            offsets[source] += n
            target = full[relative_slices(box, route.spec.box)]
            target.copy_(chunk.view(target.shape))
        by_unit[route.unit].append((i, full))
    out: dict[int, Tensor] = {}
    for members in by_unit.values():
        jobs = [(work.plan.routes[i].spec, full) for i, full in members]
        for (i, _), o in zip(members, ctx.compute(jobs)):
            route = work.plan.routes[i]
            out[id(route)] = o.reshape(box_shape(route.spec.box))
    return out


def _launch_back(
    ctx: StepContext, work: MeshWork, routes: list[MatrixRoute], updates: dict[int, Tensor], device: torch.device
) -> PendingExchange:
    me = work.comm.mesh_rank
    send: dict[int, list[Tensor]] = defaultdict(list)
    recv: dict[int, int] = defaultdict(int)
    for route in routes:
        for holder, box in route.holders:
            if route.owner == me:
                send[holder].append(updates[id(route)][relative_slices(box, route.spec.box)])
            if holder == me:
                recv[route.owner] += box_numel(box)
    ctx.stats.bytes_sent += sent_bytes(send, me, work.wire_dtype.itemsize)
    return start_all_to_all(work.comm, send, recv, work.wire_dtype, device)


def _unpack_back(ctx: StepContext, work: MeshWork, routes: list[MatrixRoute], received: dict[int, Tensor]) -> None:
    """Copy one bucket's received update pieces into the per-parameter update buffers."""
    me = work.comm.mesh_rank
    offsets: dict[int, int] = defaultdict(int)
    for route in routes:
        e = ctx.entries[route.spec.param_index]
        for holder, box in route.holders:
            if holder != me:
                continue
            n = box_numel(box)
            chunk = received[route.owner][offsets[route.owner] : offsets[route.owner] + n]
            offsets[route.owner] += n
            target = ctx.updates[e.index][relative_slices(box, e.layout.local_box)]
            target.copy_(chunk.view(target.shape))
