"""Strategy for :class:`~dtensor_muon.plan.placement.Local` units: each holder computes its whole matrices itself.

Units are processed in chunks of at most ``bucket_bytes`` of direction input. Matrices of fully local
parameters are applied as soon as they are computed (at the step's commit when other ranks could still
fail), and such a parameter's U lives only until its last matrix is done, so on one process peak memory is
about one chunk, not the model. A unit that is one matrix or a run of whole experts is one view of the
shard: it is read, computed and written back as one ``[B, m, n]`` tensor, with no per-matrix operation.
"""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor

from ...distributed.layout import Box, local, relative_slices, stacked_box
from ...plan import MatrixSpec, chunk_by_budget
from ...plan.placement import Local
from ..context import Entry, MeshWork, StepContext
from ..pending import BackExchange


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

    def unit_bytes(members: list[int]) -> int:
        return sum(plan.routes[i].spec.numel * ctx.input_itemsize(plan.routes[i].spec) for i in members)

    with ctx.timer.phase("local_compute"):
        for chunk in chunk_by_budget(units, ctx.bucket_bytes, unit_bytes):
            for members in chunk:
                specs = [plan.routes[i].spec for i in members]
                e = ctx.entries[specs[0].param_index]
                if e.index in work.fully_local:
                    if e.index not in inputs:
                        inputs[e.index] = ctx.prepare(e)
                    u = inputs[e.index]
                else:
                    u = ctx.inputs[e.index]
                block = stacked_box([spec.box for spec in specs]) if len(specs) > 1 else specs[0].box
                if block is not None:  # one view of the unit, one write of its O
                    _compute_block(ctx, work, e, specs, u, block)
                else:
                    _compute_pieces(ctx, work, e, specs, u)
                if e.index in work.fully_local:
                    left[e.index] -= len(specs)
                    if left[e.index] == 0:
                        del inputs[e.index]
    return []


def _compute_block(ctx: StepContext, work: MeshWork, e: Entry, specs: list[MatrixSpec], u: Tensor, block: Box) -> None:
    """A unit whose matrices fill ``block`` of the local shard (one matrix, or a run of whole experts)."""
    sl = relative_slices(block, e.layout.local_box)
    shape = specs[0].shape
    stacked = u[sl].reshape((len(specs), *shape) if len(specs) > 1 else shape).contiguous()
    if e.index in work.fully_local and not ctx.transactional:  # applied before the next unit is computed
        ctx.compute_and_apply(e, specs, stacked, local(e.param)[sl])
    else:
        _deliver(ctx, work, e, sl, ctx.compute_unit(specs, stacked), shape)


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
