"""One strategy per compute placement; the engine runs them in this order on each mesh's plan.

Each strategy is ``run(ctx, work) -> list[BackExchange]``: it computes the units of its placement that
concern this rank and returns the return exchanges it leaves in flight (none for local and gather-all).
"""

from __future__ import annotations

from collections.abc import Callable

from ..context import MeshWork, StepContext
from ..pending import BackExchange
from . import gather_all, local, owned, tensor_parallel

Strategy = Callable[[StepContext, MeshWork], list[BackExchange]]

STRATEGIES: tuple[Strategy, ...] = (local.run, gather_all.run, owned.run, tensor_parallel.run)
"""Local first (no communication), then the baseline, then owned units with their exchanges, then the units
of tensor-parallel groups."""
