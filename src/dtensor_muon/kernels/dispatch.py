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

from .shapes import decision_count, decision_work
from .torch_matmuls import TORCH_MATMULS

try:
    from .triton_matmuls import SYRK_MATMULS, TRITON_MATMULS, small_syrk_dim
except ImportError:  # no triton
    SYRK_MATMULS = TRITON_MATMULS = None

    def small_syrk_dim(m: int) -> bool:
        """Without triton no SYRK kernel runs, at any side."""
        return False


BACKEND_NAMES = ("torch", "triton", "syrk")
# Below it launches bound the GPU backend, and plain torch matmuls are faster.
# Chosen by measurement: docs/kernels.md "Measured constants" (re-measure: tools/kernels/ns_variants.py)
MIN_GPU_BACKEND_WORK = 2**33
NS_ALGORITHMS = ("auto", "standard", "gram")
# "auto" takes Gram Newton–Schulz on the GPU backend for X (m×n, m ≤ n) with n ≥ aspect·m and at least the work
# floor of multiply-adds (B·m³) per m×m product (why: docs/kernels.md "The Gram form"). Three routes: the Triton
# SYRK kernel runs the m×m products (the first pair), cuBLAS runs them for m ≤ GRAM_SMALL_DIM (the _SMALL pair),
# the Gluon SYRK kernel runs them (GRAM_MIN_ASPECT alone).
# Chosen by measurement: docs/kernels.md "Measured constants" (re-measure: tools/kernels/ns_variants.py)
GRAM_MIN_ASPECT = 1.4
MIN_GRAM_PRODUCT_WORK = 2**36
GRAM_SMALL_DIM = 1024
GRAM_MIN_ASPECT_SMALL = 2.0
MIN_GRAM_PRODUCT_WORK_SMALL = 2**31
_forced: list[str] = []


class Backend(Protocol):
    """Newton–Schulz's start and products on [m, n] or [B, m, n]: the start from G (X₀ = G / max(‖G‖_F, eps)
    written, or X̃ = round(G) with a per-matrix scale s, X₀ = s·X̃, for the first products to fold in; for a G
    already in the working dtype ``start_scale`` gives s alone where that fold applies, X̃ being G itself), one
    iteration X' = a·X + (b·A + c·A·A)·X with A = X·Xᵀ, and the products of its Gram form: A = X·Xᵀ,
    P = a·I + b·A + c·A·A, X·Yᵀ known symmetric, P·X. A ``scale`` s multiplies gram's result by s², poly's and
    symmetric_product's by s, and makes iteration start from s·x."""

    name: str

    def start_into(
        self, g: Tensor, out: Tensor, x: Tensor, eps: float, scale_out: Tensor | None = None
    ) -> Tensor | None: ...

    def start_scale(self, g: Tensor, x: Tensor, eps: float, scale_out: Tensor | None = None) -> Tensor | None: ...

    def uses_syrk(self, x: Tensor) -> bool: ...

    def uses_gluon_syrk(self, x: Tensor) -> bool: ...

    def iteration(self, x: Tensor, a: float, b: float, c: float, scale: Tensor | None = None) -> Tensor: ...

    def keeps_lower_tiles(self, x: Tensor) -> bool: ...

    def gram(self, x: Tensor, scale: Tensor | None = None, lower_out: bool = False) -> Tensor: ...

    def poly(
        self,
        gram: Tensor,
        a: float,
        b: float,
        c: float,
        scale: Tensor | None = None,
        lower_in: bool = False,
        lower_out: bool = False,
    ) -> Tensor: ...

    def symmetric_product(
        self, x: Tensor, y: Tensor, scale: Tensor | None = None, lower_in: bool = False, lower_out: bool = False
    ) -> Tensor: ...

    def apply(self, p: Tensor, x: Tensor) -> Tensor: ...


def triton_eligible(x: Tensor) -> bool:
    """Whether the Triton backend can run on ``x`` at all (device, dtype, Triton present)."""
    return (
        TRITON_MATMULS is not None
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def select_backend(x: Tensor) -> Backend:
    """Backend for the (already transposed to wide) working matrix ``x`` of shape [m, n] or [B, m, n].

    By default the GPU backend takes eligible inputs with at least MIN_GPU_BACKEND_WORK multiply-adds per
    Gram matrix (counted over :func:`.shapes.decision_count` matrices, as every floor of the dispatch is). Below
    that the products take microseconds, Newton–Schulz is bound by kernel launches, and the GPU backend gains
    nothing over plain torch (docs/kernels.md "Measured constants").
    """
    forced = forced_backend()
    if forced == "torch" or (forced is None and decision_work(x) < MIN_GPU_BACKEND_WORK):
        return TORCH_MATMULS  # decided before any CUDA query: small inputs pay nothing for the choice
    if not triton_eligible(x):
        return TORCH_MATMULS
    if forced == "syrk":
        return SYRK_MATMULS
    return TRITON_MATMULS


def resolve_ns_algorithm(name: str) -> str:
    """Validates a Newton–Schulz algorithm name: "auto", "standard" or "gram"."""
    if name not in NS_ALGORITHMS:
        raise ValueError(f"ns_algorithm: expected one of {NS_ALGORITHMS}, got {name!r}")
    return name


def use_gram(algorithm: str, x: Tensor, backend: Backend, schedule_validated: bool) -> bool:
    """Whether Newton–Schulz on the wide working matrix ``x`` runs in Gram form.

    "standard" never, "gram" always; "auto" where it is as accurate and was measured faster: for a
    coefficient schedule validated in Gram form (``schedule_validated``: Keller's, see
    :func:`dtensor_muon.linalg.newton_schulz.gram_validated`), on the GPU backend (plain torch keeps the standard
    form, bitwise torch.optim.Muon), for n ≥ aspect·m, where the m²n products it saves outweigh the extra
    m³ ones (:mod:`..linalg.gram`), and for m×m products large enough that the GPU, not the launches,
    sets the pace: the aspect and work floor are GRAM_MIN_ASPECT and MIN_GRAM_PRODUCT_WORK, the ``_SMALL``
    pair for m ≤ GRAM_SMALL_DIM where the backend runs the m×m products through cuBLAS or the Triton SYRK kernel
    on its small sides (:func:`.triton_matmuls.small_syrk_dim`, measured on 768-wide experts), and GRAM_MIN_ASPECT
    alone where the Gluon kernel runs them (its own floor, 2³³ multiply-adds, is the work floor).
    """
    if resolve_ns_algorithm(algorithm) != "auto":
        return algorithm == "gram"
    if not schedule_validated or backend.name == "torch":
        return False
    m = x.size(-2)
    if backend.uses_gluon_syrk(x):
        min_aspect, min_work = GRAM_MIN_ASPECT, 0  # the Gluon kernel's own floor (2³³) is the work floor
    elif m <= GRAM_SMALL_DIM and (not backend.uses_syrk(x) or small_syrk_dim(m)):
        min_aspect, min_work = GRAM_MIN_ASPECT_SMALL, MIN_GRAM_PRODUCT_WORK_SMALL
    else:
        min_aspect, min_work = GRAM_MIN_ASPECT, MIN_GRAM_PRODUCT_WORK
    return x.size(-1) >= min_aspect * m and decision_count(x) * m**3 >= min_work


def forced_backend() -> str | None:
    """The backend name the innermost :func:`use_backend` block asks for, None outside any."""
    return _forced[-1] if _forced else None


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
