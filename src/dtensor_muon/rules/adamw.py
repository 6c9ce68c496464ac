"""AdamW for element-wise parameters, through torch's own functional AdamW (so results equal torch.optim.AdamW:
on CUDA its fused kernel, as ``AdamW(fused=True)``; elsewhere its default implementation).

With step t, β₁, β₂, ε, learning rate γ and weight decay λ:

    θ ← θ·(1 − γλ);  m ← β₁m + (1 − β₁)g;  v ← β₂v + (1 − β₂)g²
    θ ← θ − γ · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")
MOMENTS = ("exp_avg", "exp_avg_sq")
"""The state tensors in the parameter's layout (``step`` is a host scalar)."""


def init_state(param: Tensor) -> dict[str, Tensor]:
    """Fresh AdamW state for ``param``: torch.optim.AdamW's keys, dtypes and layout."""
    return {
        "step": torch.tensor(0.0, dtype=torch.float32),
        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
    }


def step_tensor(value: float | Tensor) -> Tensor:
    """A ``step`` count as init_state makes it (checkpoints may hold a Python number: torch.optim.AdamW converts
    those on load the same way)."""
    return torch.tensor(float(value), dtype=torch.float32)


def step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step over lists of same-device tensors (local shards or whole tensors), in place.

    On CUDA it runs torch's fused AdamW (one pass over each tensor's entries; foreach takes about ten: BENCHMARKS.md
    "Whole optimizer step", fused AdamW). The step counts stay CPU tensors, as torch.optim.AdamW keeps them
    unfused: the fused kernel reads a device copy and the counts advance here."""
    if not params:
        return
    fused = all(p.is_cuda for p in params)
    steps = state_steps
    if fused:
        counts = torch.tensor([float(s) for s in state_steps]).pin_memory()  # copied without waiting on the device
        steps = list(counts.to(params[0].device, non_blocking=True).unbind(0))
    _torch_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        foreach=False if fused else None,
        fused=True if fused else None,
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
    if fused:
        torch._foreach_add_(state_steps, 1)
