"""Updates of a step that are computed or in flight but not yet applied to the parameters.

For each matrix-rule parameter the step leaves θ ← θ·(1 − γλ) − γ'·O to do, with γ, λ and γ' captured when
the step ran (a learning-rate scheduler stepping in between changes nothing). A parameter's O is complete
once the return exchanges of every bucket holding one of its matrices are unpacked; :meth:`finish` waits
for exactly those, then applies.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import Tensor

from ..distributed.exchange import PackedExchange, PendingExchange


@dataclass
class BackExchange:
    """One bucket's return exchange: ``packed`` is its send buffer, :meth:`start` launches it, ``unpack`` copies
    what it received.

    What each stage no longer needs is let go at once: the packed send buffer when the exchange starts (the
    collective holds it until it has been sent), the exchange (its receive buffer) once unpacked, so that with
    overlap a step's received pieces do not stay allocated through the next forward."""

    packed: PackedExchange | None
    param_indices: tuple[int, ...]
    unpack: Callable[[dict[int, Tensor]], None]
    exchange: PendingExchange | None = None
    unpacked: bool = False

    def start(self) -> None:
        """Launch the exchange (once)."""
        if self.exchange is None and self.packed is not None:
            self.exchange = self.packed.start()
            self.packed = None

    def receive(self) -> None:
        """Wait for the exchange and unpack it (once), then drop its buffers."""
        if self.unpacked:
            return
        self.start()
        assert self.exchange is not None
        self.unpack(self.exchange.wait())
        self.exchange = None
        self.unpacked = True


class PendingUpdates:
    """The not-yet-applied updates of one step: ``apply(indices)`` applies those parameters' updates."""

    def __init__(self, indices: Iterable[int], backs: list[BackExchange], apply: Callable[[list[int]], None]) -> None:
        self.apply = apply
        self.remaining = dict.fromkeys(indices)  # ordered: entry order
        self.backs_of: dict[int, list[BackExchange]] = defaultdict(list)
        for back in backs:
            for i in back.param_indices:
                self.backs_of[i].append(back)
        self.seconds = 0.0

    def finish(self, indices: Iterable[int]) -> bool:
        """Wait for and unpack the updates of these parameters (skipping those already applied), then apply
        them at once; whether any was applied."""
        start = time.perf_counter()
        ready = list(dict.fromkeys(i for i in indices if i in self.remaining))
        for index in ready:
            for back in self.backs_of.get(index, []):
                back.receive()
        if ready:
            self.apply(ready)
        for index in ready:
            del self.remaining[index]
        self.seconds += time.perf_counter() - start
        return bool(ready)

    def finish_all(self) -> None:
        """Apply every remaining update."""
        self.finish(list(self.remaining))

    @property
    def done(self) -> bool:
        return not self.remaining
