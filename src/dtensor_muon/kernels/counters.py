"""Ticket counters of the kernels that end in a per-matrix sum without a second launch (no Triton needed).

Such a kernel's programs each store their block's partial sum, then take a ticket from their matrix's counter
(an atomic add with acquire-release order); the program that draws the last ticket sums the matrix's partial
sums in a fixed order and sets the counter back to zero (:func:`.ordered_sum.store_partial_and_total`).
"""

from __future__ import annotations

import torch
from torch import Tensor

_COUNTERS: dict[tuple[torch.device, int], Tensor] = {}


def ticket_counters(device: torch.device, matrices: int) -> Tensor:
    """Zeroed int32 ticket counters for ``matrices`` matrices on ``device``, one set per stream (launches on
    one stream run in order, so they never share a counter at the same time); every launch leaves them zero."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < matrices:
        counters = _COUNTERS[key] = torch.zeros(max(matrices, 64), dtype=torch.int32, device=device)
    return counters
