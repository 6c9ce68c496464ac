"""Learning-rate transfer across global batch sizes: the square-root rule.

An lr tuned at a global batch of B_ref tokens (or sequences of one length) moves to a batch of B as

    γ(B) = γ(B_ref) · √(B / B_ref)

the rule NVIDIA's study of SOAP and Muon at scale uses when it changes the batch (a larger batch averages
away gradient noise, so a larger step stays stable; for Adam-type and orthogonalized updates the step grows
with the square root, not linearly). It is a starting point for a new batch size, not a substitute for a
sweep at it, and it holds below the critical batch size, past which a larger batch buys no larger step.

Mixture-of-experts layers: each expert sees about B·k/N of the B tokens (top-k routing over N experts), so
its gradient is noisier than the dense matrices' at the same B. The rule's ratio is the same for both as
long as k and N stay fixed; it does not transfer an lr across a change of k or N.
"""

from __future__ import annotations

import math


def batch_scaled_lr(lr: float, batch_size: float, reference_batch_size: float) -> float:
    """γ·√(B / B_ref): the lr for a global batch of ``batch_size`` from ``lr`` tuned at ``reference_batch_size``
    (both in the same unit: tokens, or sequences of one length). Raises ValueError for a non-positive batch
    or a negative lr."""
    for label, value in (("batch_size", batch_size), ("reference_batch_size", reference_batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"batch_scaled_lr: {label} must be a number > 0, got {value!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
        raise ValueError(f"batch_scaled_lr: lr must be a number >= 0, got {lr!r}")
    return lr * math.sqrt(batch_size / reference_batch_size)
