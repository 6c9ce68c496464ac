"""Diagnostics of one optimizer step, as a flat ``dict[str, float]`` ready for a logger.

Keys (all rank-local, no extra collective):
- ``muon/time_<phase>_ms``: host wall time of each phase of the step;
- ``muon/bytes_sent``: bytes this rank put on the wire (exchange out + back);
- ``muon/plan_imbalance``: max/mean of per-rank Newton–Schulz FLOPs of the plan (worst mesh);
- ``muon/plan_max_gflop``: the busiest rank's Newton–Schulz GFLOP per step (worst mesh, per iteration × 1);
- ``muon/update_rms/muon``: RMS of γ'·O over the matrices this rank orthogonalized;
- ``muon/update_rms/adamw``: RMS of the AdamW parameter change on this rank (diagnostic steps only);
- ``muon/orthogonality_error``: max |σ − 1| of one Newton–Schulz output (diagnostic steps only);
- ``muon/skipped_steps``: steps skipped so far because a gradient was not finite.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from .plan import Plan


class PhaseTimer:
    """Accumulates wall time per named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


class StepStats:
    """Running sums for update RMS and bytes; one orthogonality sample on diagnostic steps."""

    def __init__(self, sample_orthogonality: bool = False) -> None:
        self.sample_orthogonality = sample_orthogonality
        self.orthogonality_error: float | None = None
        self.bytes_sent = 0
        self.sq_sum: dict[str, Tensor | float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)

    def add_update(self, kind: str, update: Tensor, scale: float = 1.0) -> None:
        """Add an applied update ``scale·update`` to the RMS of ``kind`` (on-device sum: no sync here)."""
        norm = torch.linalg.vector_norm(update, dtype=torch.float32)
        self.sq_sum[kind] = self.sq_sum[kind] + (norm * scale) ** 2
        self.count[kind] += update.numel()

    def add_orthogonal(self, o: Tensor, lr_adjusted: float) -> None:
        """Add one Newton–Schulz output; on diagnostic steps the first one also gives max |σ − 1|."""
        self.add_update("muon", o, lr_adjusted)
        if self.sample_orthogonality and self.orthogonality_error is None:
            sigma = torch.linalg.svdvals(o.detach().to(torch.float64))
            self.orthogonality_error = float((sigma - 1).abs().max())


def summarize(timer: PhaseTimer, stats: StepStats, plans: list[Plan], skipped_steps: int) -> dict[str, float]:
    """The flat metrics dict of a step."""
    out = {f"muon/time_{name}_ms": 1e3 * s for name, s in timer.seconds.items()}
    out["muon/time_step_ms"] = 1e3 * sum(timer.seconds.values())
    out["muon/bytes_sent"] = float(stats.bytes_sent)
    out["muon/skipped_steps"] = float(skipped_steps)
    if plans:
        out["muon/plan_imbalance"] = max(p.imbalance for p in plans)
        out["muon/plan_max_gflop"] = max(max(p.rank_flops) for p in plans) / 1e9
    for kind, total in stats.sq_sum.items():
        out[f"muon/update_rms/{kind}"] = (float(total) / max(1, stats.count[kind])) ** 0.5
    if stats.orthogonality_error is not None:
        out["muon/orthogonality_error"] = stats.orthogonality_error
    return out
