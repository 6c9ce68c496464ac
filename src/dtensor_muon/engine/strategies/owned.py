"""Strategy for :class:`~dtensor_muon.plan.placement.Owned` units: gathered whole to one owner, computed once there.

Per bucket of the plan: one variable-size all-to-all carries every source rank's pieces of U to their
owners, each owner assembles its matrices (pieces in route order per source), computes its units, and one
all-to-all back carries each holder's part of O. Where units stack (:mod:`..stacks`), an owner computes
consecutive buckets together until it holds a stack's worth of units, several same-size units of one shape in
one call. Each return exchange is packed as soon as its bucket is computed and launched at once, or, in a step
over several ranks, by the engine once every rank's directions succeeded; the engine's pending updates unpack
and apply them (at once, or in the next forward with overlap).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

from ...distributed.exchange import PackedExchange, PendingExchange, pack_all_to_all
from ...distributed.layout import box_numel, box_shape, contiguous_offset, local, relative_slices
from ...kernels.batching import group_into_stacks, units_per_stack
from ...plan import MatrixRoute
from ...plan.placement import TensorParallelGroup
from ..context import MeshWork, StepContext, newton_schulz_input_shape
from ..pending import BackExchange
from ..stacks import stack_key


def run(ctx: StepContext, work: MeshWork) -> list[BackExchange]:
    """Exchange out, compute owned units, pack the return exchanges (see the module docstring). U of a
    parameter that no tensor-parallel unit reads is let go as soon as the last bucket with a piece of it is
    launched: the send buffers then hold those pieces."""
    plan, me = work.plan, work.comm.mesh_rank
    tensor_parallel = {
        plan.routes[i].spec.param_index for u in plan.units_placed(TensorParallelGroup) for i in plan.units[u].members
    }
    return exchange_buckets(
        ctx,
        work,
        plan.buckets,
        _launch_out,
        _compute_owned,
        _pack_back,
        _unpack_back,
        inputs_sent_through(
            ctx, work, plan.buckets, lambda route: any(source == me for _, source in route.pieces), tensor_parallel
        ),
        computed_together(ctx, work, plan.buckets),
    )


def inputs_sent_through(
    ctx: StepContext,
    work: MeshWork,
    buckets: list[list[int]],
    sends: Callable[[MatrixRoute], bool],
    keep: set[int],
) -> Callable[[int], None]:
    """A callback for :func:`exchange_buckets`: after bucket k of ``buckets`` (indices into the plan's routes)
    is launched, let go of the U of the parameters whose last route this rank ``sends`` a piece of is in bucket
    k, except those in ``keep``."""
    last: dict[int, int] = {}
    for k, bucket in enumerate(buckets):
        for i in bucket:
            route = work.plan.routes[i]
            if sends(route):
                last[route.spec.param_index] = k
    after: dict[int, list[int]] = defaultdict(list)
    for index, k in last.items():
        if index not in keep:
            after[k].append(index)
    return lambda k: ctx.release_inputs(after.get(k, []))


def exchange_buckets(
    ctx: StepContext,
    work: MeshWork,
    buckets: list[list[int]],
    launch_out: Callable[[StepContext, MeshWork, list[int], torch.device], PendingExchange],
    compute: Callable[
        [StepContext, MeshWork, list[list[int]], list[dict[int, Tensor]], torch.device], dict[int, Tensor]
    ],
    pack_back: Callable[[StepContext, MeshWork, list[MatrixRoute], dict[int, Tensor], torch.device], PackedExchange],
    unpack_back: Callable[[StepContext, MeshWork, list[MatrixRoute], dict[int, Tensor]], None],
    sent: Callable[[int], None],
    groups: list[list[int]] | None = None,
) -> list[BackExchange]:
    """Every bucket's exchange out launched at once (after bucket k, ``sent(k)``: its pieces of U are packed
    into its send buffer), then per group of consecutive buckets (``groups``, by default each bucket alone):
    wait for each, compute them together, pack each one's exchange back at once and launch it (left in flight as a
    :class:`BackExchange` that ``unpack_back`` completes; with ``ctx.hold_backs`` packed only, for the engine to
    launch once every rank's directions succeeded), in bucket order on every rank. A group's received pieces and
    its outputs are let go once it is packed. Shared by the owned and the tensor-parallel strategies, which differ
    in what they send, compute and send back."""
    if not buckets:
        return []
    if groups is None:
        groups = [[k] for k in range(len(buckets))]
    device = local(work.entries[0].param).device
    pending_out: list[PendingExchange | None] = []
    with ctx.timer.phase("exchange_out_launch"):
        for k, bucket in enumerate(buckets):
            pending_out.append(launch_out(ctx, work, bucket, device))
            sent(k)
    backs: list[BackExchange] = []
    for group in groups:
        received = []
        for k in group:
            pending, pending_out[k] = pending_out[k], None
            assert pending is not None
            with ctx.timer.phase("exchange_out_wait"):
                received.append(pending.wait())
            del pending
        with ctx.timer.phase("owner_compute"):
            outputs = compute(ctx, work, [buckets[k] for k in group], received, device)
        del received
        for k in group:
            with ctx.timer.phase("exchange_back_launch"):
                routes = active_routes(ctx, work, buckets[k])
                indices = tuple(dict.fromkeys(r.spec.param_index for r in routes))
                back = BackExchange(
                    pack_back(ctx, work, routes, outputs, device),
                    indices,
                    lambda got, routes=routes: unpack_back(ctx, work, routes, got),
                )
                if not ctx.hold_backs:
                    back.start()
                backs.append(back)
        del outputs
    return backs


def computed_together(ctx: StepContext, work: MeshWork, buckets: list[list[int]]) -> list[list[int]] | None:
    """Consecutive buckets whose owned units this rank computes together, so that they can stack
    (:mod:`..stacks`): each group closes once it holds ``units_per_stack`` units that stack; None (each bucket
    alone) where stacks are off. Only the time this rank launches a group's exchanges back changes: every rank
    still launches them in bucket order."""
    if not buckets:
        return None
    limit = units_per_stack(local(work.entries[0].param).device)
    if limit <= 1:
        return None
    groups: list[list[int]] = [[]]
    stacking = 0
    for k, bucket in enumerate(buckets):
        units = owned_units(ctx, work, [bucket])
        groups[-1].append(k)
        stacking += sum(stack_key(ctx, [work.plan.routes[i].spec for i in ids]) is not None for ids in units)
        if stacking >= limit and k + 1 < len(buckets):
            groups.append([])
            stacking = 0
    return groups


def owned_units(ctx: StepContext, work: MeshWork, buckets: list[list[int]]) -> list[list[int]]:
    """The route indices of each unit of ``buckets`` this rank owns and whose parameter takes part in this step,
    units in the order of their first route."""
    me = work.comm.mesh_rank
    members: dict[int, list[int]] = defaultdict(list)
    for bucket in buckets:
        for i in bucket:
            route = work.plan.routes[i]
            if route.spec.param_index in ctx.active and route.owner == me:
                members[route.unit].append(i)
    return list(members.values())


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
    return pack_all_to_all(work.comm, send, recv, work.wire_dtype, device).start()


class CopyRuns:
    """Flat copies ``dst[d : d + n] ← src[s : s + n]``, a run merged with the next when both continue in
    memory (the pieces of consecutive experts): one copy per run instead of one per piece; and copies into
    strided regions (``add_region``), each its own copy. All are issued at :meth:`flush`."""

    def __init__(self) -> None:
        self.runs: list[list] = []
        self.regions: list[tuple[Tensor, Tensor]] = []

    def add(self, dst: Tensor, dst_offset: int, src: Tensor, src_offset: int, n: int) -> None:
        if self.runs:
            last = self.runs[-1]
            if (
                last[0] is dst
                and last[2] is src
                and last[1] + last[4] == dst_offset
                and last[3] + last[4] == src_offset
            ):
                last[4] += n
                return
        self.runs.append([dst, dst_offset, src, src_offset, n])

    def add_region(self, target: Tensor, src: Tensor) -> None:
        """``target`` ← ``src`` (as many elements, flat) at :meth:`flush`."""
        self.regions.append((target, src))

    def flush(self) -> None:
        for target, src in self.regions:
            target.copy_(src.view(target.shape))
        for dst, d, src, s, n in self.runs:
            dst[d : d + n].copy_(src[s : s + n])
        self.runs, self.regions = [], []


def _compute_owned(
    ctx: StepContext,
    work: MeshWork,
    buckets: list[list[int]],
    receiveds: list[dict[int, Tensor]],
    device: torch.device,
) -> dict[int, Tensor]:
    """Assemble each owned unit of ``buckets``, or stack of units (:mod:`..stacks`), from its pieces (``receiveds``:
    per bucket, what each source sent) into one ``[B, m, n]`` buffer, compute it; O per ``id(route)``, in the
    box's shape (views of the call's output, which :func:`exchange_buckets` packs into the exchanges back before
    it computes anything else)."""
    calls = group_into_stacks(
        owned_units(ctx, work, buckets),
        lambda ids: stack_key(ctx, [work.plan.routes[i].spec for i in ids]),
        units_per_stack(device),
    )
    call_ids = [[i for ids in stack for i in ids] for stack in calls]
    call_specs = [[work.plan.routes[i].spec for i in ids] for ids in call_ids]
    inputs = [newton_schulz_input_shape(specs) for specs in call_specs]
    buffers = [ctx.input_buffer(specs, work.wire_dtype, device) for specs in call_specs]
    slot = {i: (c, j) for c, ids in enumerate(call_ids) for j, i in enumerate(ids)}
    copies = [CopyRuns() for _ in call_ids]  # each call's input is assembled just before it computes
    for bucket, received in zip(buckets, receiveds):
        offsets: dict[int, int] = defaultdict(int)
        for i in bucket:  # pieces arrive from each source in route order
            if i not in slot:
                continue
            route = work.plan.routes[i]
            call, position = slot[i]
            buffer, base = buffers[call], position * route.spec.numel
            for box, source in route.pieces:
                n = box_numel(box)
                chunk, start = received[source], offsets[source]
                offsets[source] += n
                at = contiguous_offset(box, route.spec.box)
                if at is not None:
                    copies[call].add(buffer, base + at, chunk, start, n)
                else:
                    whole = buffer[base : base + route.spec.numel].view(box_shape(route.spec.box))
                    copies[call].add_region(whole[relative_slices(box, route.spec.box)], chunk[start : start + n])
    out: dict[int, Tensor] = {}
    for c, (stack, ids, specs, buffer) in enumerate(zip(calls, call_ids, call_specs, buffers)):
        copies[c].flush()
        shape = specs[0].shape
        stacked = buffer.view((len(ids), *shape) if len(ids) > 1 else shape)
        # O may stay the CUDA graph's own buffer where its pieces are packed into the exchanges back before a
        # call of the same signature overwrites it: no later call here has its input's shape, and the backs
        # are packed at once
        borrow = inputs[c] not in inputs[c + 1 :]
        o = ctx.compute_unit(specs, stacked, decide_as=len(stack[0]) if len(stack) > 1 else None, borrow=borrow)
        for j, i in enumerate(ids):
            route = work.plan.routes[i]
            out[id(route)] = (o[j] if len(ids) > 1 else o).reshape(box_shape(route.spec.box))
    return out


def _pack_back(
    ctx: StepContext, work: MeshWork, routes: list[MatrixRoute], updates: dict[int, Tensor], device: torch.device
) -> PackedExchange:
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
    return pack_all_to_all(work.comm, send, recv, work.wire_dtype, device, launched_later=ctx.hold_backs)


def _unpack_back(ctx: StepContext, work: MeshWork, routes: list[MatrixRoute], received: dict[int, Tensor]) -> None:
    """Copy one bucket's received update pieces into the per-parameter update buffers (runs of pieces that
    continue each other in both as one copy)."""
    me = work.comm.mesh_rank
    offsets: dict[int, int] = defaultdict(int)
    flat: dict[int, Tensor] = {}
    runs = CopyRuns()
    for route in routes:
        e = ctx.entries[route.spec.param_index]
        for holder, box in route.holders:
            if holder != me:
                continue
            n = box_numel(box)
            chunk, start = received[route.owner], offsets[route.owner]
            offsets[route.owner] += n
            update = ctx.updates[e.index]
            at = contiguous_offset(box, e.layout.local_box) if update.is_contiguous() else None
            if at is not None:
                if e.index not in flat:
                    flat[e.index] = update.view(-1)
                runs.add(flat[e.index], at, chunk, start, n)
            else:
                target = update[relative_slices(box, e.layout.local_box)]
                target.copy_(chunk[start : start + n].view(target.shape))
    runs.flush()
