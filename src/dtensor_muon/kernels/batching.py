"""Which matrices the direction step stacks into one batched call: only small ones, where batching pays.

A batch of small matrices shares its launches, which bound each matrix's Newton–Schulz; a large matrix keeps
the GPU busy alone, and stacking it gains nothing. Stack a shape only when it has at most
:data:`BATCH_MAX_NUMEL` elements, and at most :data:`MAX_BATCH` matrices in one batch.
Chosen by measurement: docs/kernels.md "Batching small matrices" (re-measure: tools/kernels/ns_variants.py).
"""

from __future__ import annotations

BATCH_MAX_NUMEL = 2048 * 7168
"""Largest matrix (elements) that is stacked with others of its shape (Kimi K2's 2048×7168 experts)."""

MAX_BATCH = 8
"""Most matrices in one batch: the gain per matrix flattens there, and smaller units balance better across
ranks (docs/kernels.md "Batching small matrices"; re-measure the balance: ``python -m dtensor_muon.plan``)."""


def batching_pays(shape: tuple[int, int]) -> bool:
    """Whether matrices of ``shape`` are computed in batches (see the module docstring)."""
    return shape[0] * shape[1] <= BATCH_MAX_NUMEL
