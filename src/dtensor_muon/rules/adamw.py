"""AdamW for element-wise parameters, through torch's own functional AdamW (so results equal torch.optim.AdamW).

With step t, β₁, β₂, ε, learning rate γ and weight decay λ:

    θ ← θ·(1 − γλ);  m ← β₁m + (1 − β₁)g;  v ← β₂v + (1 − β₂)g²
    θ ← θ − γ · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.adamw import adamw as _torch_adamw

STATE_KEYS = ("step", "exp_avg", "exp_avg_sq")


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
    """One AdamW step over lists of same-device tensors (local shards or whole tensors), in place."""
    if not params:
        return
    _torch_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        state_steps,
        foreach=None,
        fused=None,
        amsgrad=False,
        beta1=betas[0],
        beta2=betas[1],
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
