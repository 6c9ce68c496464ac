"""One Newton–Schulz iteration with plain torch matmuls (any device, any dtype).

    A = X·Xᵀ;  B = b·A + c·A·A;  X' = a·X + B·X

For 2-D inputs these are exactly the calls torch.optim.Muon makes (``addmm``), so results match it bit
for bit; 3-D inputs (a batch of matrices) use the batched equivalents (``baddbmm``). ``poly``,
``symmetric_product`` and ``apply`` are the products of Gram Newton–Schulz (:mod:`..linalg.gram`).

A per-matrix ``scale`` s (fp32, from a backend's ``start_into``) multiplies a product's result by s or s²;
this backend never hands one out (its start writes X₀ itself) but honours one, in fp32 with one rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor


def scaled(t: Tensor, scale: Tensor | None, power: int) -> Tensor:
    """t·s_b^power per matrix b of ``t`` (2-D: one matrix), in fp32 and rounded once to t's dtype; t itself
    when ``scale`` is None."""
    if scale is None:
        return t
    factor = scale.reshape((-1, 1, 1) if t.ndim == 3 else (1, 1)) ** power
    return (t.to(torch.promote_types(t.dtype, torch.float32)) * factor).to(t.dtype)


class TorchMatmuls:
    """Plain-matmul backend for 2-D or batched 3-D inputs."""

    name = "torch"

    def start_into(
        self, g: Tensor, out: Tensor, x: Tensor, eps: float, scale_out: Tensor | None = None
    ) -> Tensor | None:
        """Writes X₀ = G / max(‖G‖_F, eps) into ``out`` (:meth:`normalize_into`) and returns None: no scale
        to fold (``x``, out's working view, and ``scale_out`` are for backends that fold one)."""
        self.normalize_into(g, out, eps)
        return None

    def start_scale(self, g: Tensor, x: Tensor, eps: float, scale_out: Tensor | None = None) -> Tensor | None:
        """None: this backend writes X₀ (:meth:`start_into`), it never folds a scale (``scale_out`` unused)."""
        return None

    def normalize_into(self, g: Tensor, out: Tensor, eps: float) -> None:
        """out = G / max(‖G‖_F, eps) per matrix of a batch, as torch.optim.Muon computes it: G cast to out's
        dtype, then divided in place by the norm of the cast (``out``: G's shape and dtype-cast layout)."""
        out.copy_(g)
        if out.ndim == 2:
            out.div_(out.norm().clamp(min=eps))
        else:
            out.div_(torch.linalg.vector_norm(out, dim=(-2, -1), keepdim=True).clamp(min=eps))

    def uses_syrk(self, x: Tensor) -> bool:
        """Never: every product is a full matmul."""
        return False

    def uses_gluon_syrk(self, x: Tensor) -> bool:
        """Never: every product is a full matmul."""
        return False

    def keeps_lower_tiles(self, x: Tensor) -> bool:
        """Never: every result is written whole (so the chain's ``lower_in``/``lower_out`` never reach here
        as True)."""
        return False

    def gram(self, x: Tensor, scale: Tensor | None = None, lower_out: bool = False) -> Tensor:
        """A = s²·X·Xᵀ (per matrix of a batch; s = 1 without ``scale``), written whole."""
        return scaled(x @ x.mT, scale, 2)

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

    def iteration(self, x: Tensor, a: float, b: float, c: float, scale: Tensor | None = None) -> Tensor:
        """X' = a·X + (b·A + c·A·A)·X with A = X·Xᵀ, for X = s·x (x itself without ``scale``; with it, s·x is
        rounded first)."""
        x = scaled(x, scale, 1)
        return self.combine(x, self.gram_poly(self.gram(x), b, c), a)

    def poly(
        self,
        gram: Tensor,
        a: float,
        b: float,
        c: float,
        scale: Tensor | None = None,
        lower_in: bool = False,
        lower_out: bool = False,
    ) -> Tensor:
        """P = s·(a·I + b·A + c·A·A) for a symmetric A (s = 1 without ``scale``), in fp32 (or wider) and rounded
        once to A's dtype (as the SYRK epilogue does; rounding b·A + c·A·A before adding a·I more than doubles
        Gram Newton–Schulz's error); A whole, P written whole."""
        wide = torch.promote_types(gram.dtype, torch.float32)
        p = self.gram_poly(gram.to(wide), b, c)
        p.diagonal(dim1=-2, dim2=-1).add_(a)
        return scaled(p, scale, 1).to(gram.dtype)

    def symmetric_product(
        self, x: Tensor, y: Tensor, scale: Tensor | None = None, lower_in: bool = False, lower_out: bool = False
    ) -> Tensor:
        """s·X·Yᵀ (a full product; the caller knows the result is symmetric; s = 1 without ``scale``)."""
        return scaled(x @ y.mT, scale, 1)

    def apply(self, p: Tensor, x: Tensor) -> Tensor:
        """P·X."""
        return p @ x


TORCH_MATMULS = TorchMatmuls()
