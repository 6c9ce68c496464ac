"""A MoE expert that no token reaches has a zero gradient: its momentum, Newton–Schulz input and update stay zero.

Every front end must then leave it at its weight decay alone, θ_k = θ_0·(1 − γλ)ᵏ in the same float32 operations
(the apply's θ·(1 − γλ) − γ'·0 subtracts an exact zero, so the bits are those of the products alone), and keep
it finite: NorMuon once divided 0 by 0 in its renormalization and turned the whole parameter into NaN. The other
experts of the stack must move.
"""

from __future__ import annotations

import pytest
import torch

from dtensor_muon import KLSOAP, MOP, REKLS, SOAP, Muon, NorMuon

CASES = [
    *((front_end, dtype) for front_end in (Muon, NorMuon, MOP) for dtype in ("float32", "bfloat16", "int8")),
    *((front_end, "float32") for front_end in (SOAP, KLSOAP, REKLS)),
]


@pytest.mark.parametrize("front_end,momentum_dtype", CASES, ids=lambda v: getattr(v, "__name__", v))
def test_an_expert_without_tokens_takes_only_the_weight_decay(front_end, momentum_dtype):
    torch.manual_seed(0)
    weight_decay, steps, idle = 0.1, 3, 1
    p = torch.nn.Parameter(torch.randn(4, 16, 8))
    start = p.detach().clone()
    options = {} if momentum_dtype == "float32" else {"momentum_dtype": momentum_dtype}
    opt = front_end([("layers.0.moe.experts.w1", p)], weight_decay=weight_decay, **options)
    lr = opt.param_groups[0]["lr"]
    want = start[idle].clone()
    for _ in range(steps):
        grad = torch.randn(4, 16, 8)
        grad[idle] = 0.0
        p.grad = grad
        opt.step()
        want = want * (1 - lr * weight_decay)
    got = p.detach()
    assert torch.isfinite(got).all()
    assert torch.equal(got[idle], want)
    for expert in (0, 2, 3):  # the experts that saw tokens moved by more than the decay
        assert (got[expert] - start[expert] * (1 - lr * weight_decay) ** steps).abs().max() > 1e-3, expert
