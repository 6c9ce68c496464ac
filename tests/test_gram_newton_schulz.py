"""Gram Newton–Schulz: the same iterations as the standard form (float64), bf16 error of the same order as
the standard form's against the float64 iteration, the "auto" choice, and the optimizer option."""

from __future__ import annotations

import pytest
import torch

from dtensor_muon import Muon
from dtensor_muon.kernels import TORCH_MATMULS, use_gram
from dtensor_muon.linalg.gram import gram_newton_schulz
from dtensor_muon.linalg.newton_schulz import (
    KELLER_COEFFICIENTS,
    NAMED_COEFFICIENTS,
    coefficients_at,
    gram_segments,
    gram_validated,
    newton_schulz,
)

f64 = torch.float64


def standard_iterations(x: torch.Tensor, triples: list[tuple[float, float, float]]) -> torch.Tensor:
    """X ← a·X + (b·A + c·A²)·X, A = X·Xᵀ, in x's dtype (the reference form)."""
    for a, b, c in triples:
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def normalized(g: torch.Tensor) -> torch.Tensor:
    return g / torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)


def with_spectrum(m: int, n: int, kind: str, seed: int) -> torch.Tensor:
    """An m×n float64 matrix with random singular vectors and a named singular-value profile."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(m, n, dtype=f64, generator=gen)
    if kind == "gaussian":
        return g
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    k = torch.arange(m, dtype=f64)
    sigma = {
        "power_law": (k + 1) ** -1.5,
        "low_rank": torch.where(k < 16, 1.0, 1e-3),
        "ill_conditioned": torch.logspace(0, -6, m, dtype=f64),
    }[kind]
    return (u * sigma) @ vh


def schedule(name: str, steps: int) -> list[tuple[float, float, float]]:
    return [coefficients_at(NAMED_COEFFICIENTS[name], i) for i in range(steps)]


def test_segments_of_two() -> None:
    assert gram_segments(5) == [2, 2, 1]
    assert gram_segments(8) == [2, 2, 2, 2]
    assert gram_segments(1) == [1]
    assert gram_validated([KELLER_COEFFICIENTS] * 5) and not gram_validated(schedule("quintic", 5))


@pytest.mark.parametrize("kind", ["rank1", "rank1_plus_noise", "constant"])
def test_low_rank_inputs_stay_bounded(kind: str) -> None:
    """A dominant direction makes bf16 rounding give R spurious negative eigenvalues, which Z = a + b·λ +
    c·λ² (b < 0) amplifies without bound within a segment: with segments 3 + 2 the rank-1 inputs reached
    σ = 8·10³ and 3·10⁴ (the constant matrix 0.92). Segments of 2 keep σ in the standard form's band."""
    gen = torch.Generator().manual_seed(0)
    m, n = 192, 640
    rank1 = torch.randn(m, 1, generator=gen) @ torch.randn(1, n, generator=gen)
    g = {
        "rank1": rank1,
        "rank1_plus_noise": 30 * rank1 + torch.randn(m, n, generator=gen),
        "constant": torch.ones(m, n),
    }[kind]
    sigma = {a: torch.linalg.svdvals(newton_schulz(g, algorithm=a).double()).max().item() for a in ("standard", "gram")}
    assert sigma["gram"] < 1.25 and sigma["standard"] < 1.25


@pytest.mark.parametrize("segments", [[1], [2], [3, 2], [2, 2, 1], [3, 2, 2], [1, 1, 1, 1, 1, 1, 1]])
@pytest.mark.parametrize("shape", [(48, 150), (3, 40, 96)])
def test_equals_the_standard_iteration_in_float64(shape: tuple[int, ...], segments: list[int]) -> None:
    # Per-iteration coefficients, so a wrong pairing of Z_i with its iteration shows.
    triples = schedule("quintic", sum(segments))
    x = normalized(torch.randn(shape, dtype=f64))
    expected = standard_iterations(x, triples)
    got = gram_newton_schulz(x, triples, TORCH_MATMULS, segments)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-12


def test_tall_input_through_newton_schulz_in_float64_dtype_free_backend() -> None:
    g = torch.randn(150, 48, dtype=f64)
    x = normalized(g).mT  # the transposed view newton_schulz hands over for a tall matrix
    expected = standard_iterations(x, [KELLER_COEFFICIENTS] * 5)
    got = gram_newton_schulz(x, [KELLER_COEFFICIENTS] * 5, TORCH_MATMULS, [2, 2, 1])
    assert ((got - expected).norm() / expected.norm()).item() < 1e-12


def test_bad_segments_raise() -> None:
    x = torch.randn(8, 16)
    with pytest.raises(ValueError, match="segments"):
        gram_newton_schulz(x, [KELLER_COEFFICIENTS] * 5, TORCH_MATMULS, [3, 3])
    with pytest.raises(ValueError, match="segments"):
        gram_newton_schulz(x, [KELLER_COEFFICIENTS] * 2, TORCH_MATMULS, [2, 0])


@pytest.mark.parametrize("kind", ["gaussian", "power_law", "low_rank", "ill_conditioned"])
@pytest.mark.parametrize(
    ("shape", "name", "steps"),
    [
        ((256, 896), "simple", 5),
        ((192, 320), "simple", 5),
        ((192, 320), "simple", 8),
        ((192, 320), "quintic", 5),
        ((192, 320), "polar_express", 8),
    ],
)
def test_bf16_error_of_the_order_of_the_standard_forms(
    kind: str, shape: tuple[int, int], name: str, steps: int
) -> None:
    """Against the float64 iteration: Gram form within 2× the standard bf16 form's error (measured here:
    0.73× to 1.08×; the standard form's own error is 1% on Gaussian inputs and 10-30% on the others, where
    bf16 scrambles the smallest singular directions)."""
    g = with_spectrum(*shape, kind, seed=1)
    reference = standard_iterations(normalized(g), schedule(name, steps))
    errors = {}
    sigma_max = {}
    for algorithm in ("standard", "gram"):
        out = newton_schulz(g.float(), name, steps, algorithm=algorithm).to(f64)
        errors[algorithm] = ((out - reference).norm() / reference.norm()).item()
        sigma_max[algorithm] = torch.linalg.svdvals(out).max().item()
    assert 0 < errors["gram"] <= 2 * errors["standard"]
    assert abs(sigma_max["gram"] - sigma_max["standard"]) < 0.03


def test_batched_gram_form_equals_per_slice() -> None:
    """Bit-equal on one CPU thread: no step couples the slices (a batch-wide norm or restart would show). With
    several threads CPU bf16 bmm and mm split the work differently and round differently (1-3e-3 apart)."""
    g = torch.randn(3, 64, 160, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        whole = newton_schulz(g, algorithm="gram")
        slices = torch.stack([newton_schulz(s, algorithm="gram") for s in g])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, slices)


def test_auto_takes_the_gram_form_only_on_the_gpu_backend_for_rectangular_matrices() -> None:
    from dtensor_muon.kernels.triton_matmuls import SYRK_MATMULS, TRITON_MATMULS

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    wide, square = meta(4096, 14336), meta(4096, 4096)
    assert use_gram("auto", wide, TRITON_MATMULS, True)
    assert use_gram("auto", meta(4096, 8192), TRITON_MATMULS, True)
    assert use_gram("auto", meta(64, 1408, 2048), TRITON_MATMULS, True)  # aspect 1.45: 0.90× the FLOPs
    assert not use_gram("auto", meta(64, 1408, 1792), TRITON_MATMULS, True)  # aspect 1.27
    assert not use_gram("auto", wide, TRITON_MATMULS, False)  # a schedule not validated in Gram form
    assert not use_gram("auto", square, TRITON_MATMULS, True)
    assert not use_gram("auto", meta(4096, 4800), TRITON_MATMULS, True)  # aspect 1.17
    assert not use_gram("auto", meta(2048, 4096), TRITON_MATMULS, True)  # m×m products too small
    assert not use_gram("auto", meta(16, 1408, 2048), TRITON_MATMULS, True)
    assert not use_gram("auto", meta(4, 2048, 4096), TRITON_MATMULS, True)  # 2³⁵ on SYRK: measured slower
    # Below the SYRK sizes the m×m products run through cuBLAS, or on 768-wide units of 8 through the Triton
    # kernel's small sides: from aspect 2 and 2³¹ multiply-adds.
    assert use_gram("auto", meta(8, 1024, 4096), TRITON_MATMULS, True)
    assert use_gram("auto", meta(32, 1024, 2048), TRITON_MATMULS, True)
    assert use_gram("auto", meta(8, 768, 2048), TRITON_MATMULS, True)  # Qwen3's experts on SYRK
    assert use_gram("auto", meta(6, 768, 2048), TRITON_MATMULS, True)  # 126 tiles: on cuBLAS
    assert not use_gram("auto", meta(8, 768, 1440), TRITON_MATMULS, True)  # aspect 1.875: below 2 on SYRK too
    assert use_gram("auto", meta(4, 1024, 4096), TRITON_MATMULS, True)  # 2³²: 0.549 vs 0.698 ms
    assert not use_gram("auto", meta(32, 1024, 1536), TRITON_MATMULS, True)  # aspect 1.5
    assert not use_gram("auto", meta(1024, 4096), TRITON_MATMULS, True)  # 2³⁰: below the floor
    assert use_gram("auto", meta(8, 1024, 4096), SYRK_MATMULS, False) is False  # schedule not validated
    assert not use_gram("auto", meta(8, 1024, 4096), SYRK_MATMULS, True)  # SYRK forced: its floor, 2³⁶
    assert not use_gram("auto", wide, TORCH_MATMULS, True)  # CPU: the standard form, bitwise torch.optim.Muon
    assert use_gram("gram", square, TORCH_MATMULS, False)
    assert not use_gram("standard", wide, TRITON_MATMULS, True)
    with pytest.raises(ValueError, match="ns_algorithm"):
        use_gram("fast", wide, TRITON_MATMULS, True)


class _GluonProductsBackend:
    """The GPU backend's routing facts on a Hopper GPU where the Gluon kernel runs the m×m products (on CPU
    the real backend never reports that): every product SYRK, every m×m product on the Gluon kernel."""

    name = "triton"

    def uses_syrk(self, x: torch.Tensor) -> bool:
        return True

    def uses_gluon_syrk(self, x: torch.Tensor) -> bool:
        return True


def test_auto_takes_the_gram_form_from_aspect_1_4_where_the_gluon_kernel_runs_the_products() -> None:
    backend = _GluonProductsBackend()

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    assert use_gram("auto", meta(8, 1024, 4096), backend, True)  # 2³³ per product batch: measured faster
    assert use_gram("auto", meta(2048, 8192), backend, True)
    assert use_gram("auto", meta(2048, 2868), backend, True)  # aspect 1.4
    assert not use_gram("auto", meta(2048, 2860), backend, True)  # aspect 1.396
    assert not use_gram("auto", meta(2048, 8192), backend, False)  # a schedule not validated in Gram form


def test_optimizer_option_reaches_newton_schulz() -> None:
    """Muon(ns_algorithm="gram") steps like torch.optim.Muon up to the Gram form's rounding, and not bitwise
    (so the option is not ignored); the default on CPU is bitwise."""
    torch.manual_seed(0)
    init = torch.randn(64, 192)
    grad = torch.randn(64, 192)
    results = {}
    for name, make in (
        ("torch", lambda p: torch.optim.Muon([p], lr=0.02, weight_decay=0.0)),
        ("auto", lambda p: Muon([p], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")),
        ("gram", lambda p: Muon([p], lr=0.02, weight_decay=0.0, adjust_lr_fn="original", ns_algorithm="gram")),
    ):
        p = torch.nn.Parameter(init.clone())
        opt = make(p)
        p.grad = grad.clone()
        opt.step()
        results[name] = p.detach() - init
    assert torch.equal(results["auto"], results["torch"])
    diff = ((results["gram"] - results["torch"]).norm() / results["torch"].norm()).item()
    assert 0 < diff < 0.05


def test_checkpoint_without_the_option_loads_with_auto() -> None:
    """A state dict saved before ``ns_algorithm`` existed loads, and steps exactly as a fresh optimizer."""
    torch.manual_seed(0)
    init, grad = torch.randn(32, 96), torch.randn(32, 96)
    stepped = []
    for old_checkpoint in (False, True):
        p = torch.nn.Parameter(init.clone())
        opt = Muon([p], lr=0.02)
        state = opt.state_dict()
        if old_checkpoint:
            for group in state["param_groups"]:
                del group["ns_algorithm"]
            opt.load_state_dict(state)
            assert all(g["ns_algorithm"] == "auto" for g in opt.param_groups)
        p.grad = grad.clone()
        opt.step()
        stepped.append(p.detach().clone())
    assert torch.equal(stepped[0], stepped[1]) and not torch.equal(stepped[0], init)


class LowerTileStorage(type(TORCH_MATMULS)):
    """A CPU backend that keeps the Gram chain's symmetric matrices as the GPU backend does where
    ``keeps_lower_tiles`` holds: every symmetric result is made exactly symmetric from its lower TILE×TILE
    tiles (as the SYRK kernels store it), and with ``lower`` a result asked for as ``lower_out`` has NaN in
    every upper tile, while an operand passed as ``lower_in`` is read from its lower tiles only. A chain that
    reads an upper tile it did not ask to be written, or hands the apply a matrix kept as lower tiles,
    turns its result into NaN."""

    TILE = 64

    def __init__(self, lower: bool) -> None:
        self.lower = lower
        self.lower_results = 0
        self.results = 0

    def keeps_lower_tiles(self, x: torch.Tensor) -> bool:
        return self.lower and x.size(-2) % self.TILE == 0

    def _mask(self, m: int) -> torch.Tensor:
        tiles = torch.arange(m) // self.TILE
        return tiles[:, None] >= tiles[None, :]

    def _read(self, t: torch.Tensor, lower_in: bool) -> torch.Tensor:
        return torch.where(self._mask(t.size(-1)), t, t.mT) if lower_in else t

    def _store(self, t: torch.Tensor, lower_out: bool) -> torch.Tensor:
        self.results += 1
        self.lower_results += lower_out
        whole = torch.where(self._mask(t.size(-1)), t, t.mT)
        return torch.where(self._mask(t.size(-1)), whole, torch.nan) if lower_out else whole

    def gram(self, x, scale=None, lower_out=False):
        return self._store(super().gram(x, scale), lower_out)

    def poly(self, gram, a, b, c, scale=None, lower_in=False, lower_out=False):
        return self._store(super().poly(self._read(gram, lower_in), a, b, c, scale), lower_out)

    def symmetric_product(self, x, y, scale=None, lower_in=False, lower_out=False):
        product = super().symmetric_product(self._read(x, lower_in), self._read(y, lower_in), scale)
        return self._store(product, lower_out)


@pytest.mark.parametrize("segments", [[2, 2, 1], [1, 1, 1, 1, 1], [3, 2]])
def test_a_chain_keeping_lower_tiles_reads_only_them_and_hands_the_apply_whole_matrices(segments: list[int]) -> None:
    """Where the backend keeps lower tiles, the chain asks for lower-tile results everywhere but the Q each
    segment hands the apply, and reads only lower tiles: the same bits as the chain on whole matrices (the
    symmetric results are exactly symmetric either way), no NaN, and every result but one per segment kept as
    lower tiles."""
    g = torch.randn(3, 128, 320, generator=torch.Generator().manual_seed(7), dtype=torch.float32)
    x = normalized(g)
    triples = [KELLER_COEFFICIENTS] * sum(segments)
    whole, lower = LowerTileStorage(lower=False), LowerTileStorage(lower=True)
    want = gram_newton_schulz(x, triples, whole, segments)
    got = gram_newton_schulz(x, triples, lower, segments)
    assert not got.isnan().any()
    assert torch.equal(got, want)
    assert whole.lower_results == 0
    assert lower.results == whole.results == sum(1 + length + 3 * (length - 1) for length in segments)
    assert lower.lower_results == lower.results - len(segments)
