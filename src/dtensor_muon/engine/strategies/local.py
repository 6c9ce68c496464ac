"""Strategy for :class:`~dtensor_muon.plan.placement.Local` units: each holder computes its whole matrices itself.

Matrices of fully local parameters are applied as soon as they are computed (at the step's commit when other
ranks could still fail), and such a parameter's U lives only until its last matrix is done, so on one process
peak memory is about the largest parameter's U and one call's working buffers, not the model. A unit that is
one matrix or a run of whole experts is one view of the shard: it is read, computed and written back as one
``[B, m, n]`` tensor, with no per-matrix operation; so is a stack of such units of one parameter that one view
holds, where :mod:`..stacks` allows one. Units of parameters that hold only a few stackable units here (at most
:data:`~dtensor_muon.kernels.batching.GATHER_MAX_UNITS`: experts spread thin over many ranks) stack across
parameters instead: their views are copied into one input, every parameter's U the stack spans stays alive until
its last unit is done, and each unit's O goes back to its own parameter.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

from ...distributed.layout import Box, local, relative_slices, stacked_box
from ...kernels.batching import group_into_stacks, holder_stack_keys, units_per_stack
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
    params = [specs[0].param_index for specs in unit_specs]
    own_keys = [stack_key(ctx, specs) for specs in unit_specs]
    keys = holder_stack_keys(params, own_keys)

    def one_view(stack: list[int], k: int) -> bool:  # the stack and unit k: one run of experts of one parameter
        return params[stack[-1]] == params[k] and continues(blocks[stack[-1]], blocks[k])

    def joins(stack: list[int], k: int) -> bool:  # a unit whose key is its own stacks with other parameters'
        return keys[k] == own_keys[k] or one_view(stack, k)

    def shard_input(index: int) -> Tensor:
        if index not in work.fully_local:
            return ctx.inputs[index]
        if index not in inputs:
            inputs[index] = ctx.prepare(ctx.entries[index])
        return inputs[index]

    limit = units_per_stack(local(ctx.entries[params[0]].param).device)
    with ctx.timer.phase("local_compute"):
        for stack in group_into_stacks(range(len(units)), keys.__getitem__, limit, joins):
            runs = one_view_runs(stack, one_view)
            decide_as = len(units[stack[0]]) if len(stack) > 1 else None
            if len(runs) > 1:
                gathered = [
                    (
                        ctx.entries[params[run[0]]],
                        [spec for k in run for spec in unit_specs[k]],
                        shard_input(params[run[0]]),
                        run_block(run, blocks),
                    )
                    for run in runs
                ]
                _compute_gathered(ctx, work, gathered, decide_as)
            else:
                specs = [spec for k in stack for spec in unit_specs[k]]
                e = ctx.entries[params[stack[0]]]
                u = shard_input(e.index)
                block = run_block(stack, blocks)
                if block is not None:  # one view of the unit (or stack), one write of its O
                    _compute_block(ctx, work, e, specs, u, block, decide_as)
                else:
                    _compute_pieces(ctx, work, e, specs, u)
            for k in stack:
                if params[k] in work.fully_local:
                    left[params[k]] -= len(unit_specs[k])
                    if left[params[k]] == 0:
                        del inputs[params[k]]
    return []


def one_view_runs(stack: list[int], one_view: Callable[[list[int], int], bool]) -> list[list[int]]:
    """``stack`` split into its runs: the longest stretches of units that ``one_view`` joins to the one before."""
    runs = [[stack[0]]]
    for k in stack[1:]:
        if one_view(runs[-1], k):
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def run_block(run: list[int], blocks: list[Box | None]) -> Box | None:
    """The box of the local shard a run of units fills (:func:`one_view_runs`): the first unit's own box, or from
    the first unit's first expert to the last unit's last."""
    first, last = blocks[run[0]], blocks[run[-1]]
    if len(run) == 1 or first is None or last is None:
        return first
    return ((first[0][0], last[0][1]), *first[1:])


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


def _compute_gathered(
    ctx: StepContext,
    work: MeshWork,
    runs: list[tuple[Entry, list[MatrixSpec], Tensor, Box | None]],
    decide_as: int | None,
) -> None:
    """A stack of units from several runs (of several parameters, :func:`.batching.holder_stack_keys`): each run's
    view of its parameter's U (``(e, specs, u, box)``; a run that no one view holds, matrix by matrix) copied into
    one ``[N, m, n]`` input (:meth:`StepContext.input_buffer`), computed in one call with the dispatch deciding as
    for one unit, and each run's O delivered to its own parameter. ``decide_as``: matrices per unit."""
    shape = runs[0][1][0].shape
    views: list[Tensor] = []
    for e, specs, u, block in runs:
        boxes = [block] if block is not None else [spec.box for spec in specs]
        views.extend(u[relative_slices(box, e.layout.local_box)].reshape(-1, *shape) for box in boxes)
    specs_all = [spec for _, specs, _, _ in runs for spec in specs]
    stacked = ctx.input_buffer(specs_all, views[0].dtype, views[0].device).view(len(specs_all), *shape)
    out = ctx.compute_unit(specs_all, torch.cat(views, out=stacked), decide_as)
    offset = 0
    for e, specs, _, block in runs:
        o, offset = out[offset : offset + len(specs)], offset + len(specs)
        if block is not None:
            _deliver(ctx, work, e, relative_slices(block, e.layout.local_box), o, shape)
        else:
            for spec, o_matrix in zip(specs, o):
                _deliver(ctx, work, e, relative_slices(spec.box, e.layout.local_box), o_matrix, spec.whole_shape)


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
