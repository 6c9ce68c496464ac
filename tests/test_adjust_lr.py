"""adjust_lr_fn: γ' for an A×B matrix by each name, against torch.optim.Muon's own γ' where torch has the name
and against the formula written here where it does not.

    "original"            γ' = γ·√max(1, A/B)
    "match_rms_adamw"     γ' = γ·(0.2·√max(A, B))
    "spectral_unclamped"  γ' = γ·√(A/B)          (torch.optim.Muon from torch 2.14)
"""

from __future__ import annotations

import math

import pytest
import torch

from dtensor_muon import MOP, Muon, NorMuon
from dtensor_muon.rules.muon import adjusted_lr

SHAPES = [(12, 10), (10, 12), (7, 9), (9, 7), (3, 4096), (4096, 3), (33, 33), (1, 9)]
LRS = [0.02, 0.01, 3e-4, 1e-3]
FORMULAS = {
    "original": lambda lr, a, b: lr * math.sqrt(max(1, a / b)),
    "match_rms_adamw": lambda lr, a, b: lr * (0.2 * math.sqrt(max(a, b))),
    "spectral_unclamped": lambda lr, a, b: lr * math.sqrt(a / b),
}


def torch_has(name: str) -> bool:
    """Whether this torch's torch.optim.Muon accepts ``adjust_lr_fn=name``."""
    try:
        torch.optim.Muon([torch.nn.Parameter(torch.zeros(2, 2))], adjust_lr_fn=name)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("name", list(FORMULAS))
def test_adjusted_lr_equals_torch_or_the_formula(name):
    """Exactly (==, not approx) torch's γ' where torch has the name, and the formula's float operations."""
    for lr in LRS:
        for a, b in SHAPES:
            want = FORMULAS[name](lr, a, b)
            assert adjusted_lr(lr, name, (a, b)) == want, (name, lr, a, b)
            if torch_has(name):
                from torch.optim._muon import _adjust_lr

                assert adjusted_lr(lr, name, (a, b)) == _adjust_lr(lr, name, torch.Size((a, b))), (name, lr, a, b)


def test_spectral_unclamped_is_below_lr_for_wide_matrices_and_original_for_tall():
    assert adjusted_lr(0.02, "spectral_unclamped", (3, 12)) == 0.02 * 0.5
    assert adjusted_lr(0.02, "spectral_unclamped", (48, 12)) == adjusted_lr(0.02, "original", (48, 12)) == 0.04


def run_steps(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 4) -> None:
    gen = torch.Generator().manual_seed(11)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_spectral_unclamped_muon_steps_like_torch_optim_muon(weight_decay):
    """Muon(adjust_lr_fn="spectral_unclamped") equals torch.optim.Muon bit for bit: with the same name where
    torch has it; otherwise (weight decay 0) torch.optim.Muon with "original" and lr·√(A/B) on each wide matrix
    (its "original" ratio is 1 there, so γ' = lr·√(A/B)), and the same lr on each tall one (√max(1, A/B) = √(A/B))."""
    if weight_decay and not torch_has("spectral_unclamped"):
        pytest.skip(f"torch {torch.__version__}'s Muon has no spectral_unclamped: the reference needs weight decay 0")
    lr = 0.02
    init = [
        torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate([(12, 40), (40, 12), (9, 7)])
    ]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    run_steps(Muon(ours, lr=lr, weight_decay=weight_decay, adjust_lr_fn="spectral_unclamped"), ours)
    if torch_has("spectral_unclamped"):
        reference = [torch.optim.Muon(theirs, lr=lr, weight_decay=weight_decay, adjust_lr_fn="spectral_unclamped")]
    else:
        reference = [
            torch.optim.Muon([p], lr=lr * math.sqrt(min(1.0, p.shape[0] / p.shape[1])), weight_decay=0.0)
            for p in theirs
        ]
    gen = torch.Generator().manual_seed(11)
    for _ in range(4):
        for p in theirs:
            p.grad = torch.randn(p.shape, generator=gen)
        for opt in reference:
            opt.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), (tuple(a.shape), (a - b).abs().max().item())
    unclamped_wide, original_wide = ours[0].detach(), torch.nn.Parameter(init[0].clone())
    run_steps(Muon([original_wide], lr=lr, weight_decay=weight_decay), [original_wide])
    assert not torch.equal(unclamped_wide, original_wide.detach())


def test_every_front_end_and_the_torchtitan_sections_take_it():
    p = [torch.nn.Parameter(torch.zeros(4, 8))]
    for cls, extra in ((Muon, {}), (NorMuon, {}), (MOP, {"scale": "shape"})):
        opt = cls(p, lr=0.02, adjust_lr_fn="spectral_unclamped", **extra)
        assert opt.param_groups[0]["adjust_lr_fn"] == "spectral_unclamped"
    with pytest.raises(ValueError, match="spectral_unclamped"):
        Muon(p, adjust_lr_fn="spectral")
    sections = pytest.importorskip("torchtitan_ext.sections")
    assert sections.Muon(adjust_lr_fn="spectral_unclamped").adjust_lr_fn == "spectral_unclamped"
    assert sections.MOP(scale="shape", adjust_lr_fn="spectral_unclamped").adjust_lr_fn == "spectral_unclamped"
