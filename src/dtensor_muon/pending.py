"""Updates of a step that are computed or in flight but not yet applied to the parameters.

For each Muon parameter the step leaves θ ← θ·(1 − γλ) − γ'·O to do, with γ, λ and γ' captured when the
step ran (a learning-rate scheduler stepping in between changes nothing). A parameter's O is complete
once the return exchanges of every bucket holding one of its matrices are unpacked; :meth:`finish` waits
for exactly those, then applies.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .exchange import PendingExchange

if TYPE_CHECKING:
    from .engine import Engine, MeshWork, StepScratch


@dataclass
class BackExchange:
    """One bucket's return all-to-all, in flight until unpacked."""

    work: MeshWork
    bucket: list[int]
    exchange: PendingExchange
    unpacked: bool = False


class PendingUpdates:
    """The not-yet-applied Muon updates of one step (see module docstring)."""

    def __init__(
        self,
        engine: Engine,
        scratch: StepScratch,
        active: set[int],
        backs: list[BackExchange],
        hyperparameters: dict[int, tuple[float, float, float]],
    ) -> None:
        self.engine = engine
        self.scratch = scratch
        self.active = active
        self.hyperparameters = hyperparameters
        self.remaining = dict.fromkeys(hyperparameters)  # ordered: entry order
        self.backs_of: dict[int, list[BackExchange]] = defaultdict(list)
        for back in backs:
            for i in dict.fromkeys(back.work.plan.routes[m].spec.param_index for m in back.bucket):
                self.backs_of[i].append(back)
        self.seconds = 0.0

    def finish(self, indices: Any) -> None:
        """Wait for, unpack and apply the updates of these parameters (skipping those already applied)."""
        start = time.perf_counter()
        for index in indices:
            if index not in self.remaining:
                continue
            for back in self.backs_of.get(index, []):
                if not back.unpacked:
                    received = back.exchange.wait()
                    self.engine.unpack_back(back.work, back.bucket, received, self.scratch, self.active)
                    back.unpacked = True
            lr, weight_decay, adjusted = self.hyperparameters[index]
            self.engine.apply_one(index, self.scratch.updates_out[index], lr, weight_decay, adjusted)
            del self.remaining[index]
        self.seconds += time.perf_counter() - start

    def finish_all(self) -> None:
        """Apply every remaining update."""
        self.finish(list(self.remaining))

    @property
    def done(self) -> bool:
        return not self.remaining
