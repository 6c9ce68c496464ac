"""One Newton–Schulz iteration on the GPU: Triton SYRK kernels where they pay, cuBLAS elsewhere.

    start:  X₀ = X̃ / max(‖X̃‖_F, eps)      (X̃ = round(G), G rounded to the working dtype; where the products
                                            are SYRK kernels: X̃ and s = 1 / max(‖X̃‖_F, eps) from one read of
                                            G, s folded into the first products, A₀ = s²·X̃·X̃ᵀ, P₀·X₀ = (s·P₀)·X̃;
                                            elsewhere X₀ written; :mod:`.normalize`)
    gram:   A = X·Xᵀ                       (SYRK: lower-triangle tiles only, mirrored; or cuBLAS)
    poly:   P = a·I + b·A + c·A·A          (SYRK on the symmetric A, b·A and a·I fused into the epilogue;
                                            the standard form off SYRK: cuBLAS addmm, then a·I)
    apply:  X' = P·X  (= a·X + B·X)        (cuBLAS: a full product, nothing to save)
    symmetric_product: X·Yᵀ known symmetric (Gram Newton–Schulz's R·Z, Q·Z; lower tiles, or cuBLAS)

The SYRK products run on one of two kernels (:func:`symmetric_kernel`): the warp-specialized Gluon kernel
(:mod:`.ws_syrk`) on Hopper for products of at least 2³³ multiply-adds with m ≤ 4096, the Triton kernel
(:mod:`.triton_syrk`) everywhere else; where the Gluon kernel runs them, SYRK pays from smaller sizes
(:func:`syrk_floors_met`).

Folding a·X into P turns the third product into a plain matmul, which cuBLAS runs faster than the
``addmm`` with a C term (docs/kernels.md "What runs"); the cost is that a + B_ii is rounded to bf16 once,
within bf16 rounding of the result, not bitwise torch's.

A tall gradient reaches the iteration as X = Gᵀ, a transposed view. ``gram`` reads it in place, and
``apply`` computes X'ᵀ = Xᵀ·P on the contiguous Gᵀ's storage (P is exactly symmetric), so the iteration
never materializes a transpose and hands back a view of the same layout.
"""

from __future__ import annotations

from torch import Tensor

from .normalize import cast_and_scale_into, normalize_into, scale_cast_applies, scale_of
from .shapes import decision_count
from .torch_matmuls import TORCH_MATMULS, scaled
from .triton_syrk import is_transposed_view, lower_tile_count, symmetric_product, syrk
from .ws_syrk import BLOCK as LOWER_TILE  # the Gluon kernel's tile: a Gram chain keeps lower tiles where it divides m
from .ws_syrk import ws_syrk_pays, ws_syrk_runs_products, ws_syrk_supported

# Smallest Gram side, and fewest 128×128 lower-triangle tiles (all matrices of a batch together), from which the
# SYRK kernels beat cuBLAS's full products; they depend on the kernel that runs the m×m products: the Triton
# kernel (MIN_SYRK_*) or the Gluon kernel (MIN_GLUON_SYRK_*).
# Chosen by measurement: docs/kernels.md "Measured constants" (re-measure: tools/kernels/ns_variants.py)
MIN_SYRK_DIM = 1280
MIN_SYRK_TILES = 264
MIN_GLUON_SYRK_DIM = 768
MIN_GLUON_SYRK_TILES = 136
# Below MIN_SYRK_DIM the Triton kernel also pays for SMALL_SYRK_DIMS[0] ≤ m < SMALL_SYRK_DIMS[1] from
# MIN_SMALL_SYRK_TILES tiles, a unit of 8 768-wide experts: measured 0.364 against 0.388 ms for 8×768×2048 (and
# 8×2048×768), 4.64 against 5.51 ms for a stack of 16 such units (docs/kernels.md "Expert stacks"). On Hopper the
# Gluon kernel takes those calls (MIN_GLUON_SYRK_DIM): 4.59 against the Triton kernel's 4.96 ms for the stack.
SMALL_SYRK_DIMS = (768, 1024)
MIN_SMALL_SYRK_TILES = 168
# Whether Gram chains keep their symmetric intermediates as lower tiles where they can
# (TritonMatmuls.keeps_lower_tiles; the same bits either way); 0 turns it off, for benchmarks to compare.
KEEP_LOWER_TILES = 1


def symmetric_kernel(
    x: Tensor,
    y: Tensor | None = None,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Tensor | None = None,
    diag: float = 0.0,
    scale: Tensor | None = None,
    scale_power: int = 1,
    lower_in: bool = False,
    lower_out: bool = False,
) -> Tensor:
    """s^p·(alpha·X·Yᵀ + beta·C + diag·I), Y = X by default, on the faster of the two SYRK kernels for x: the
    warp-specialized Gluon one where :func:`.ws_syrk.ws_syrk_pays` holds, else the Triton one. ``lower_in``
    (symmetric [B, m, m] operands valid in their lower tiles only) needs the Gluon kernel; ``lower_out`` lets
    it write the lower tiles only (the Triton kernel writes whole results, which serve as well)."""
    if ws_syrk_pays(x, y, c):
        return ws_syrk_supported(x, y, alpha, beta, c, diag, scale, scale_power, lower_in, lower_out)
    if lower_in:
        raise RuntimeError(
            f"symmetric_kernel: operands stored as lower tiles need the Gluon kernel, which does not take "
            f"{tuple(x.shape)} {x.dtype} here (the chain keeps lower tiles only where every product runs on it)"
        )
    if y is None:
        return syrk(x, alpha, beta, c, diag, scale=scale, scale_power=scale_power)
    if (alpha, beta, c, diag, scale_power) != (1.0, 0.0, None, 0.0, 1):
        raise ValueError("symmetric_kernel: with Y the Triton kernel takes only X·Yᵀ times a scale")
    return symmetric_product(x, y, scale=scale)


def syrk_floors_met(m: int, matrices: int, gluon: bool) -> bool:
    """Whether ``matrices`` Gram matrices m×m reach the SYRK floors of the kernel running the m×m products: the
    Gluon one (``gluon``: MIN_GLUON_SYRK_DIM, MIN_GLUON_SYRK_TILES) or the Triton one (MIN_SYRK_DIM,
    MIN_SYRK_TILES, or for :func:`small_syrk_dim` sides MIN_SMALL_SYRK_TILES); tiles are 128×128 on or below the
    diagonal."""
    tiles = matrices * lower_tile_count(m, 128, 1)
    if gluon:
        return m >= MIN_GLUON_SYRK_DIM and tiles >= MIN_GLUON_SYRK_TILES
    if small_syrk_dim(m):
        return tiles >= MIN_SMALL_SYRK_TILES
    return m >= MIN_SYRK_DIM and tiles >= MIN_SYRK_TILES


def small_syrk_dim(m: int) -> bool:
    """Whether the Triton SYRK kernel's small-side floor (SMALL_SYRK_DIMS, MIN_SMALL_SYRK_TILES) holds for m."""
    low, high = SMALL_SYRK_DIMS
    return low <= m < high


def syrk_pays(x: Tensor) -> bool:
    """Whether the SYRK kernels beat cuBLAS on the Gram matrix and the m×m products of ``x`` ([m, k] or
    [B, m, k]): :func:`syrk_floors_met` for the kernel that would run the m×m products, over
    :func:`.shapes.decision_count` matrices."""
    return syrk_floors_met(x.size(-2), decision_count(x), ws_syrk_runs_products(x))


class TritonMatmuls:
    """GPU backend (CUDA, bf16/fp16): SYRK ``gram`` and ``poly`` where they pay, ``apply`` through cuBLAS."""

    def __init__(self, always_syrk: bool = False) -> None:
        """``always_syrk``: the SYRK kernels for every size (tests, benchmarks), not only where they pay."""
        self.always_syrk = always_syrk
        self.name = "syrk" if always_syrk else "triton"

    def uses_syrk(self, x: Tensor) -> bool:
        """Whether ``gram`` and ``symmetric_product`` run the SYRK kernels on x's size (else cuBLAS)."""
        return self.always_syrk or syrk_pays(x)

    def uses_gluon_syrk(self, x: Tensor) -> bool:
        """Whether the m×m products on x's size run on the warp-specialized Gluon kernel."""
        return self.uses_syrk(x) and ws_syrk_runs_products(x)

    def start_into(
        self, g: Tensor, out: Tensor, x: Tensor, eps: float, scale_out: Tensor | None = None
    ) -> Tensor | None:
        """Newton–Schulz's start from G into ``out`` (G's shape; ``x``: its wide working view). Where the
        products on ``x`` are SYRK kernels and the one-pass kernels apply, writes X̃ = round(G) and returns the
        per-matrix scale s = 1 / max(‖X̃‖_F, eps) (fp32, into ``scale_out`` when given), X₀ = s·X̃, for the
        caller to fold into the first iteration; else writes X₀ itself and returns None. Either way only X̃
        counts: an fp32 G and its cast give the same bits (:mod:`.normalize`)."""
        if not (self.uses_syrk(x) and scale_cast_applies(g, out)):
            self.normalize_into(g, out, eps)
            return None
        return cast_and_scale_into(g, out, eps, scale_out)

    def start_scale(self, g: Tensor, x: Tensor, eps: float, scale_out: Tensor | None = None) -> Tensor | None:
        """The start with G itself as X̃, for G already in the working dtype (``x``: G's wide view): where
        :meth:`start_into` would fold a scale, returns s = 1 / max(‖G‖_F, eps) per matrix (fp32, into
        ``scale_out`` when given), X₀ = s·G, reading G once and writing nothing else (:func:`.normalize.scale_of`),
        the bits :meth:`start_into` gives; else None, and the caller writes a start."""
        if not (self.uses_syrk(x) and scale_cast_applies(g, g)):
            return None
        return scale_of(g, eps, scale_out)

    def normalize_into(self, g: Tensor, out: Tensor, eps: float) -> None:
        """out = round(X̃ / max(‖X̃‖_F, eps)) per matrix, X̃ = round(G) (:mod:`.normalize`) where both are
        contiguous, else as torch does it (the same from X̃, rounding the norm too)."""
        if scale_cast_applies(g, out):
            normalize_into(g, out, eps)
        else:
            TORCH_MATMULS.normalize_into(g, out, eps)

    def keeps_lower_tiles(self, x: Tensor) -> bool:
        """Whether a Gram chain on the wide ``x`` ([m, n] or [B, m, n]) keeps its symmetric m×m intermediates as
        their 128×128 lower tiles: every m×m product on the Gluon kernel (:meth:`uses_gluon_syrk`) and
        LOWER_TILE | m. The kernel computes those tiles exactly as it does for whole operands, so the chain's
        result is the same bits either way; it reads and writes 21 of 36 tiles at m = 768. KEEP_LOWER_TILES = 0
        turns it off."""
        return bool(KEEP_LOWER_TILES) and x.size(-2) % LOWER_TILE == 0 and self.uses_gluon_syrk(x)

    def gram(self, x: Tensor, scale: Tensor | None = None, lower_out: bool = False) -> Tensor:
        """A = s²·X·Xᵀ (per matrix of a batch; s = 1 without ``scale``), exactly symmetric on the SYRK path;
        ``lower_out``: the Gluon kernel writes its lower tiles only."""
        if self.uses_syrk(x):
            return symmetric_kernel(x, scale=scale, scale_power=2, lower_out=lower_out)
        return scaled(x @ x.mT, scale, 2)

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
        """P = s·(a·I + b·A + c·A·A) for a symmetric A (s = 1 without ``scale``): the SYRK kernel at every
        size, whose fp32 epilogue rounds P once (rounding b·A + c·A·A before adding a·I doubles Gram
        Newton–Schulz's error, and an fp32 sum after cuBLAS costs more than the product: docs/kernels.md
        "Measured constants"); A and P as lower tiles where ``lower_in``, ``lower_out`` (:class:`GramBackend
        <..linalg.gram.GramBackend>`)."""
        return symmetric_kernel(
            gram, alpha=c, beta=b, c=gram, diag=a, scale=scale, lower_in=lower_in, lower_out=lower_out
        )

    def symmetric_product(
        self, x: Tensor, y: Tensor, scale: Tensor | None = None, lower_in: bool = False, lower_out: bool = False
    ) -> Tensor:
        """s·X·Yᵀ for a product known to be symmetric (exactly symmetric on the SYRK path); operands and result
        as lower tiles where ``lower_in``, ``lower_out``."""
        if lower_in or self.uses_syrk(x):
            return symmetric_kernel(x, y, scale=scale, lower_in=lower_in, lower_out=lower_out)
        return scaled(x @ y.mT, scale, 1)

    def apply(self, p: Tensor, x: Tensor) -> Tensor:
        """X' = P·X (P symmetric); keeps x's layout when x is a transposed view."""
        if is_transposed_view(x):
            return (x.mT @ p).mT
        return p @ x

    def iteration(self, x: Tensor, a: float, b: float, c: float, scale: Tensor | None = None) -> Tensor:
        """X' = (a·I + b·A + c·A·A)·X with A = X·Xᵀ, for X = s·x (x without ``scale``): on the SYRK path
        A = s²·x·xᵀ and X' = (s·P)·x, so s·x is never formed. Off the SYRK path P comes from one cuBLAS
        ``addmm`` and a diagonal add, faster there than the SYRK kernel (docs/kernels.md "Measured
        constants"); b·A + c·A·A is rounded before a·I is added, harmless in this form."""
        if self.uses_syrk(x):
            return self.apply(self.poly(self.gram(x, scale), a, b, c, scale), x)
        x = scaled(x, scale, 1)
        gram = self.gram(x)
        p = TORCH_MATMULS.gram_poly(gram, b, c)
        p.diagonal(dim1=-2, dim2=-1).add_(a)
        return self.apply(p, x)


TRITON_MATMULS = TritonMatmuls()
SYRK_MATMULS = TritonMatmuls(always_syrk=True)
