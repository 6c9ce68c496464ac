"""Strategy for :class:`~dtensor_muon.plan.placement.GatherAll` units: every rank gathers and computes everything.

The baseline other libraries use (``full_tensor()`` of U on every rank, every matrix computed on every
rank): exact, with the whole model's direction work duplicated on each rank.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor

from ...distributed.layout import box_shape, box_slices, intersect, relative_slices
from ...plan.placement import GatherAll
from ..context import MeshWork, StepContext
from ..pending import BackExchange


def run(ctx: StepContext, work: MeshWork) -> list[BackExchange]:
    """Gather U of every parameter with a gather-all unit, compute those units, keep this rank's parts."""
    plan = work.plan
    units = []
    for u in plan.units_placed(GatherAll):
        members = [i for i in plan.units[u].members if plan.routes[i].spec.param_index in ctx.active]
        if members:
            units.append(members)
    if not units:
        return []
    fulls: dict[int, Tensor] = {}
    with ctx.timer.phase("gather_all"):
        for members in units:
            for i in members:
                e = ctx.entries[plan.routes[i].spec.param_index]
                if e.index in fulls:
                    continue
                u = ctx.inputs[e.index]
                fulls[e.index] = DTensor.from_local(
                    u,
                    e.param.device_mesh,
                    e.param.placements,
                    run_check=False,
                    shape=e.param.shape,
                    stride=e.param.stride(),
                ).full_tensor()
                ctx.stats.bytes_sent += u.numel() * u.element_size() * (work.comm.world_size - 1)
    with ctx.timer.phase("owner_compute"):
        for members in units:
            jobs = [
                (plan.routes[i].spec, fulls[plan.routes[i].spec.param_index][box_slices(plan.routes[i].spec.box)])
                for i in members
            ]
            for (spec, _), o in zip(jobs, ctx.compute(jobs)):
                e = ctx.entries[spec.param_index]
                part = intersect(spec.box, e.layout.local_box)
                if part is None:
                    continue
                whole = o.reshape(box_shape(spec.box))
                ctx.updates[e.index][relative_slices(part, e.layout.local_box)].copy_(
                    whole[relative_slices(part, spec.box)]
                )
    return []
