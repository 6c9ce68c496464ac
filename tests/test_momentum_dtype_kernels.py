"""The stored-momentum Triton kernels (bf16 stochastic rounding, int8 blocks) against the torch operations.

On a GPU they must give the torch operations' bits exactly (so a shard's step does not depend on whether its
size took the kernel). Under the Triton interpreter (a child process with ``TRITON_INTERPRET=1``, as in
test_elementwise_kernels.py), which rounds a fused multiply-add twice, U may differ from torch's by what those
roundings move. A lerp(a, b, w) with the weight |w| ≤ 1/2 it multiplies by (ATen's two branches) rounds
d = b − a, d·w and the sum: at most ε/2·(|d|·|w| + |d·w| + |result|) ≤ 1.5 ε·M, M = max(|a|, |b|). B' is one
lerp of B and g; U = lerp(g, B', μ) adds its own 1.5 ε·M and μ ≤ 1 times B''s, so each side is within 3 ε·M of
the exact U, M = max(|B|, |g|), and the two sides within 6 ε·M. The stored buffer may differ by what that moves:
one bf16 step, or one int8 code (s) plus the scale's own rounding; the kernels' integer and rounding logic is
what the interpreter checks.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_kernels import interpreted

from dtensor_muon.kernels.elementwise import MIN_KERNEL_NUMEL
from dtensor_muon.kernels.low_precision import INT8_BLOCK, decode_int8, encode_int8
from dtensor_muon.kernels.stored_momentum import stored_momentum_step

CASES = [(0.95, True), (0.95, False), (0.3, True)]  # 0.3: the large-weight branch of the first lerp
SHAPES = [(37, 300), (5, 128), (3, 1000)]


def stored(mode: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (b.bfloat16(), None) if mode == "bfloat16" else encode_int8(b)


def decoded(buffer: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return buffer.float() if scales is None else decode_int8(buffer, scales)


def _interpreter_checks() -> dict[str, float]:
    """Per case: U's largest difference from torch's in units of ε·max(|B|, |g|), and the stored
    buffer's largest difference from torch's in units of its format's step (bf16 spacing, int8 scale)."""
    from test_kernels import _patch_interpreter_bf16

    from dtensor_muon.kernels.stored_momentum import _launch_stored_momentum, _stored_momentum_step_torch

    _patch_interpreter_bf16()
    gen = torch.Generator().manual_seed(0)
    out = {}
    for shape in SHAPES:
        g, b = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        for mode in ("bfloat16", "int8"):
            for momentum, nesterov in CASES:
                key = f"{mode}_{shape}_{momentum}_{nesterov}"
                buffer, scales = stored(mode, b)
                ref_buffer, ref_scales = buffer.clone(), None if scales is None else scales.clone()
                size = torch.maximum(decoded(buffer, scales).abs(), g.abs()).clamp_min(1e-30)  # M = max(|B|, |g|)
                ref_u = _stored_momentum_step_torch(g, ref_buffer, ref_scales, momentum, nesterov, True, True)
                u = torch.empty_like(g)
                _launch_stored_momentum(g, buffer, scales, u, momentum, nesterov, True, True)
                out[f"u_{key}"] = float(((u - ref_u).abs() / size).max() / torch.finfo(torch.float32).eps)
                got, want = decoded(buffer, scales), decoded(ref_buffer, ref_scales)
                if mode == "bfloat16":
                    step = want.abs().clamp_min(1e-30) * 2**-7
                else:
                    step = ref_scales.repeat_interleave(INT8_BLOCK, -1)[..., : shape[-1]].clamp_min(1e-30)
                out[f"buffer_{key}"] = float(((got - want).abs() / step).max())
                kept = stored(mode, b)
                _launch_stored_momentum(g, kept[0], kept[1], u, momentum, nesterov, False, True)
                out[f"kept_{key}"] = float(not torch.equal(kept[0], stored(mode, b)[0]))
    return out


@pytest.fixture(scope="module")
def interp() -> dict[str, float]:
    return interpreted(__file__, timeout=300)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", ["bfloat16", "int8"])
@pytest.mark.parametrize("momentum,nesterov", CASES)
def test_interpreted_kernels_match_torch_within_the_interpreters_roundings(interp, shape, mode, momentum, nesterov):
    key = f"{mode}_{shape}_{momentum}_{nesterov}"
    assert interp[f"u_{key}"] <= 6  # 3 ε·M a side (module docstring)
    assert interp[f"buffer_{key}"] <= 1 + 2**-10  # one format step, and the scale's rounding when it moved
    assert interp[f"kept_{key}"] == 0  # U alone leaves the buffer as it was


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@requires_cuda
@pytest.mark.parametrize("mode", ["bfloat16", "int8"])
@pytest.mark.parametrize("momentum,nesterov", CASES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(MIN_KERNEL_NUMEL // 1000 + 3, 1000), (37, 300)])  # 8 blocks a row, the last of 104
def test_gpu_kernels_give_the_torch_operations_bits(mode, momentum, nesterov, grad_dtype, shape):
    """A CUDA shard of any size (above and far below the float32 passes' MIN_KERNEL_NUMEL) takes the kernel, a
    copy of it the torch operations: the same U, buffer and scales, for a step that writes the buffer and one that
    does not."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(shape, generator=gen).to(grad_dtype).cuda()
    buffer, scales = stored(mode, torch.randn(shape, generator=gen).cuda())
    from dtensor_muon.kernels.stored_momentum import _stored_kernel_applies, _stored_momentum_step_torch

    assert _stored_kernel_applies(g, buffer, scales)  # the comparison below is kernel against torch
    for write in (True, False):
        ref = buffer.clone(), None if scales is None else scales.clone()
        mine = buffer.clone(), None if scales is None else scales.clone()
        want = _stored_momentum_step_torch(g, *ref, momentum, nesterov, write, True)
        got = stored_momentum_step(g, *mine, momentum, nesterov, write_buffer=write, want_input=True)
        assert got.dtype == grad_dtype and torch.equal(got, want), (write, float((got - want).abs().max()))
        assert torch.equal(mine[0], ref[0]), write
        assert scales is None or torch.equal(mine[1], ref[1]), write


if __name__ == "__main__":
    print(json.dumps(_interpreter_checks()))
