"""Chooses the Newton–Schulz backend for a given input (dtype, device).

The GPU backend (:mod:`.triton_matmuls`: Triton SYRK kernels where they pay, cuBLAS elsewhere) on a CUDA
device of compute capability 8.0 or newer, for bf16/fp16, when Triton imports and the matrices are large
enough to keep the GPU busy. Plain torch matmuls
(:mod:`.torch_matmuls`, bitwise torch.optim.Muon) everywhere else: CPU, fp32, old GPUs. Both compute the
same iteration; they differ by fp32 accumulation order and one bf16 rounding of a·I + B, i.e. within bf16
rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import Tensor

from .torch_matmuls import TORCH_MATMULS

try:
    from .triton_matmuls import SYRK_MATMULS, TRITON_MATMULS
except ImportError:  # no triton
    SYRK_MATMULS = TRITON_MATMULS = None

BACKEND_NAMES = ("torch", "triton", "syrk")
MIN_GPU_BACKEND_WORK = 2**33
_forced: list[str] = []


class Backend(Protocol):
    """One Newton–Schulz iteration X' = a·X + (b·A + c·A·A)·X, A = X·Xᵀ, on [m, n] or [B, m, n]."""

    name: str

    def iteration(self, x: Tensor, a: float, b: float, c: float) -> Tensor: ...


def triton_eligible(x: Tensor) -> bool:
    """Whether the Triton backend can run on ``x`` at all (device, dtype, Triton present)."""
    return (
        TRITON_MATMULS is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def gram_work(x: Tensor) -> int:
    """B·m²·n multiply-adds of one Gram matrix of ``x`` ([m, n] or [B, m, n])."""
    batch = x.size(0) if x.ndim == 3 else 1
    return batch * x.size(-2) ** 2 * x.size(-1)


def select_backend(x: Tensor) -> Backend:
    """Backend for the (already transposed to wide) working matrix ``x`` of shape [m, n] or [B, m, n].

    By default the GPU backend takes eligible inputs with at least MIN_GPU_BACKEND_WORK multiply-adds per
    Gram matrix. Below that the products take microseconds, Newton–Schulz is bound by kernel launches, and
    the GPU backend gained nothing on the H200 (1024×4096: 0.64 ms against plain torch's 0.28 ms).
    """
    forced = _forced[-1] if _forced else None
    if forced == "torch" or (forced is None and gram_work(x) < MIN_GPU_BACKEND_WORK):
        return TORCH_MATMULS  # decided before any CUDA query: small inputs pay nothing for the choice
    if not triton_eligible(x):
        return TORCH_MATMULS
    if forced == "syrk":
        return SYRK_MATMULS
    return TRITON_MATMULS


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, ``select_backend`` returns the named backend: "torch", "triton" (the GPU backend at
    every size) or "syrk" (the GPU backend with SYRK kernels at every size); the last two still fall back
    to torch where they cannot run (CPU, fp32, no Triton)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"use_backend: expected one of {BACKEND_NAMES}, got {name!r}")
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()
