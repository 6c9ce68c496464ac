"""Newton–Schulz product kernels: the Triton SYRK kernel under the Triton interpreter, and the dispatcher.

The kernel checks run once, in a child process started with ``TRITON_INTERPRET=1`` (the variable must be
set before triton is imported, and must not leak into the rest of the test run); the child computes
every error against float64 torch references and prints them as JSON, and the tests here assert on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version

import pytest
import torch

from dtensor_muon.kernels import (
    TORCH_MATMULS,
    select_backend,
    triton_eligible,
    use_backend,
)

Numbers = dict[str, float]


def _patch_interpreter_bf16() -> None:
    """Make Triton 3.9's interpreter do bf16 as the GPU does. It multiplies bf16 tiles as their raw uint16
    bits (widen them to fp32 first: bf16 products are exact in fp32), and it truncates fp32 → bf16 where
    the GPU rounds to nearest even."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot
    original_cast = interpreter.InterpreterBuilder.cast_impl

    def widen(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args):  # type: ignore[no-untyped-def]
        return original(self, widen(a), widen(b), d, *args)

    def cast_impl(self, src, dst_type):  # type: ignore[no-untyped-def]
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return original_cast(self, src, dst_type)

    interpreter.InterpreterBuilder.create_dot = create_dot
    interpreter.InterpreterBuilder.cast_impl = cast_impl


def _interpreter_checks() -> Numbers:
    """Runs in the child process. Max errors (abs or norm-relative) of each kernel against float64."""
    _patch_interpreter_bf16()
    from dtensor_muon.kernels.triton_matmuls import SYRK_MATMULS
    from dtensor_muon.kernels.triton_syrk import symmetric_product, syrk
    from dtensor_muon.linalg.gram import gram_newton_schulz

    torch.manual_seed(0)
    bf16, f64 = torch.bfloat16, torch.float64
    out: Numbers = {}

    def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
        return ((x.to(f64) - ref).norm() / ref.norm()).item()

    def absdiff(x: torch.Tensor, ref: torch.Tensor) -> float:
        return (x.to(f64) - ref).abs().max().item()

    # Entries in {-1, 0, 1}: every product and sum below is exact in bf16 and fp32.
    def ints(*shape: int) -> torch.Tensor:
        return torch.randint(-1, 2, shape).to(bf16)

    def gram_ref(x: torch.Tensor) -> torch.Tensor:
        return x.to(f64) @ x.to(f64).mT

    def poly_ref(a: torch.Tensor, b: float, c: float, d: float = 0.0) -> torch.Tensor:
        eye = torch.eye(a.size(-1), dtype=f64)
        return d * eye + b * a.to(f64) + c * a.to(f64) @ a.to(f64)

    # Each way of reading tiles (pointers, device-built and host-built descriptors) with square 32×32 tiles,
    # and host descriptors with 32×16 tiles (RATIO 2). Odd sizes: not multiples of the tiles.
    paths = {
        "off": ("off", {"RATIO": 1, "BLOCK_N": 32, "BLOCK_K": 32}),
        "device": ("device", {"RATIO": 1, "BLOCK_N": 32, "BLOCK_K": 32}),
        "host": ("host", {"RATIO": 1, "BLOCK_N": 32, "BLOCK_K": 32}),
        "host_ratio2": ("host", {"RATIO": 2, "BLOCK_N": 16, "BLOCK_K": 32}),
    }
    for tag, (tma, cfg) in paths.items():
        aligned = tma != "off"  # descriptors need 16-byte strides: multiples of 8 elements

        def run(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            return syrk(x, *args, tma=tma, config=cfg, **kwargs)  # noqa: B023

        def run_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return symmetric_product(x, y, tma=tma, config=cfg)  # noqa: B023

        x = torch.randn(72, 136).to(bf16) if aligned else torch.randn(70, 101).to(bf16)
        out[f"gram_random_rel_{tag}"] = rel(run(x), gram_ref(x))
        out[f"gram_random_rel_{tag}_torch"] = rel(TORCH_MATMULS.gram(x), gram_ref(x))
        a = (torch.randn(72, 72) / 8).to(bf16)
        a = ((a + a.mT) / 2).to(bf16)
        out[f"poly_random_rel_{tag}"] = rel(run(a, 1.7, -0.6, a), poly_ref(a, -0.6, 1.7))
        out[f"poly_random_rel_{tag}_torch"] = rel(TORCH_MATMULS.gram_poly(a, -0.6, 1.7), poly_ref(a, -0.6, 1.7))
        # Small integers: bit-exact, wide and transposed-view (tall storage) layouts, a·I fused.
        x = ints(72, 136) if aligned else ints(45, 77)
        out[f"gram_exact_absdiff_{tag}"] = absdiff(run(x), gram_ref(x))
        xt = ints(136, 72).mT if aligned else ints(77, 45).mT
        out[f"gram_transposed_exact_absdiff_{tag}"] = absdiff(run(xt), gram_ref(xt))
        s = ints(40, 40) if aligned else ints(39, 39)
        s = torch.tril(s) + torch.tril(s, -1).mT
        out[f"poly_exact_absdiff_{tag}"] = absdiff(run(s, 0.5, 2.0, s, diag=3.0), poly_ref(s, 2.0, 0.5, 3.0))
        # Batched == per slice (bitwise), for a contiguous batch and a transposed-view batch (K = 128:
        # the host path reads the transposed batch as one stacked matrix only when K is a multiple of 128).
        xb = torch.randn(3, 40, 128).to(bf16) if aligned else torch.randn(3, 37, 50).to(bf16)
        for name, xs in (("", xb), ("_transposed", xb.mT.contiguous().mT)):
            whole = run(xs)
            per_slice = torch.stack([run(xs[i]) for i in range(xs.size(0))])
            out[f"batched{name}_vs_slices_absdiff_{tag}"] = absdiff(whole, per_slice.to(f64))
            out[f"batched{name}_rel_{tag}"] = rel(whole, gram_ref(xs))
        ab = ints(2, 24, 24)
        ab = torch.tril(ab) + torch.tril(ab, -1).mT
        out[f"poly_batched_exact_absdiff_{tag}"] = absdiff(
            run(ab, 0.5, 2.0, ab, diag=-1.0), poly_ref(ab, 2.0, 0.5, -1.0)
        )
        out[f"exactly_symmetric_{tag}"] = float(torch.equal(whole, whole.mT))
        # X·Yᵀ for commuting symmetric X, Y (Y a polynomial in X): small integers exact, random ones within
        # bf16 rounding of float64, a batch equal to its slices; sizes 40 (host: tiles stored through
        # descriptors below the diagonal) and 39 (pointers).
        for m in (40, 39):
            r = ints(2, m, m)
            r = torch.tril(r) + torch.tril(r, -1).mT
            z = r + 2 * torch.eye(m, dtype=bf16)  # R·Z = R² + 2R: integers below 43, exact in bf16
            both = run_product(r, z)
            out[f"product_exact_absdiff_{tag}_{m}"] = absdiff(both, r.to(f64) @ z.to(f64))
            out[f"product_vs_slices_absdiff_{tag}_{m}"] = absdiff(
                both, torch.stack([run_product(r[i], z[i]) for i in range(2)]).to(f64)
            )
        r = (torch.randn(72, 72) / 8).to(bf16)
        r = torch.tril(r) + torch.tril(r, -1).mT
        z = (0.5 * r.to(f64) + r.to(f64) @ r.to(f64)).to(bf16)
        ref = r.to(f64) @ z.to(f64)
        out[f"product_random_rel_{tag}"] = rel(run_product(r, z), (ref + ref.mT) / 2)
        out[f"product_random_rel_{tag}_torch"] = rel(TORCH_MATMULS.symmetric_product(r, z), (ref + ref.mT) / 2)

    # Newton–Schulz's start X₀ = G / max(‖G‖, eps) in one pass (kernels/normalize.py), per matrix of a batch,
    # entries past one 4096-entry block (4500 per matrix), fp32 and bf16 gradients, and an all-zero matrix.
    from dtensor_muon.kernels.normalize import normalize_into

    def per_entry_rel(x: torch.Tensor, ref: torch.Tensor) -> float:
        return ((x.to(f64) - ref).abs() / ref.abs().clamp(min=1e-30)).max().item()

    for name, g in (
        ("2d", torch.randn(37, 70) * 30),
        ("batched", torch.randn(3, 50, 90) * 1e-3),
        ("bf16_input", torch.randn(2, 64, 72).to(bf16)),
    ):
        ours = torch.empty_like(g, dtype=bf16)
        normalize_into(g, ours, 1e-7)
        classic = torch.empty_like(g, dtype=bf16)
        TORCH_MATMULS.normalize_into(g, classic, 1e-7)
        rounded = g.to(bf16).to(f64)  # X̃: both starts read G rounded to the working dtype
        ref = rounded / torch.linalg.vector_norm(rounded, dim=(-2, -1), keepdim=True)
        from_cast = torch.empty_like(ours)
        normalize_into(g.to(bf16), from_cast, 1e-7)  # G as a bf16 wire delivers it
        out[f"normalize_{name}_vs_cast_input_absdiff"] = absdiff(ours, from_cast.to(f64))
        out[f"normalize_{name}_max_rel"] = per_entry_rel(ours, ref)
        out[f"normalize_{name}_max_rel_torch"] = per_entry_rel(classic, ref)
        out[f"normalize_{name}_rounded_once_fraction"] = (ours == ref.to(bf16)).double().mean().item()
        if g.ndim == 3:
            slices = torch.empty_like(ours)
            for i in range(g.size(0)):
                normalize_into(g[i], slices[i], 1e-7)
            out[f"normalize_{name}_vs_slices_absdiff"] = absdiff(ours, slices.to(f64))
    zeros = torch.empty(5, 7, dtype=bf16)
    normalize_into(torch.zeros(5, 7), zeros, 1e-7)
    out["normalize_zero_absmax"] = zeros.to(f64).abs().max().item()

    # The one-read start (cast_and_scale_into): X̃ = round(G) exactly, s = 1 / ‖G‖ per matrix in fp32.
    from dtensor_muon.kernels.normalize import cast_and_scale_into

    for name, g in (
        ("2d", torch.randn(37, 70) * 30),
        ("batched", torch.randn(3, 50, 90) * 1e-3),
        ("bf16_input", torch.randn(2, 64, 72).to(bf16)),
    ):
        cast = torch.empty_like(g, dtype=bf16)
        scale = cast_and_scale_into(g, cast, 1e-7)
        norms = torch.linalg.vector_norm(g.to(bf16).to(f64), dim=(-2, -1)).reshape(-1)
        out[f"cast_{name}_absdiff"] = absdiff(cast, g.to(bf16).to(f64))
        out[f"cast_{name}_scale_rel"] = ((scale.to(f64) * norms - 1).abs().max()).item()
        cast_of_cast = torch.empty_like(cast)
        scale_of_cast = cast_and_scale_into(g.to(bf16), cast_of_cast, 1e-7)
        out[f"cast_{name}_vs_cast_input_absdiff"] = max(
            absdiff(cast, cast_of_cast.to(f64)), absdiff(scale, scale_of_cast.to(f64))
        )
    zero_scale = torch.empty(1)  # written in place
    cast_and_scale_into(torch.zeros(5, 7), torch.empty(5, 7, dtype=bf16), 1e-7, zero_scale)
    out["cast_zero_scale_times_eps"] = zero_scale.item() * 1e-7
    # Each launch ends in its scale through ticket counters that it leaves zeroed: a second launch on the same
    # counters gives the same bits.
    from dtensor_muon.kernels.counters import _COUNTERS

    out["counters_left_zero"] = float(all(int(c.abs().sum()) == 0 for c in _COUNTERS.values()))
    g = torch.randn(3, 50, 90)
    first, again = (cast_and_scale_into(g, torch.empty_like(g, dtype=bf16), 1e-7) for _ in range(2))
    out["cast_scale_repeat_absdiff"] = absdiff(first, again.to(f64))

    # Products times a per-matrix scale s (s² for the Gram matrix), batched with a different s per matrix.
    x = torch.randn(2, 40, 72).to(bf16)
    s = torch.tensor([0.37, 5.5])
    s64 = s.to(f64).reshape(-1, 1, 1)
    cfg = {"RATIO": 1, "BLOCK_N": 32, "BLOCK_K": 32}
    a = syrk(x, config=cfg, scale=s, scale_power=2)
    out["scaled_gram_rel"] = rel(a, s64**2 * gram_ref(x))
    a = (a.to(f64) / s64**2).to(bf16)
    out["scaled_poly_rel"] = rel(
        syrk(a, -4.775, 3.4445, a, diag=2.0, config=cfg, scale=s), s64 * poly_ref(a, 3.4445, -4.775, 2.0)
    )
    z = (0.5 * a.to(f64) + a.to(f64) @ a.to(f64)).to(bf16)
    out["scaled_product_rel"] = rel(symmetric_product(a, z, config=cfg, scale=s), s64 * (a.to(f64) @ z.to(f64)))

    # Five iterations from the folded start (round(G) and s; A₀ = s²·X̃·X̃ᵀ, X₁ = (s·P₀)·X̃) on the SYRK
    # backend, standard and Gram form, against the float64 iteration from G / ‖G‖.
    from dtensor_muon.linalg.newton_schulz import in_layout_of, iterate

    schedule = [(3.4445, -4.775, 2.0315)] * 5
    for name, g in (("tall", torch.randn(96, 40) * 1e3), ("batched", torch.randn(2, 33, 64) * 1e-4)):
        start = torch.empty_like(g, dtype=bf16)
        x = in_layout_of(start, g)
        scale = SYRK_MATMULS.start_into(g, start, x, 1e-7)
        out[f"folded_{name}_has_scale"] = float(scale is not None)
        y64 = in_layout_of(g.to(f64) / torch.linalg.vector_norm(g.to(f64), dim=(-2, -1), keepdim=True), g)
        for _ in range(5):
            a64 = y64 @ y64.mT
            y64 = 3.4445 * y64 + (-4.775 * a64 + 2.0315 * a64 @ a64) @ y64
        for algorithm in ("standard", "gram"):
            folded = iterate(x, schedule, SYRK_MATMULS, algorithm, scale)
            out[f"folded_{name}_{algorithm}_rel"] = rel(folded, y64)
            out[f"folded_{name}_{algorithm}_keeps_layout"] = float(folded.stride() == x.stride())
        written = torch.empty_like(g, dtype=bf16)
        TORCH_MATMULS.start_into(g, written, in_layout_of(written, g), 1e-7)
        from_written = iterate(in_layout_of(written, g), schedule, TORCH_MATMULS, "standard")
        out[f"folded_{name}_torch_rel"] = rel(from_written, y64)

        # G already in the working dtype: the start is G itself (start_scale): the scale and five iterations
        # bit for bit those of the written start, and G left as it was.
        g16 = g.to(bf16)
        kept = g16.clone()
        written = torch.empty_like(g16)
        scale_written = SYRK_MATMULS.start_into(g16, written, in_layout_of(written, g16), 1e-7)
        scale_in_place = SYRK_MATMULS.start_scale(g16, in_layout_of(g16, g16), 1e-7)
        out[f"in_place_{name}_scale_equal"] = float(torch.equal(scale_written, scale_in_place))
        for algorithm in ("standard", "gram"):
            from_written = iterate(in_layout_of(written, g16), schedule, SYRK_MATMULS, algorithm, scale_written)
            from_g = iterate(in_layout_of(g16, g16), schedule, SYRK_MATMULS, algorithm, scale_in_place)
            out[f"in_place_{name}_{algorithm}_equal"] = float(torch.equal(from_written, from_g))
        out[f"in_place_{name}_leaves_g"] = float(torch.equal(g16, kept))
        out[f"in_place_{name}_torch_declines"] = float(
            TORCH_MATMULS.start_scale(g16, in_layout_of(g16, g16), 1e-7) is None
        )

    # The GPU backend's iteration (SYRK at every size) on a transposed view (a tall gradient): result and
    # layout; and five NS iterations against the float64 iteration, next to the torch backend's.
    g = torch.randn(100, 48)
    x = (g / g.norm()).to(bf16).mT
    stepped = SYRK_MATMULS.iteration(x, 3.4445, -4.775, 2.0315)
    a64 = x.to(f64) @ x.to(f64).mT
    out["iteration_rel"] = rel(
        stepped, (3.4445 * torch.eye(48, dtype=f64) - 4.775 * a64 + 2.0315 * a64 @ a64) @ x.to(f64)
    )
    out["iteration_keeps_layout"] = float(stepped.mT.is_contiguous() and stepped.shape == x.shape)
    for name, g in (("tall", torch.randn(96, 40)), ("batched", torch.randn(2, 33, 64))):
        y = (g / torch.linalg.vector_norm(g, dim=(-2, -1), keepdim=True)).to(bf16)
        y = y.mT if name == "tall" else y
        y64 = y.to(f64)
        for _ in range(5):
            a64 = y64 @ y64.mT
            y64 = 3.4445 * y64 + (-4.775 * a64 + 2.0315 * a64 @ a64) @ y64
        for backend in (SYRK_MATMULS, TORCH_MATMULS):
            z = y
            for _ in range(5):
                z = backend.iteration(z, 3.4445, -4.775, 2.0315)
            out[f"ns5_{name}_rel_{backend.name}"] = rel(z, y64)
            # The same five iterations in Gram form (segments of 2 + 2 + 1).
            gram_form = gram_newton_schulz(y, [(3.4445, -4.775, 2.0315)] * 5, backend, [2, 2, 1])
            out[f"gram_ns5_{name}_rel_{backend.name}"] = rel(gram_form, y64)
            out[f"gram_ns5_{name}_keeps_layout_{backend.name}"] = float(
                gram_form.shape == y.shape and gram_form.stride() == y.stride()
            )
    return out


@pytest.fixture(scope="module")
def interp() -> Numbers:
    return interpreted(__file__, timeout=600)


OLD_INTERPRETER_ERROR = "only 0-dimensional arrays can be converted to Python scalars"


def _triton_version() -> tuple[int, int]:
    major, minor = version("triton").split(".")[:2]
    return int(major), int(minor)


def interpreted(path: str, timeout: float) -> dict[str, float]:
    """The JSON numbers the test file at ``path`` prints when run as a script under the Triton interpreter
    (``TRITON_INTERPRET=1``); skips where the installed Triton's interpreter cannot run under NumPy ≥ 2.4."""
    proc = subprocess.run(
        [sys.executable, path],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0 and OLD_INTERPRETER_ERROR in proc.stderr and _triton_version() < (3, 7):
        pytest.skip(
            f"Triton {version('triton')}'s interpreter takes int() of 1-element arrays for scalar arguments, which "
            "NumPy >= 2.4 refuses; Triton 3.9 (the CI's) runs these checks"
        )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


PATHS = ("off", "device", "host", "host_ratio2")


def _close_to_torch(ours: float, torchs: float, bound: float = 1e-2) -> bool:
    """Our error against float64 is bf16 rounding, like torch's own bf16 matmuls: at most 25% more."""
    return 0 < ours <= 1.25 * torchs and torchs < bound


@pytest.mark.parametrize("path", PATHS)
def test_random_inputs_within_bf16_rounding(interp: Numbers, path: str) -> None:
    assert _close_to_torch(interp[f"gram_random_rel_{path}"], interp[f"gram_random_rel_{path}_torch"])
    assert _close_to_torch(interp[f"poly_random_rel_{path}"], interp[f"poly_random_rel_{path}_torch"])


@pytest.mark.parametrize("path", PATHS)
def test_small_integer_inputs_bit_exact(interp: Numbers, path: str) -> None:
    assert interp[f"gram_exact_absdiff_{path}"] == 0.0
    assert interp[f"poly_exact_absdiff_{path}"] == 0.0
    assert interp[f"poly_batched_exact_absdiff_{path}"] == 0.0


@pytest.mark.parametrize("path", PATHS)
def test_transposed_view_input(interp: Numbers, path: str) -> None:
    assert interp[f"gram_transposed_exact_absdiff_{path}"] == 0.0
    assert interp[f"batched_transposed_rel_{path}"] < 5e-3


@pytest.mark.parametrize("path", PATHS)
def test_batched_equals_per_slice(interp: Numbers, path: str) -> None:
    assert interp[f"batched_vs_slices_absdiff_{path}"] == 0.0
    assert interp[f"batched_transposed_vs_slices_absdiff_{path}"] == 0.0
    assert interp[f"batched_rel_{path}"] < 5e-3
    assert interp[f"exactly_symmetric_{path}"] == 1.0


def test_backend_iteration(interp: Numbers) -> None:
    assert interp["iteration_rel"] < 1e-2
    assert interp["iteration_keeps_layout"] == 1.0
    # Five bf16 iterations against the float64 iteration: bf16 rounding, compounded, as with torch.
    for name in ("tall", "batched"):
        assert _close_to_torch(
            interp[f"ns5_{name}_rel_syrk"],
            interp[f"ns5_{name}_rel_torch"],
            bound=4e-2,
        )


@pytest.mark.parametrize("path", PATHS)
def test_symmetric_product(interp: Numbers, path: str) -> None:
    for m in (40, 39):
        assert interp[f"product_exact_absdiff_{path}_{m}"] == 0.0
        assert interp[f"product_vs_slices_absdiff_{path}_{m}"] == 0.0
    assert _close_to_torch(interp[f"product_random_rel_{path}"], interp[f"product_random_rel_{path}_torch"])


def test_gram_form_on_the_syrk_backend(interp: Numbers) -> None:
    # Gram Newton–Schulz with SYRK products against the float64 standard iteration: within the bound
    # tests/test_gram_newton_schulz.py holds the torch products' Gram form to (2× the standard form's error).
    for name in ("tall", "batched"):
        assert 0 < interp[f"gram_ns5_{name}_rel_syrk"] <= 2 * interp[f"ns5_{name}_rel_torch"]
        assert 0 < interp[f"gram_ns5_{name}_rel_torch"] <= 2 * interp[f"ns5_{name}_rel_torch"]
        assert interp[f"gram_ns5_{name}_keeps_layout_syrk"] == 1.0


@pytest.mark.parametrize("name", ["2d", "batched", "bf16_input"])
def test_normalize_rounds_once(interp: Numbers, name: str) -> None:
    # One rounding of the exact X̃/‖X̃‖ (X̃ = G rounded to bf16): at most bf16's unit roundoff (2⁻⁸ relative) plus
    # the fp32 norm's error, no worse than torch's cast-then-divide (which also rounds the norm), and equal to
    # float64 rounded to bf16 almost everywhere.
    assert 0 < interp[f"normalize_{name}_max_rel"] <= 2**-8 * 1.001
    assert interp[f"normalize_{name}_max_rel"] <= interp[f"normalize_{name}_max_rel_torch"]
    assert interp[f"normalize_{name}_rounded_once_fraction"] >= 0.999
    if name != "2d":
        assert interp[f"normalize_{name}_vs_slices_absdiff"] == 0.0


@pytest.mark.parametrize("name", ["2d", "batched"])
def test_the_starts_read_g_rounded_to_the_working_dtype(interp: Numbers, name: str) -> None:
    # An fp32 G and the same G in bf16 (as the optimizer's bf16 wire delivers a matrix to its owner) give the same
    # X₀, and the same X̃ and s: the bits of a distributed step do not depend on which matrices travelled.
    assert interp[f"normalize_{name}_vs_cast_input_absdiff"] == 0.0
    assert interp[f"cast_{name}_vs_cast_input_absdiff"] == 0.0


def test_normalize_zero_matrix(interp: Numbers) -> None:
    assert interp["normalize_zero_absmax"] == 0.0


@pytest.mark.parametrize("name", ["2d", "batched", "bf16_input"])
def test_cast_and_scale_reads_g_once(interp: Numbers, name: str) -> None:
    # X̃ is G rounded once, exactly; s = 1 / ‖X̃‖_F to fp32 accuracy (fixed-order block sums).
    assert interp[f"cast_{name}_absdiff"] == 0.0
    assert interp[f"cast_{name}_scale_rel"] < 1e-6


def test_cast_and_scale_of_a_zero_matrix_is_one_over_eps(interp: Numbers) -> None:
    assert abs(interp["cast_zero_scale_times_eps"] - 1.0) < 1e-6


def test_one_launch_scales_leave_their_counters_zero(interp: Numbers) -> None:
    assert interp["counters_left_zero"] == 1.0
    assert interp["cast_scale_repeat_absdiff"] == 0.0


def test_products_times_a_per_matrix_scale(interp: Numbers) -> None:
    # s² for the Gram matrix, s for the polynomial and the symmetric product; one s per matrix of a batch.
    for product in ("gram", "poly", "product"):
        assert 0 < interp[f"scaled_{product}_rel"] < 5e-3


@pytest.mark.parametrize("name", ["tall", "batched"])
def test_folded_start_iterates_like_the_written_start(interp: Numbers, name: str) -> None:
    # G scaled by 10³ and 10⁻⁴: the scale folded into the first products keeps five iterations within
    # bf16 rounding of the float64 iteration from G / ‖G‖, like the torch backend from X₀ written.
    assert interp[f"folded_{name}_has_scale"] == 1.0
    for algorithm in ("standard", "gram"):
        assert 0 < interp[f"folded_{name}_{algorithm}_rel"] <= 2 * interp[f"folded_{name}_torch_rel"] < 5e-2
        assert interp[f"folded_{name}_{algorithm}_keeps_layout"] == 1.0


@pytest.mark.parametrize("name", ["tall", "batched"])
def test_a_start_in_the_working_dtype_is_read_in_place_with_the_same_bits(interp: Numbers, name: str) -> None:
    # start_scale: X̃ = G itself, only s computed; s and five iterations (both forms) equal those of the start
    # written by start_into bit for bit, G is not written, and the torch backend (which writes X₀) declines.
    assert interp[f"in_place_{name}_scale_equal"] == 1.0
    for algorithm in ("standard", "gram"):
        assert interp[f"in_place_{name}_{algorithm}_equal"] == 1.0
    assert interp[f"in_place_{name}_leaves_g"] == 1.0
    assert interp[f"in_place_{name}_torch_declines"] == 1.0


def test_scale_arguments_are_checked() -> None:
    from dtensor_muon.kernels.normalize import cast_and_scale_into
    from dtensor_muon.kernels.triton_syrk import syrk

    x = torch.zeros(2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scale must be a contiguous float32 tensor of 2 entries"):
        syrk(x, scale=torch.ones(3))
    with pytest.raises(ValueError, match="scale must be a contiguous float32 tensor of 2 entries"):
        syrk(x, scale=torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale_power must be 1 or 2"):
        syrk(x, scale=torch.ones(2), scale_power=3)
    with pytest.raises(ValueError, match="cast_and_scale_into: scale"):
        cast_and_scale_into(torch.zeros(2, 8, 16), x.clone(), 1e-7, torch.ones(1))
    with pytest.raises(ValueError, match=r"cast_and_scale_into: scale .* on cpu, got .* on meta"):
        cast_and_scale_into(torch.zeros(2, 8, 16), x.clone(), 1e-7, torch.ones(2, device="meta"))


def test_ws_syrk_refuses_what_it_cannot_run() -> None:
    """The warp-specialized kernel needs a Hopper GPU: on CPU the backend never picks it, and a direct call
    fails with an error naming it (its results are tested on the GPU, tests/test_ws_syrk_gpu.py)."""
    from dtensor_muon.kernels.ws_syrk import ws_syrk, ws_syrk_pays, ws_syrk_supports

    x = torch.zeros(2, 1408, 2048, dtype=torch.bfloat16)
    assert not ws_syrk_supports(x)
    assert not ws_syrk_pays(x)
    with pytest.raises(ValueError, match="ws_syrk: X and Y must meet ws_syrk_supports"):
        ws_syrk(x)


def test_torch_backend_honours_a_scale() -> None:
    # The torch backend never hands out a scale, but one passed to it means X₀ = s·x, as on the GPU backend:
    # five iterations from (round(G), s) land within bf16 rounding of those from X₀ = G / ‖G‖ written.
    from dtensor_muon.linalg.newton_schulz import iterate

    g = torch.randn(3, 24, 56, dtype=torch.float64) * 1e3
    norms = torch.linalg.vector_norm(g, dim=(-2, -1))
    written = (g / norms.reshape(-1, 1, 1)).to(torch.bfloat16)
    cast, scale = g.to(torch.bfloat16), (1 / norms).float()
    reference = g / norms.reshape(-1, 1, 1)
    for _ in range(5):
        a = reference @ reference.mT
        reference = 3.4445 * reference + (-4.775 * a + 2.0315 * a @ a) @ reference
    schedule = [(3.4445, -4.775, 2.0315)] * 5
    for algorithm in ("standard", "gram"):
        plain = iterate(written, schedule, TORCH_MATMULS, algorithm)
        folded = iterate(cast, schedule, TORCH_MATMULS, algorithm, scale)
        error = ((plain.double() - reference).norm() / reference.norm()).item()
        folded_error = ((folded.double() - reference).norm() / reference.norm()).item()
        assert 0 < folded_error <= 1.5 * error < 5e-2


def test_normalize_takes_the_kernel_only_where_it_can() -> None:
    from dtensor_muon.kernels.normalize import normalize_into, scale_cast_applies

    def meta(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device="meta")

    assert scale_cast_applies(meta(3, 40, 64), meta(3, 40, 64))
    assert not scale_cast_applies(meta(64, 40).mT, meta(40, 64))  # a transposed gradient: torch's way
    assert not scale_cast_applies(meta(40, 64), meta(64, 40))
    assert not scale_cast_applies(meta(0, 64), meta(0, 64))
    assert not scale_cast_applies(meta(1, 2**16, 2**15), meta(1, 2**16, 2**15))  # 2³¹ entries per matrix
    with pytest.raises(ValueError, match="normalize_into"):
        normalize_into(torch.zeros(4, 6), torch.zeros(6, 4), 1e-7)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4096, 512, dtype=torch.bfloat16),  # shapes that take SYRK on an H200
        lambda: torch.randn(8, 2048, 64, dtype=torch.float16),
        lambda: torch.randn(512, 4096, dtype=torch.bfloat16).mT,
    ],
)
def test_dispatcher_picks_torch_on_cpu(make: Callable[[], torch.Tensor]) -> None:
    x = make()
    assert not triton_eligible(x)
    assert select_backend(x) is TORCH_MATMULS
    with use_backend("triton"):
        assert select_backend(x) is TORCH_MATMULS


@pytest.mark.parametrize(
    ("shape", "syrk", "syrk_on_gluon", "gpu_backend"),
    [
        ((4096, 14336), True, True, True),
        ((64, 1408, 2048), True, True, True),  # SYRK measured faster from m = 1408 (64 experts)
        ((8, 1024, 4096), False, True, True),  # Triton kernel: cuBLAS products, a·I folded into P
        ((8, 768, 2048), True, True, True),  # a unit of 8 Qwen3 experts: 168 tiles, both kernels' floors
        ((4, 768, 2048), False, False, False),  # 84 tiles, and too little work for the GPU backend
        ((16, 512, 2048), False, False, True),  # below the small sides: cuBLAS
        ((2048, 8192), False, True, True),  # 136 tiles: enough for the Gluon kernel only
        ((1024, 8192), False, False, True),  # 36 tiles: too few to fill the GPU
        ((1024, 4096), False, False, False),  # too little work per product: plain torch is faster
        ((2, 4096, 4096), True, True, True),
    ],
)
def test_routing_by_shape(shape: tuple[int, ...], syrk: bool, syrk_on_gluon: bool, gpu_backend: bool) -> None:
    from dtensor_muon.kernels.dispatch import MIN_GPU_BACKEND_WORK
    from dtensor_muon.kernels.shapes import gram_work
    from dtensor_muon.kernels.triton_matmuls import syrk_floors_met, syrk_pays

    x = torch.empty(shape, device="meta")
    matrices = shape[0] if len(shape) == 3 else 1
    assert syrk_floors_met(shape[-2], matrices, gluon=False) is syrk
    assert syrk_floors_met(shape[-2], matrices, gluon=True) is syrk_on_gluon
    assert syrk_pays(x) is syrk  # off a Hopper GPU the Gluon kernel never runs the products
    assert (gram_work(x) >= MIN_GPU_BACKEND_WORK) is gpu_backend


def test_use_backend_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="use_backend"), use_backend("cublas"):
        pass


def test_import_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, dtensor_muon\n"
        "from dtensor_muon.kernels import select_backend, TORCH_MATMULS\n"
        "from dtensor_muon.linalg.newton_schulz import newton_schulz\n"
        "g = torch.randn(40, 24)\n"
        "assert select_backend(g) is TORCH_MATMULS\n"
        "print(float(torch.linalg.svdvals(newton_schulz(g).double()).min()))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 0.5 < float(proc.stdout.strip()) < 1.2


if __name__ == "__main__":
    print(json.dumps(_interpreter_checks()))
