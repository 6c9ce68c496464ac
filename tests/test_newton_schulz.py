"""Newton–Schulz against float64 SVD and against torch.optim.Muon's implementation."""

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz

from dtensor_muon.linalg.newton_schulz import (
    NAMED_COEFFICIENTS,
    coefficients_at,
    newton_schulz,
    polar_factor,
    resolve_coefficients,
    resolve_ns_dtype,
)


def singular_values(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.svdvals(x.to(torch.float64))


@pytest.mark.parametrize(
    "name, dtype, band",
    [
        # FACTS.md: on a Gaussian matrix Keller NS5 lands in about [0.68, 1.15], Polar Express 5 in [0.85, 1.13].
        ("simple", torch.bfloat16, (0.65, 1.16)),
        ("simple", torch.float32, (0.65, 1.16)),
        ("quintic", torch.float32, (0.95, 1.05)),
        ("polar_express", torch.bfloat16, (0.85, 1.14)),
        ("polar_express", torch.float32, (0.85, 1.13)),
        ("cans", torch.float32, (0.85, 1.13)),
    ],
)
def test_singular_values_land_in_band_of_coefficient_set(name, dtype, band):
    g = torch.randn(256, 1024, generator=torch.Generator().manual_seed(1))
    sigma = singular_values(newton_schulz(g, name, 5, dtype=dtype))
    assert band[0] <= sigma.min() and sigma.max() <= band[1], (float(sigma.min()), float(sigma.max()))


def test_polar_express_8_steps_beats_simple_5_on_ill_conditioned_matrix():
    gen = torch.Generator().manual_seed(2)
    u, _ = torch.linalg.qr(torch.randn(128, 128, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(256, 128, generator=gen, dtype=torch.float64))
    s = torch.logspace(0, -3, 128, dtype=torch.float64)  # condition number 1e3
    g = (u * s) @ v.T
    exact = polar_factor(g)
    err_simple = torch.linalg.matrix_norm(newton_schulz(g, "simple", 5, dtype=torch.float32).double() - exact)
    err_pe = torch.linalg.matrix_norm(newton_schulz(g, "polar_express", 8, dtype=torch.float32).double() - exact)
    assert err_pe < 0.5 * err_simple, (float(err_pe), float(err_simple))


@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (33, 33), (1, 17)])
def test_equals_torch_optim_muon_bitwise(shape):
    g = torch.randn(shape)
    ours = newton_schulz(g)
    theirs = _zeropower_via_newtonschulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("shape", [(6, 20, 12), (3, 12, 20)])
def test_batched_equals_per_slice(shape):
    g = torch.randn(shape)
    batched = newton_schulz(g, "polar_express", 6)
    per_slice = torch.stack([newton_schulz(x, "polar_express", 6) for x in g])
    torch.testing.assert_close(batched.float(), per_slice.float(), rtol=0, atol=2e-2)
    assert batched.shape == g.shape


def test_tall_and_wide_give_transposed_results():
    g = torch.randn(24, 40)
    torch.testing.assert_close(newton_schulz(g.T.contiguous()).float(), newton_schulz(g).T.float(), rtol=0, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_working_dtype_is_output_dtype_and_fp32_is_more_accurate(dtype):
    g = torch.randn(32, 64)
    out = newton_schulz(g, "polar_express", 10, dtype=dtype)
    assert out.dtype == dtype
    err = (singular_values(out) - 1).abs().max()
    tol = {torch.float32: 0.02, torch.float16: 0.05, torch.bfloat16: 0.12}[dtype]
    assert err < tol


def test_input_is_not_modified_and_zero_input_stays_finite():
    g = torch.randn(8, 16, dtype=torch.bfloat16)
    copy = g.clone()
    newton_schulz(g)
    assert torch.equal(g, copy)
    assert torch.isfinite(newton_schulz(torch.zeros(8, 16))).all()


def test_polar_factor_is_orthogonal_and_matches_definition():
    g = torch.randn(20, 30, dtype=torch.float64)
    q = polar_factor(g)
    torch.testing.assert_close(q @ q.T, torch.eye(20, dtype=torch.float64))
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    torch.testing.assert_close(q, u @ vh)


def test_coefficient_specs():
    assert resolve_coefficients("simple") == ((3.4445, -4.775, 2.0315),)
    assert resolve_coefficients((1, 2, 3)) == ((1.0, 2.0, 3.0),)
    sched = resolve_coefficients([(1, 2, 3), (4, 5, 6)])
    assert coefficients_at(sched, 0) == (1.0, 2.0, 3.0)
    assert coefficients_at(sched, 7) == (4.0, 5.0, 6.0)
    assert len(NAMED_COEFFICIENTS["polar_express"]) == 8


def test_schedule_uses_triple_i_then_repeats_last():
    g = torch.randn(16, 32)
    sched = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5)]
    x = g.double() / torch.linalg.matrix_norm(g.double())
    for a, b, c in [sched[0], sched[1], sched[1]]:  # independent float64 reference of the polynomial
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    torch.testing.assert_close(newton_schulz(g, sched, 3, dtype=torch.float32).double(), x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", ["nope", (1.0, 2.0), [], [(1, 2, 3), (1, 2)], "", ("a", "b", "c")])
def test_bad_coefficients_raise(bad):
    with pytest.raises(ValueError, match="ns_coefficients"):
        resolve_coefficients(bad)


def test_bad_dtype_and_shape_raise():
    with pytest.raises(ValueError, match="ns_dtype"):
        resolve_ns_dtype("float64")
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.randn(4))
