"""The SYRK autotuner on the GPU (run on the GPU machine; skipped without CUDA): it times configs from CUDA
graphs on a stream of its own, which must not touch memory that work queued on the caller's stream uses."""

from __future__ import annotations

import pytest
import torch

from dtensor_muon.kernels import triton_syrk, use_backend
from dtensor_muon.linalg.newton_schulz import newton_schulz

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_autotuning_leaves_queued_work_intact():
    """Queue a plain-torch Newton–Schulz (about 9 ms of GPU work; its 4096² intermediates go back to the
    allocator on the host at once), then make the autotuner run for a new shape whose 4096² output reuses
    one of those blocks: the queued result must equal a quiet recomputation (the H200 benchmark caught
    the race: a 0.65 relative error in such a result)."""
    g = torch.randn(4096, 14336, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    x = torch.randn(4096, 6144, device="cuda", dtype=torch.bfloat16) / 80
    triton_syrk._TUNED.clear()
    triton_syrk._syrk_tuned.cache.clear()
    with use_backend("torch"):
        queued = newton_schulz(g)
    tuned = triton_syrk.syrk(x)  # a new key: the autotuner times every config now
    torch.cuda.synchronize()
    with use_backend("torch"):
        quiet = newton_schulz(g)
    assert torch.equal(queued, quiet)
    assert torch.equal(tuned, triton_syrk.syrk(x))


@pytest.mark.parametrize("m, k", [(768, 2048), (1408, 2048), (2048, 768)])
def test_every_candidate_config_gives_the_same_bits(m, k):
    """The autotuner may pick another config on another rank, or for another number of matrices in a batch;
    that is harmless only if every candidate gives the same bits. The candidates differ in tile shape, warps,
    stages and registers, never in BLOCK_K, so each entry accumulates the same products in the same order.
    Checked for Newton–Schulz's expert shapes, X·Xᵀ and C + X·Xᵀ, on 8 stacked matrices."""
    g = torch.Generator("cuda").manual_seed(1)
    x = (torch.randn(8, m, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
    c = triton_syrk.syrk(x)
    assert {shape[2] for shape in triton_syrk.SYRK_SHAPES} == {64}
    results = []
    for ratio, block_n, block_k, warps, stages, regs in triton_syrk.SYRK_SHAPES:
        config = {"RATIO": ratio, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
        if regs is not None:
            config["maxnreg"] = regs
        results.append((triton_syrk.syrk(x, config=config), triton_syrk.syrk(x, beta=0.5, c=c, config=config)))
    for product, with_c in results[1:]:
        assert torch.equal(product, results[0][0])
        assert torch.equal(with_c, results[0][1])
