"""Strategy for :class:`~dtensor_muon.placement.Local` units: each holder computes its whole matrices itself.

Units are processed in chunks of at most ``bucket_bytes`` of direction input. Matrices of fully local
parameters are applied as soon as they are computed, and such a parameter's U lives only until its last
matrix is done, so peak memory is about one chunk, not the model.
"""

from __future__ import annotations

from collections import defaultdict

from torch import Tensor

from ..layout import relative_slices
from ..pending import BackExchange
from ..placement import Local
from ..plan import chunk_by_budget
from ..step_context import MeshWork, StepContext, local


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
                jobs = []
                for i in members:
                    spec = plan.routes[i].spec
                    e = ctx.entries[spec.param_index]
                    if e.index in work.fully_local:
                        if e.index not in inputs:
                            inputs[e.index] = ctx.prepare(e)
                        u = inputs[e.index]
                    else:
                        u = ctx.inputs[e.index]
                    jobs.append((spec, u[relative_slices(spec.box, e.layout.local_box)]))
                for (spec, _), o in zip(jobs, ctx.compute(jobs)):
                    e = ctx.entries[spec.param_index]
                    sl = relative_slices(spec.box, e.layout.local_box)
                    if e.index in work.fully_local:
                        ctx.apply_local(e, local(e.param)[sl], o, spec.shape)
                        left[e.index] -= 1
                        if left[e.index] == 0:
                            del inputs[e.index]
                    else:
                        target = ctx.updates[e.index][sl]
                        target.copy_(o.reshape(target.shape))
    return []
