"""Strategy for :class:`~dtensor_muon.plan.placement.Local` units: each holder computes its whole matrices itself.

Matrices of fully local parameters are applied as soon as they are computed (at the step's commit when other
ranks could still fail), and such a parameter's U lives only until its last matrix is done, so on one process
peak memory is about the largest parameter's U and one call's working buffers, not the model. A unit that is
one matrix or a run of whole experts is one view of the shard: it is read, computed and written back as one
``[B, m, n]`` tensor, with no per-matrix operation; so is a stack of such units of one parameter that one view
holds, where :mod:`..stacks` allows one.
"""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor

from ...distributed.layout import Box, local, relative_slices, stacked_box
from ...kernels.batching import group_into_stacks, units_per_stack
from ...plan import MatrixSpec
from ...plan.placement import Local
from ..context import Entry, MeshWork, StepContext
from ..pending import BackExchange
from ..stacks import stack_key


def run(ctx: StepContext, work: MeshWork) -> list[BackExchange]:
    """Compute this rank's local units (see the module docstring); nothing is left in flight."""
    plan, me = work.plan, work.comm.mesh_rank
    units = []
    for u in plan.units_placed(Local):
        members = [i for i in plan.units[u].members if plan.routes[i].spec.param_index in ctx.active]
        if members and any(rank == me for rank, _ in plan.routes[members[0]].holders):
            units.append(members)
    if not units:
        return []
    left: dict[int, int] = defaultdict(int)
    for members in units:
        for i in members:
            left[plan.routes[i].spec.param_index] += 1
    inputs: dict[int, Tensor] = {}  # U of fully local parameters, while some of their matrices are left
    unit_specs = [[plan.routes[i].spec for i in members] for members in units]
    blocks = [unit_block(specs) for specs in unit_specs]

    def one_view(stack: list[int], k: int) -> bool:  # the stack and unit k: one run of experts of one parameter
        last, unit = blocks[stack[-1]], blocks[k]
        return unit_specs[stack[-1]][0].param_index == unit_specs[k][0].param_index and continues(last, unit)

    limit = units_per_stack(local(ctx.entries[unit_specs[0][0].param_index].param).device)
    with ctx.timer.phase("local_compute"):
        for stack in group_into_stacks(range(len(units)), lambda k: stack_key(ctx, unit_specs[k]), limit, one_view):
            specs = [spec for k in stack for spec in unit_specs[k]]
            e = ctx.entries[specs[0].param_index]
            if e.index in work.fully_local:
                if e.index not in inputs:
                    inputs[e.index] = ctx.prepare(e)
                u = inputs[e.index]
            else:
                u = ctx.inputs[e.index]
            first, last = blocks[stack[0]], blocks[stack[-1]]
            block = first if len(stack) == 1 else ((first[0][0], last[0][1]), *first[1:])  # type: ignore[index]
            decide_as = len(units[stack[0]]) if len(stack) > 1 else None
            if block is not None:  # one view of the unit (or stack), one write of its O
                _compute_block(ctx, work, e, specs, u, block, decide_as)
            else:
                _compute_pieces(ctx, work, e, specs, u)
            if e.index in work.fully_local:
                left[e.index] -= len(specs)
                if left[e.index] == 0:
                    del inputs[e.index]
    return []


def unit_block(specs: list[MatrixSpec]) -> Box | None:
    """The box of the local shard a unit fills, when one view holds it: its one matrix's box, or the run of whole
    experts its matrices are (:func:`stacked_box`); None otherwise."""
    return stacked_box([spec.box for spec in specs]) if len(specs) > 1 else specs[0].box


def continues(before: Box | None, after: Box | None) -> bool:
    """Whether the runs of experts ``before`` and ``after`` are one run, ``after`` right behind ``before``:
    what :func:`stacked_box` asks of consecutive experts, for two runs."""
    return (
        before is not None
        and after is not None
        and len(before) >= 3
        and before[1:] == after[1:]
        and before[0][1] == after[0][0]
    )


def _compute_block(
    ctx: StepContext,
    work: MeshWork,
    e: Entry,
    specs: list[MatrixSpec],
    u: Tensor,
    block: Box,
    decide_as: int | None,
) -> None:
    """A unit whose matrices fill ``block`` of the local shard (one matrix, or a run of whole experts), or a stack
    of such units (``decide_as``: matrices per unit, :mod:`..stacks`)."""
    sl = relative_slices(block, e.layout.local_box)
    shape = specs[0].shape
    stacked = u[sl].reshape((len(specs), *shape) if len(specs) > 1 else shape).contiguous()
    if e.index in work.fully_local and not ctx.transactional:  # applied before the next unit is computed
        ctx.compute_and_apply(e, specs, stacked, local(e.param)[sl], decide_as)
    else:
        _deliver(ctx, work, e, sl, ctx.compute_unit(specs, stacked, decide_as), shape)


def _compute_pieces(ctx: StepContext, work: MeshWork, e: Entry, specs: list[MatrixSpec], u: Tensor) -> None:
    """A unit of matrices that no one view of the local shard holds (views of a fused parameter)."""
    slices = [relative_slices(spec.box, e.layout.local_box) for spec in specs]
    for spec, sl, o in zip(specs, slices, ctx.compute([(spec, u[sl]) for spec, sl in zip(specs, slices)])):
        _deliver(ctx, work, e, sl, o, spec.whole_shape)


def _deliver(
    ctx: StepContext, work: MeshWork, e: Entry, sl: tuple[slice, ...], o: Tensor, shape: tuple[int, int]
) -> None:
    """O of the region ``sl`` of the local shard: applied to a fully local parameter, else into its update buffer."""
    if e.index in work.fully_local:
        ctx.apply_local(e, local(e.param)[sl], o, shape)
    else:
        target = ctx.updates[e.index][sl]
        target.copy_(o.reshape(target.shape))
