"""Chooses the Newton–Schulz product backend for a given input (shape, dtype, device).

Triton SYRK kernels (:mod:`.triton_matmuls`) where they win: a CUDA device of compute capability 8.0 or
newer, bf16/fp16, Triton importable, and enough lower-triangle tiles to fill the GPU. Plain torch
matmuls (:mod:`.torch_matmuls`) everywhere else: CPU, fp32, old GPUs, small matrices. Both compute the
same products; they differ only by fp32 accumulation order, i.e. within bf16 rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from .torch_matmuls import TORCH_MATMULS

try:
    from .triton_matmuls import TRITON_MATMULS
except ImportError:  # no triton
    TRITON_MATMULS = None

# Smallest Gram side for the SYRK path, and fewest 128×128 lower-triangle tiles (all matrices of a batch
# together) to fill the GPU: below these the plain products are as fast (measured on the H200).
MIN_SYRK_DIM = 2048
MIN_SYRK_TILES = 264

_forced: list[str] = []


class Backend(Protocol):
    """The three Newton–Schulz products (see :class:`.torch_matmuls.TorchMatmuls`)."""

    name: str

    def gram(self, x: Tensor) -> Tensor: ...

    def gram_poly(self, a: Tensor, b: float, c: float) -> Tensor: ...

    def combine(self, x: Tensor, bmat: Tensor, a: float) -> Tensor: ...


def triton_eligible(x: Tensor) -> bool:
    """Whether the Triton backend can run on ``x`` at all (device, dtype, Triton present)."""
    return (
        TRITON_MATMULS is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def _syrk_tiles(x: Tensor) -> int:
    tiles = -(-x.size(-2) // 128)
    batch = x.size(0) if x.ndim == 3 else 1
    return batch * tiles * (tiles + 1) // 2


def select_backend(x: Tensor) -> Backend:
    """Backend for the (already transposed to wide) working matrix ``x`` of shape [m, n] or [B, m, n]."""
    if _forced:
        forced = _forced[-1]
        if forced == "triton" and triton_eligible(x):
            return TRITON_MATMULS
        return TORCH_MATMULS
    if (
        triton_eligible(x)
        and x.size(-2) >= MIN_SYRK_DIM
        and _syrk_tiles(x) >= MIN_SYRK_TILES
    ):
        return TRITON_MATMULS
    return TORCH_MATMULS


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, ``select_backend`` returns the named backend ("torch" or "triton"); "triton"
    still falls back to torch where it cannot run (CPU, fp32, no Triton)."""
    if name not in ("torch", "triton"):
        raise ValueError(f"use_backend: expected 'torch' or 'triton', got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()
