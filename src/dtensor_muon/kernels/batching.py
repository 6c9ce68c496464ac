"""Which matrices the direction step stacks into one batched call: only small ones, where batching pays.

Measured on the H200 (bf16 Newton–Schulz, 5 steps): eight 1024×4096 matrices take 0.85 ms batched and 4.87 ms
one by one, while batching is slower for large ones (8×14336×4096: 40.5 vs 36.7 ms; 32×4096²: 78.4 vs 73.1):
stack a shape only when it has at most :data:`BATCH_MAX_NUMEL` elements
(re-measure: ``python tools/kernels/ns_variants.py --shapes 8x1024x4096 --methods graphs,graphs:loop=1``).
"""

from __future__ import annotations

BATCH_MAX_NUMEL = 1024 * 4096
"""Largest matrix (elements) that is stacked with others of its shape."""

MAX_BATCH = 32
"""Most matrices in one batch (bounds the owner's temporary memory)."""


def batching_pays(shape: tuple[int, int]) -> bool:
    """Whether matrices of ``shape`` are computed in batches (see the module docstring)."""
    return shape[0] * shape[1] <= BATCH_MAX_NUMEL
