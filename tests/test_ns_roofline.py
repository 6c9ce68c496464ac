"""bench/ns_roofline.py: the products it records follow the library's iteration, and its FLOPs and bytes follow
the formulas and the tensors the products read and write."""

import pytest
import torch
from bench_modules import bench_module

from dtensor_muon.linalg.newton_schulz import KELLER_COEFFICIENTS, gram_segments, iterate

roof = bench_module("ns_roofline")


def kinds_of(rows: int, cols: int, algorithm: str, steps: int = 5) -> dict[str, int]:
    """How many products of each kind one call records."""
    counts: dict[str, int] = {}
    for p in roof.products(rows, cols, algorithm, steps):
        counts[p.kind] = counts.get(p.kind, 0) + 1
    return counts


@pytest.mark.parametrize("steps", [1, 2, 3, 5, 6])
def test_the_gram_form_runs_one_gram_and_apply_a_segment_and_4L_minus_3_mm_products(steps):
    """gram.py's count: a segment of L iterations is one Gram matrix, 4L − 3 products of m×m matrices (L of
    them the polynomials) and one apply."""
    segments = gram_segments(steps)
    counts = kinds_of(64, 160, "gram", steps)
    assert counts.get("gram") == counts.get("apply") == len(segments)
    assert counts.get("poly") == steps
    assert counts.get("poly", 0) + counts.get("product", 0) == sum(4 * length - 3 for length in segments)


def test_the_standard_form_does_the_symmetric_floors_flops_and_the_gram_form_074_of_them_at_4096x14336():
    """Standard: exactly steps·(3m²n + m³) (the benchmarks' floor, written here from the iteration); Gram at
    4096×14336 in segments 2 + 2 + 1: 0.74× (gram.py's docstring)."""
    m, n = 768, 2048
    standard = sum(p.flops for p in roof.products(n, m, "standard"))  # tall: run transposed
    assert standard == 5 * (3 * m * m * n + m**3)
    assert kinds_of(768, 2048, "standard") == {"gram": 5, "poly": 5, "apply": 5}
    gram = sum(p.flops for p in roof.products(4096, 14336, "gram"))
    assert gram / roof.ns_flops((4096, 14336))[0] == pytest.approx(0.74, abs=0.005)


class SizedMatmuls(roof.RecordingMatmuls):
    """Records, besides the product, the bytes of the bf16 tensors each recorded call takes and returns."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: list[int] = []

    def _record(self, kind, m, n, compute):
        outermost = self._depth == 0
        out = super()._record(kind, m, n, compute)
        if outermost:
            self.moved.append(out.nbytes)
        return out

    def _count_inputs(self, *tensors):
        if self._depth == 0:
            self.moved.append(sum(t.nbytes for t in tensors))

    def gram(self, x, scale=None, lower_out=False):
        self._count_inputs(x)
        return super().gram(x, scale)

    def gram_poly(self, a, b, c):
        self._count_inputs(a)
        return super().gram_poly(a, b, c)

    def poly(self, gram, a, b, c, scale=None, lower_in=False, lower_out=False):
        self._count_inputs(gram)
        return super().poly(gram, a, b, c, scale)

    def symmetric_product(self, x, y, scale=None, lower_in=False, lower_out=False):
        self._count_inputs(x, y)
        return super().symmetric_product(x, y, scale)

    def combine(self, x, bmat, a):
        self._count_inputs(x, bmat)
        return super().combine(x, bmat, a)

    def apply(self, p, x):
        self._count_inputs(p, x)
        return super().apply(p, x)


@pytest.mark.parametrize("algorithm", ["gram", "standard"])
def test_each_products_bytes_are_the_bf16_tensors_it_reads_and_writes(algorithm):
    backend = SizedMatmuls()
    x = torch.empty(96, 256, device="meta", dtype=torch.bfloat16)
    iterate(x, (KELLER_COEFFICIENTS,) * 5, backend, algorithm)
    moved = [backend.moved[i] + backend.moved[i + 1] for i in range(0, len(backend.moved), 2)]  # inputs, output
    assert [p.bytes for p in backend.products] == moved and len(moved) == len(backend.products) > 0


def test_768_wide_mm_products_are_memory_bound_at_an_h100s_ridge_and_1408_wide_ones_are_not():
    """m×m products do m/6 FLOPs a byte: 128 at 768 under the ridge 680 TFLOP/s / 3 TB/s = 227, 235 at 1408
    over it; the bound is then bytes / copy rate."""
    narrow = roof.roofline((128, 768, 2048), "gram", 680.0, 3000.0)["kinds"]["product"]
    wide = roof.roofline((8, 1408, 2048), "gram", 680.0, 3000.0)["kinds"]["product"]
    assert narrow["flops"] / narrow["bytes"] == 128 and narrow["memory_bound"]
    assert narrow["roofline_ms"] == pytest.approx(narrow["bytes"] / 3e9)
    assert not wide["memory_bound"] and wide["roofline_ms"] == pytest.approx(wide["flops"] / 680e9)


def test_an_unknown_algorithm_is_refused_by_name():
    with pytest.raises(ValueError, match="algorithm must be 'gram' or 'standard', got 'auto'"):
        roof.products(8, 16, "auto")
