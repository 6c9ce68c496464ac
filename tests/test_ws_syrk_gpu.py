"""The warp-specialized Hopper SYRK kernel (``kernels/ws_syrk``) on the GPU: skipped without a Hopper GPU and
Gluon (CPU CI never runs it; the Triton interpreter cannot run Gluon). Each test asserts against an
independent reference: fp32/fp64 products, exact integer arithmetic, per-slice results, or the Triton kernel
within bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from dtensor_muon.kernels.ws_syrk import ws_syrk, ws_syrk_enabled, ws_syrk_pays, ws_syrk_supports
from dtensor_muon.linalg.newton_schulz import newton_schulz


def _hopper_with_gluon() -> bool:
    if not torch.cuda.is_available():
        return False
    probe = torch.empty(128, 128, device="cuda", dtype=torch.bfloat16)
    return ws_syrk_supports(probe)


pytestmark = pytest.mark.skipif(not _hopper_with_gluon(), reason="needs a Hopper GPU and Triton's Gluon")


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", [(512, 384), (304, 200), (1000, 776), (3, 1408, 2048)])
def test_gram_matches_fp64_and_is_exactly_symmetric(shape):
    x = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    out = ws_syrk(x)
    ref = x.double() @ x.double().mT
    assert _rel_err(out, ref) < 4e-3  # one bf16 rounding of the output: about 2⁻⁹ relative
    assert torch.equal(out, out.mT)
    assert torch.equal(out, ws_syrk(x))  # deterministic


def test_small_integers_are_exact():
    """Entries in {-1, 0, 1}, k = 64: every product, sum, scale 2⁻¹ and diagonal is exact in fp32 and bf16."""
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randint(-1, 2, (2, 264, 64), device="cuda", generator=gen).bfloat16()
    c = x.float() @ x.float().mT
    scale = torch.tensor([0.5, 0.25], device="cuda")
    out = ws_syrk(x, None, 2.0, -1.0, c.bfloat16(), 3.0, scale, 2)
    ref = scale.view(2, 1, 1) ** 2 * (2.0 * c - c + 3.0 * torch.eye(264, device="cuda"))
    assert torch.equal(out.float(), ref)


def test_batched_equals_per_slice_and_transposed_view_matches():
    gen = torch.Generator("cuda").manual_seed(3)
    storage = torch.randn(4, 2048, 1408, device="cuda", generator=gen).bfloat16()
    x = storage.mT  # [4, 1408, 2048], a transposed view: read in place
    out = ws_syrk(x)
    for b in range(4):
        assert torch.equal(out[b], ws_syrk(x[b]))
    dense = ws_syrk(x.contiguous())
    assert _rel_err(out, dense.double()) < 1e-6  # same sums, other load layout


def test_symmetric_product_with_scale_matches_fp64():
    gen = torch.Generator("cuda").manual_seed(4)
    a = torch.randn(2, 1408, 1408, device="cuda", generator=gen)
    a = ((a + a.mT) / 64).bfloat16()
    y = (2.0 * a.double() + a.double() @ a.double()).bfloat16()  # a polynomial in a: a·yᵀ is symmetric
    scale = torch.tensor([0.7, 1.3], device="cuda")
    out = ws_syrk(a, y, scale=scale)
    ref = scale.double().view(2, 1, 1) * (a.double() @ y.double().mT)
    assert _rel_err(out, ref) < 4e-3
    assert torch.equal(out, out.mT)


def test_bad_scale_is_rejected_by_name():
    x = torch.randn(256, 256, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="ws_syrk: scale must be a contiguous float32 tensor of 1 entries"):
        ws_syrk(x, scale=torch.ones(2, device="cuda"))


@pytest.mark.parametrize(
    "shape", [(4096, 14336), (64, 2048, 1408), (4096, 4096), (8, 1024, 4096), (2048, 5632), (2048, 2048)]
)
def test_newton_schulz_agrees_with_the_triton_kernel(shape):
    """The whole iteration with the kernel on and off (shapes where the backend takes it): within bf16
    rounding of each other (on the H200 the large ones gave the same bits). On the last three the kernel also
    changes the route: SYRK where it would be cuBLAS, and on the first two the Gram form."""
    g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    wide = g.mT if g.size(-2) > g.size(-1) else g
    assert ws_syrk_pays(wide.bfloat16())
    with ws_syrk_enabled(True):
        fast = newton_schulz(g)
    with ws_syrk_enabled(False):
        plain = newton_schulz(g)
    assert _rel_err(fast, plain.double()) < 2e-2
    s_fast = torch.linalg.svdvals(fast.double())
    s_plain = torch.linalg.svdvals(plain.double())
    assert (s_fast.max() - s_plain.max()).abs().item() < 0.02
    assert (s_fast.min() - s_plain.min()).abs().item() < 0.02


def test_small_products_stay_on_the_triton_kernel():
    """Below WS_MIN_WORK (2³¹) multiply-adds the backend keeps the Triton kernel; 1024×2048 (2³¹) takes this one."""
    small = torch.randn(1024, 1024, device="cuda").bfloat16()
    assert ws_syrk_supports(small)
    assert not ws_syrk_pays(small)
    assert ws_syrk_pays(torch.randn(1024, 2048, device="cuda").bfloat16())


def test_the_gluon_kernel_brings_the_syrk_and_gram_floors_down():
    """Where the Gluon kernel runs the m×m products (B·m³ ≥ 2³¹ on a Hopper GPU) the backend takes SYRK from m = 768
    and 136 tiles and the Gram form from aspect 1.4; with the kernel off, the Triton kernel's floors hold (a unit
    of 8 768-wide experts keeps SYRK there, on the Triton kernel's small-side floor)."""
    from dtensor_muon.kernels import use_gram
    from dtensor_muon.kernels.triton_matmuls import TRITON_MATMULS

    for shape in [(8, 1024, 4096), (2048, 8192), (8, 768, 2048)]:
        x = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        assert TRITON_MATMULS.uses_gluon_syrk(x) and use_gram("auto", x, TRITON_MATMULS, True)
        with ws_syrk_enabled(False):
            assert TRITON_MATMULS.uses_syrk(x) is (shape == (8, 768, 2048))
    small = torch.empty(1024, 8192, device="cuda", dtype=torch.bfloat16)  # 2³⁰ per product, 36 tiles
    assert not TRITON_MATMULS.uses_syrk(small)


def test_direct_launches_give_the_jit_launch_bits():
    """After a variant's first launch through Triton's JIT, ws_syrk launches the compiled kernel directly. On
    sizes that launch did not see (m and k off multiples of 16, a batch) the result must have the bits of a
    fresh JIT launch and match fp64."""
    from dtensor_muon.kernels import ws_syrk as ws

    gen = torch.Generator("cuda").manual_seed(6)
    inputs = [
        torch.randn(shape, device="cuda", generator=gen).bfloat16()
        for shape in [(512, 384), (1000, 776), (2, 264, 200)]
    ]
    ws._COMPILED.clear()
    direct = [ws_syrk(x, None, 1.5, 0.0, None, 0.5) for x in inputs]  # the first compiles, the others launch directly
    for x, out in zip(inputs, direct):
        ws._COMPILED.clear()
        assert torch.equal(out, ws_syrk(x, None, 1.5, 0.0, None, 0.5))
        eye = torch.eye(x.size(-2), device="cuda", dtype=torch.float64)
        assert _rel_err(out, 1.5 * x.double() @ x.double().mT + 0.5 * eye) < 4e-3


def test_c_in_another_dtype_goes_to_the_triton_kernel_or_is_rejected_by_name(monkeypatch):
    from dtensor_muon.kernels import ws_syrk as ws

    monkeypatch.setattr(ws, "WS_MIN_WORK", 0)  # let the dispatch consider a small product
    x = torch.randn(512, 512, device="cuda").bfloat16() / 16
    c = torch.randn(512, 512, device="cuda")
    c = c + c.mT
    assert ws_syrk_pays(x) and ws_syrk_pays(x, None, c.bfloat16())
    assert not ws_syrk_pays(x, None, c)  # fp32: its bf16 TMA descriptor cannot read it
    with pytest.raises(ValueError, match="ws_syrk: C must have X's batch, be 512×512 in X's dtype"):
        ws_syrk(x, None, 1.0, 1.0, c)


def _lower_tiles_only(full: torch.Tensor) -> torch.Tensor:
    """A copy of the symmetric stack with NaN in every 128×128 tile above the diagonal."""
    tiles = torch.arange(full.size(-1), device=full.device) // 128
    return torch.where(tiles[:, None] >= tiles[None, :], full, torch.nan)


@pytest.mark.parametrize("m", [256, 768])
def test_lower_tile_operands_give_the_whole_operands_lower_tiles_bit_for_bit(m):
    """Products and the poly of symmetric stacks kept as lower tiles (NaN above) equal, in every lower tile,
    the same products of the whole stacks bit for bit (the same sums in the same order); the poly's C is the
    lower-tile stack too. With ``lower_out`` only the upper tiles are left unwritten."""
    from dtensor_muon.kernels.ws_syrk import ws_syrk_supported

    gen = torch.Generator("cuda").manual_seed(11)
    r = ws_syrk(torch.randn(8, m, 2 * m, device="cuda", generator=gen).bfloat16() / m)
    z = ws_syrk(torch.randn(8, m, 2 * m, device="cuda", generator=gen).bfloat16() / m)
    rl, zl = _lower_tiles_only(r), _lower_tiles_only(z)
    tiles = torch.arange(m, device="cuda") // 128
    lower = tiles[:, None] >= tiles[None, :]
    scale = torch.linspace(0.5, 2.0, 8, device="cuda")
    for whole_args, lower_args, kwargs in [
        ((r, z), (rl, zl), {"scale": scale}),
        ((r, None), (rl, None), {"alpha": 2.0315, "beta": -4.775, "diag": 3.4445}),
    ]:
        kwargs_c = {**kwargs, "c": whole_args[0]} if "beta" in kwargs else kwargs
        want = ws_syrk_supported(*whole_args, **kwargs_c)
        lower_c = {**kwargs, "c": lower_args[0]} if "beta" in kwargs else kwargs
        for lower_out in (False, True):
            got = ws_syrk_supported(*lower_args, **lower_c, lower_in=True, lower_out=lower_out)
            assert torch.equal(got[:, lower], want[:, lower])
            if not lower_out:
                assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(16, 768, 2048), (16, 2048, 768), (4, 1024, 3072)])
def test_a_gram_chain_on_lower_tiles_gives_the_whole_chains_bits(shape):
    """Newton–Schulz in Gram form where the chain keeps lower tiles equals, bit for bit, the same call with
    whole intermediates (the backend told not to keep lower tiles)."""
    from dtensor_muon.kernels.triton_matmuls import TritonMatmuls
    from dtensor_muon.linalg.gram import gram_newton_schulz
    from dtensor_muon.linalg.newton_schulz import KELLER_COEFFICIENTS, gram_segments, normalized_start

    class WholeMatrices(TritonMatmuls):
        def keeps_lower_tiles(self, x):
            return False

    g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).bfloat16()
    _, x, backend, scale = normalized_start(g, torch.bfloat16, 1e-7)
    assert backend.keeps_lower_tiles(x)
    triples = [KELLER_COEFFICIENTS] * 5
    got = gram_newton_schulz(x, triples, backend, gram_segments(5), scale)
    want = gram_newton_schulz(x, triples, WholeMatrices(), gram_segments(5), scale)
    assert torch.equal(got, want)
