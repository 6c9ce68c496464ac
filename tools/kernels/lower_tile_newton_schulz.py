"""Whole Gram Newton–Schulz calls with the chain of m×m products on lower tiles, against the library's own call.

    TRITON_INTERPRET=1 PYTHONPATH=src python tools/kernels/lower_tile_newton_schulz.py --check       (CPU)
    PYTHONPATH=src python tools/kernels/lower_tile_newton_schulz.py --shapes 32x768x2048,128x768x2048,32x2048x768

``lower_tile_products.py`` times one product of symmetric stacks stored as lower tiles; what decides whether the
storage pays is a whole call. This runs the library's Gram form (``linalg/gram.py``: segments of 2 + 2 + 1 of
Keller's 5 iterations) through :class:`LowerTileChain`, a backend that keeps the library's Gram matrix R = s²·X·Xᵀ
(exactly symmetric, so its lower tiles are valid as they are), runs every polynomial a·I + b·R + c·R² and every
symmetric product on lower tiles (a ``lower_tile_products.py`` variant, one config), and mirrors Q once per
segment before the library's apply Q·X: :func:`mirror_upper_tiles` writes each upper tile, in place, from its lower
mirror (reading and writing the (t − 1)/2t of Q the upper tiles hold, t tiles a side). Each
call, the library's and this one, is replayed from a CUDA graph from the same normalized start (the start itself
not timed); the table gives both times, their ratio, and how far the two results lie apart and from the float64
result of the same iterations (the first matrices).

``--check`` (CPU, under the Triton interpreter) runs small stacks through the chain on torch's backend, against
the same Gram form on torch's backend alone and in float64: the chain's error must stay within twice the
library form's plus bf16 rounding (2⁻⁸) of the result's largest entry.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from graph_timing import graph_us
from lower_tile_products import TMA_LAYOUTS, lower_tile_variants, pack_lower, unpack_lower
from torch import Tensor

from dtensor_muon.kernels.torch_matmuls import TORCH_MATMULS
from dtensor_muon.kernels.ws_syrk import BLOCK as GLUON_TILE
from dtensor_muon.linalg.gram import GramBackend, gram_newton_schulz
from dtensor_muon.linalg.newton_schulz import (
    KELLER_COEFFICIENTS,
    gram_segments,
    in_layout_of,
    iteration_schedule,
    normalized_start,
)

STEPS = 5


@triton.jit
def _mirror_upper_kernel(ptr, M, stride_b, stride_m, T: tl.constexpr, EVEN: tl.constexpr):
    """Upper tile (c, r), c < r, of one matrix ← the transpose of its lower tile (r, c); strictly lower tile t is
    row r ≥ 1 with r(r − 1)/2 ≤ t < r(r + 1)/2 (float estimate, then exact fix-ups), column c = t − r(r − 1)/2."""
    t = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    r = ((tl.sqrt((8 * t + 1).to(tl.float32)) + 1.0) * 0.5).to(tl.int32)
    r = tl.where(r * (r - 1) // 2 > t, r - 1, r)
    r = tl.where((r + 1) * r // 2 <= t, r + 1, r)
    c = t - r * (r - 1) // 2
    offs = tl.arange(0, T)
    rows = r * T + offs
    cols = c * T + offs
    base = ptr + batch * stride_b
    lower = base + rows[:, None] * stride_m + cols[None, :]  # [T, T] of tile (r, c)
    upper = base + cols[None, :] * stride_m + rows[:, None]  # the same entries' mirror images in tile (c, r)
    if EVEN:
        tl.store(upper, tl.load(lower))
    else:
        inside = (rows[:, None] < M) & (cols[None, :] < M)
        tl.store(upper, tl.load(lower, mask=inside), mask=inside)


def mirror_upper_tiles(stored: Tensor, tile: int) -> Tensor:
    """In place: every upper tile of the [B, m, m] stack ``stored`` (lower tiles at ``tile``, rows contiguous)
    written as its lower mirror's transpose; returns the stack, now whole and symmetric."""
    batch, m, _ = stored.shape
    sides = triton.cdiv(m, tile)
    if sides > 1:
        _mirror_upper_kernel[(sides * (sides - 1) // 2, batch)](
            stored, m, stored.stride(0), stored.stride(1), T=tile, EVEN=m % tile == 0, num_warps=4
        )
    return stored


class LowerTileChain:
    """A Gram backend: ``base``'s Gram matrix and apply, the m×m polynomials and products on lower tiles at
    ``tile`` by ``product`` (a ``lower_tile_products.py`` product function with its config), Q mirrored before
    the apply."""

    def __init__(self, base: GramBackend, product: Callable[..., Tensor], tile: int) -> None:
        self.base, self.product, self.tile = base, product, tile

    def keeps_lower_tiles(self, x: Tensor) -> bool:
        """False: this backend keeps lower tiles on its own terms (every product, Q mirrored before the apply),
        not the library chain's (``lower_in``/``lower_out``, the last Q written whole)."""
        return False

    def gram(self, x: Tensor, scale: Tensor | None = None, lower_out: bool = False) -> Tensor:
        """R = s²·X·Xᵀ by the base backend, whole (its lower tiles are what the chain reads)."""
        return self.base.gram(x, scale)

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
        """s·(a·I + b·R + c·R²) on lower tiles, one fp32 epilogue."""
        return self.product(gram, None, alpha=c, beta=b, diag=a, scale=scale)

    def symmetric_product(
        self, x: Tensor, y: Tensor, scale: Tensor | None = None, lower_in: bool = False, lower_out: bool = False
    ) -> Tensor:
        """s·X·Y for symmetric X, Y whose product is symmetric, on lower tiles."""
        return self.product(x, y, scale=scale)

    def apply(self, p: Tensor, x: Tensor) -> Tensor:
        """P·X by the base backend, P's upper tiles mirrored from its lower ones first (in place: P is the
        segment's last product, read by nothing else)."""
        return self.base.apply(mirror_upper_tiles(p, self.tile), x)


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``BxMxN,...`` as (B, m, n) triples."""
    return [tuple(int(d) for d in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def gram_call(x: Tensor, backend: GramBackend, scale: Tensor | None, g: Tensor) -> Tensor:
    """Keller's 5 iterations in the library's Gram segments from X₀ = s·x, in g's layout."""
    schedule = iteration_schedule(g, KELLER_COEFFICIENTS, STEPS)
    return in_layout_of(gram_newton_schulz(x, schedule, backend, gram_segments(STEPS), scale), g)


def reference(g: Tensor) -> Tensor:
    """The same iterations in float64 on torch's backend, from G / ‖G‖_F."""
    g64 = g.double()
    x = g64 / torch.linalg.vector_norm(g64, dim=(-2, -1), keepdim=True)
    return gram_call(in_layout_of(x, g), TORCH_MATMULS, None, g)


def run_check(variants: dict[str, Callable[..., Tensor]]) -> bool:
    """Small bf16 stacks on CPU: the chain on torch's backend against the Gram form on torch's backend, both
    against float64 (module docstring)."""
    ok = True
    gen = torch.Generator().manual_seed(0)
    for batch, m, tile in ((2, 256, 64), (1, 192, 128), (3, 160, 64)):
        full = torch.randn(batch, m, m, generator=gen).to(torch.bfloat16)
        full = full + full.mT
        mirrored = mirror_upper_tiles(pack_lower(full, tile, fill=float("nan")), tile)
        passed = torch.equal(mirrored, unpack_lower(pack_lower(full, tile), tile)) and torch.equal(mirrored, full)
        ok &= passed
        print(f"mirror    {batch}x{m}x{m} T {tile}: {'ok' if passed else 'FAIL'}")
    for batch, m, n, tile in ((2, 128, 256, 64), (2, 256, 128, 64), (1, 256, 384, 128)):
        g = torch.randn(batch, m, n, generator=gen).to(torch.bfloat16)
        _, x, _, scale = normalized_start(g, torch.bfloat16, 1e-7)
        assert scale is None
        want = reference(g)
        library = (gram_call(x, TORCH_MATMULS, None, g).double() - want).abs().max().item()
        for name, product in variants.items():
            chain = LowerTileChain(TORCH_MATMULS, functools.partial(product, tile=tile, block_k=32), tile)
            got = gram_call(x, chain, None, g).double()
            error = (got - want).abs().max().item()
            bound = 2 * library + 2.0**-8 * want.abs().max().item()
            passed = error <= bound
            ok &= passed
            print(
                f"{name:9s} {batch}x{m}x{n} T {tile}: error {error:.3e}, the library form's {library:.3e}, "
                f"bound {bound:.3e}: {'ok' if passed else 'FAIL'}"
            )
    print("all checks pass" if ok else "FAILED")
    return ok


def run_time(args: argparse.Namespace, variants: dict[str, Callable[..., Tensor]]) -> None:
    """Time the library's call and the chain's per shape and variant on the GPU; print the table, write JSON."""
    tile, block_k, warps, stages = args.config
    rows = []
    for batch, m, n in args.shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        g = torch.randn(batch, m, n, generator=gen, device="cuda").to(torch.bfloat16)
        _, x, backend, scale = normalized_start(g, torch.bfloat16, 1e-7, own_buffer=True)
        want = reference(g[:2])
        library_us, library_out = graph_us(functools.partial(gram_call, x, backend, scale, g), rounds=args.rounds)
        library_error = (library_out[:2].double() - want).abs().max().item()
        for name, product in variants.items():
            if name == "gluon":  # the library kernel's tile, depth and warps, whatever --config says
                configured = product
            else:
                configured = functools.partial(product, tile=tile, block_k=block_k, num_warps=warps, num_stages=stages)
            chain = LowerTileChain(backend, configured, GLUON_TILE if name == "gluon" else tile)
            try:
                us, out = graph_us(functools.partial(gram_call, x, chain, scale, g), rounds=args.rounds)
            except ValueError as exc:  # a TMA variant refusing an operand's layout (the library's R, say)
                print(f"{batch}x{m}x{n} {name}: {exc}")
                continue
            rows.append(
                {
                    "shape": f"{batch}x{m}x{n}",
                    "variant": name,
                    "library_us": library_us,
                    "lower_tiles_us": us,
                    "ratio": us / library_us,
                    "max_diff_to_library": (out.double() - library_out.double()).abs().max().item(),
                    "error_vs_float64": (out[:2].double() - want).abs().max().item(),
                    "library_error_vs_float64": library_error,
                }
            )
    print(f"\n{torch.cuda.get_device_name()}, config T {tile}, BLOCK_K {block_k}, {warps} warps, {stages} stages "
          "(gluon: the library kernel's, T 128, BLOCK_K 64, ws_syrk.STAGES)\n")  # fmt: skip
    print("| stack | variant | library µs | lower tiles µs | ratio | max diff to library | error vs fp64 (library's) |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['shape']} | {r['variant']} | {r['library_us']:.1f} | {r['lower_tiles_us']:.1f} | {r['ratio']:.2f} "
            f"| {r['max_diff_to_library']:.2e} | {r['error_vs_float64']:.2e} ({r['library_error_vs_float64']:.2e}) |"
        )
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "config": args.config, "rows": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="small stacks on CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("32x768x2048,128x768x2048,32x2048x768"))
    parser.add_argument(
        "--config",
        type=lambda s: tuple(int(v) for v in s.split(",")),
        default=(128, 64, 8, 4),
        help="T,BLOCK_K,num_warps,num_stages of the lower-tile kernel",
    )
    parser.add_argument("--kernel", choices=("pointers", "tma", "both", "gluon", "all"), default="both")
    parser.add_argument("--tma-layout", choices=(*TMA_LAYOUTS, "both"), default="flat")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    variants = lower_tile_variants(args.kernel, list(TMA_LAYOUTS) if args.tma_layout == "both" else [args.tma_layout])
    if args.check:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--check runs on CPU under TRITON_INTERPRET=1")
        variants.pop("gluon", None)  # Hopper only; its products are checked by lower_tile_products.py --check
        if not run_check(variants):
            raise SystemExit(1)
        return
    if not torch.cuda.is_available():
        parser.error("timing needs a CUDA GPU (or --check under TRITON_INTERPRET=1)")
    run_time(args, variants)


if __name__ == "__main__":
    main()
