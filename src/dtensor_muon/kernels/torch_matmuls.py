"""One Newton–Schulz iteration with plain torch matmuls (any device, any dtype).

    A = X·Xᵀ;  B = b·A + c·A·A;  X' = a·X + B·X

For 2-D inputs these are exactly the calls torch.optim.Muon makes (``addmm``), so results match it bit
for bit; 3-D inputs (a batch of matrices) use the batched equivalents (``baddbmm``).
"""

from __future__ import annotations

import torch
from torch import Tensor


class TorchMatmuls:
    """Plain-matmul backend for 2-D or batched 3-D inputs."""

    name = "torch"

    def gram(self, x: Tensor) -> Tensor:
        """A = X·Xᵀ (per matrix of a batch)."""
        return x @ x.mT

    def gram_poly(self, a: Tensor, b: float, c: float) -> Tensor:
        """B = b·A + c·A·A for a symmetric A."""
        if a.ndim == 2:
            return torch.addmm(a, a, a, beta=b, alpha=c)
        return torch.baddbmm(a, a, a, beta=b, alpha=c)

    def combine(self, x: Tensor, bmat: Tensor, a: float) -> Tensor:
        """X' = a·X + B·X."""
        if x.ndim == 2:
            return torch.addmm(x, bmat, x, beta=a)
        return torch.baddbmm(x, bmat, x, beta=a)

    def iteration(self, x: Tensor, a: float, b: float, c: float) -> Tensor:
        """X' = a·X + (b·A + c·A·A)·X with A = X·Xᵀ."""
        return self.combine(x, self.gram_poly(self.gram(x), b, c), a)


TORCH_MATMULS = TorchMatmuls()
