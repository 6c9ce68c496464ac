"""Which matrices the direction step stacks into one batched call: only small ones, where batching pays.

Measured on the H200 (bf16 Newton–Schulz, 5 steps, each call replayed from its CUDA graph as the optimizer
runs it), eight matrices batched vs one by one: 512×4096 0.42 vs 2.86 ms, 1024×4096 0.87 vs 2.88, 2048×1408
1.02 vs 3.10, 2048² 2.36 vs 3.14, 2048×4096 3.55 vs 4.62, four 2048×7168 (Kimi K2's experts) 2.65 vs 3.33,
but 4096² 17.84 vs 17.89 and four 4096×14336 18.70 vs 18.70: batching pays up to 2048×7168, not beyond.
Stack a shape only when it has at most :data:`BATCH_MAX_NUMEL` elements
(re-measure: ``python tools/kernels/ns_variants.py --shapes 8x1024x4096 --methods graphs,graphs:loop=1``).
"""

from __future__ import annotations

BATCH_MAX_NUMEL = 2048 * 7168
"""Largest matrix (elements) that is stacked with others of its shape (4×2048×7168: 2.65 vs 3.33 ms one by one)."""

MAX_BATCH = 8
"""Most matrices in one batch: the gain flattens there (sixteen 1024×4096 take 1.66 ms batched, eight 0.87: the
same per matrix; sixteen 768×2048 in Gram form 0.761 ms, eight 0.394: 3.5% less per matrix; eight 2048×7168
5.02 ms, four 2.65: 5%), and smaller units balance better across ranks. Qwen3-30B-A3B (48 layers, 128 experts),
busiest rank over the mean (``python -m dtensor_muon.plan --model qwen3:30B-A3B --world-size 64 256 512
[--ep 8]``): units of 8 experts 1.000 / 1.029 / 1.029 under FSDP and 1.022 / 1.118 / 1.414 with EP 8; units of
16 (half the launches) 1.019 / 1.029 / 1.234 and 1.022 / 1.221 / 1.619."""


def batching_pays(shape: tuple[int, int]) -> bool:
    """Whether matrices of ``shape`` are computed in batches (see the module docstring)."""
    return shape[0] * shape[1] <= BATCH_MAX_NUMEL
