"""Muon's rule: momentum on the shard, Newton–Schulz on the owner, the shape-scaled update on the shard.

With momentum μ, gradient g, momentum buffer B, learning rate γ and weight decay λ:

    B ← B + (1 − μ)·(g − B)                    (``B.lerp_(g, 1 − μ)``)
    U = g + μ·(B − g)  if nesterov, else B       (``g.lerp(B, μ)``)
    O = NS(U)                                    (Newton–Schulz polar-factor approximation)
    θ ← θ·(1 − γλ) − γ'·O,   γ' = adjust_lr(γ, matrix shape)

These are exactly torch.optim.Muon's operations, so one device gives the same bits. With a param group's
``momentum_dtype`` "bfloat16" or "int8" the buffer is kept in that format (:mod:`.momentum_storage`): each step
decodes B to float32, computes B' by the same lerp and U from the float32 B' (before B' is encoded), and
encodes B' back.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.optim.optimizer import _to_scalar

from ..kernels import resolve_ns_algorithm, select_backend
from ..kernels.elementwise import momentum_step, momentum_steps
from ..kernels.stored_momentum import stored_momentum_step
from ..linalg.distributed_ns import distributed_newton_schulz
from ..linalg.newton_schulz import ns_iteration_flops, resolve_coefficients, resolve_ns_dtype
from .base import Group, MatrixCost, MatrixRule, NewtonSchulzRunner
from .momentum_storage import (
    BUFFER,
    CODES,
    MOMENTUM_KEYS,
    SCALE,
    group_momentum_dtype,
    held_format_problem,
    init_momentum_state,
    momentum_state_keys,
)

AdjustLrFn = None | str | Callable[[float, tuple[int, int]], float]
ADJUST_LR_NAMES = ("original", "match_rms_adamw", "spectral_unclamped")


def adjusted_lr(lr: float | Tensor, adjust_lr_fn: AdjustLrFn, matrix_shape: tuple[int, int]) -> float | Tensor:
    """γ' for a matrix of shape (A, B): "original" γ·√max(1, A/B), "match_rms_adamw" γ·0.2·√max(A, B),
    "spectral_unclamped" γ·√(A/B) (torch.optim.Muon's names and float operations), or a callable (γ, (A, B)) → γ'."""
    rows, cols = matrix_shape
    lr = _to_scalar(lr)  # a Tensor lr of shape [1] or [1, 1] as a 0-d tensor, as torch.optim.Muon does
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * (0.2 * math.sqrt(max(rows, cols)))
    if adjust_lr_fn == "spectral_unclamped":
        return lr * math.sqrt(rows / cols)
    if callable(adjust_lr_fn):
        return float(adjust_lr_fn(lr, (rows, cols)))
    raise ValueError(f"adjust_lr_fn: expected None, {ADJUST_LR_NAMES} or a callable, got {adjust_lr_fn!r}")


def newton_schulz_settings(group: Group) -> tuple:
    """Hashable Newton–Schulz settings of a group: (coefficients, steps, eps, dtype, algorithm)."""
    return (
        resolve_coefficients(group["ns_coefficients"]),
        int(group["ns_steps"]),
        float(group["eps"]),
        resolve_ns_dtype(group["ns_dtype"]),
        resolve_ns_algorithm(group["ns_algorithm"]),
    )


def gpu_backend_runs(dtype: torch.dtype, shape: tuple[int, int], matrices: int, device: torch.device) -> bool:
    """Whether the dispatch puts Newton–Schulz of ``matrices`` ``shape`` matrices in ``dtype`` on ``device`` on
    the GPU backend (:func:`dtensor_muon.kernels.select_backend` on a stand-in of that batch's wide shape)."""
    stand_in = torch.empty((), dtype=dtype, device=device).expand(matrices, min(shape), max(shape))
    return select_backend(stand_in).name != "torch"


class MomentumRule(MatrixRule):
    """A rule whose shard state is Muon's momentum buffer (module formula) in the group's ``momentum_dtype``:
    ``prepare`` gives U (in the direction's ``input_dtype`` where the momentum kernel writes it: the same values
    the direction reads), ``advance`` writes B'; a float32 group's shards at once take multi-tensor passes
    (:func:`momentum_steps`), the same bits."""

    shard_state_keys = MOMENTUM_KEYS

    def state_keys(self, group: Group) -> tuple[str, ...]:
        return momentum_state_keys(group_momentum_dtype(group))

    def init_shard_state(self, param: Tensor, group: Group, name: str) -> dict[str, Tensor]:
        return init_momentum_state(param, group_momentum_dtype(group), name)

    def prepare(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> Tensor:
        return momentum_pass(  # type: ignore[return-value]
            grad, shard_state, group, write_buffer=False, input_dtype=self.input_dtype(group)
        )

    def advance(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> None:
        momentum_pass(grad, shard_state, group, write_buffer=True, want_input=False)

    def prepare_and_advance(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> Tensor:
        return momentum_pass(  # type: ignore[return-value]
            grad, shard_state, group, write_buffer=True, input_dtype=self.input_dtype(group)
        )

    def prepare_many(
        self, grads: list[Tensor], shard_states: list[dict[str, Tensor]], group: Group, *, advance: bool
    ) -> list[Tensor]:
        if group_momentum_dtype(group) != "float32":
            return [momentum_pass(g, s, group, write_buffer=advance) for g, s in zip(grads, shard_states)]  # type: ignore[misc]
        buffers = [s[BUFFER] for s in shard_states]
        return momentum_steps(  # type: ignore[return-value]  (want_input: every entry is a tensor)
            grads,
            buffers,
            group["momentum"],
            group["nesterov"],
            write_buffer=advance,
            want_input=True,
            input_dtype=self.input_dtype(group),
        )

    def advance_many(self, grads: list[Tensor], shard_states: list[dict[str, Tensor]], group: Group) -> None:
        if group_momentum_dtype(group) != "float32":
            for g, s in zip(grads, shard_states):
                momentum_pass(g, s, group, write_buffer=True, want_input=False)
            return
        buffers = [s[BUFFER] for s in shard_states]
        momentum_steps(grads, buffers, group["momentum"], False, write_buffer=True, want_input=False)


def momentum_pass(
    grad: Tensor,
    shard_state: dict[str, Tensor],
    group: Group,
    *,
    write_buffer: bool,
    want_input: bool = True,
    input_dtype: torch.dtype | None = None,
) -> Tensor | None:
    """One momentum pass on a shard in the group's ``momentum_dtype``: B' written when ``write_buffer``, U
    returned when ``want_input`` (a float32 buffer's kernel writes it in ``input_dtype``: :func:`momentum_step`).
    Raises ValueError when the held state is in another format than the group's ``momentum_dtype`` says (it was
    changed after the state was created)."""
    momentum_dtype = group_momentum_dtype(group)
    problem = held_format_problem(shard_state, momentum_dtype, grad.dtype)
    if problem is not None:
        raise ValueError(problem)
    momentum, nesterov = group["momentum"], group["nesterov"] and want_input
    if momentum_dtype == "float32":
        return momentum_step(
            grad,
            shard_state[BUFFER],
            momentum,
            nesterov,
            write_buffer=write_buffer,
            want_input=want_input,
            input_dtype=input_dtype,
        )
    return stored_momentum_step(
        grad,
        shard_state[CODES if momentum_dtype == "int8" else BUFFER],
        shard_state.get(SCALE),
        momentum,
        nesterov,
        write_buffer=write_buffer,
        want_input=want_input,
    )


class MuonRule(MomentumRule):
    """Muon (see the module formula); shard state ``momentum_buffer``, no owner state."""

    name = "muon"

    def cost(self, group: Group, shape: tuple[int, int]) -> MatrixCost:
        return MatrixCost(int(group["ns_steps"]) * ns_iteration_flops(shape))

    def input_dtype(self, group: Group) -> torch.dtype:
        return resolve_ns_dtype(group["ns_dtype"])

    def stacks_units(self, group: Group, shape: tuple[int, int], unit_size: int, device: torch.device) -> bool:
        """Newton–Schulz alone is batched, so units stack off CUDA (the engine forms stacks there only when asked:
        :func:`dtensor_muon.kernels.batching.units_per_stack`) and on CUDA where the GPU backend runs the unit: its
        kernels compute each matrix of a batch alike whatever the batch count (measured: docs/kernels.md "Expert
        stacks"), while the torch backend's batched norm and products are torch's and cuBLAS's, whose
        configuration may follow the batch count."""
        return device.type != "cuda" or gpu_backend_runs(resolve_ns_dtype(group["ns_dtype"]), shape, unit_size, device)

    def direction(
        self, u: Tensor, owner_states: list[dict[str, Tensor]], group: Group, runner: NewtonSchulzRunner
    ) -> Tensor:
        return runner(u, *newton_schulz_settings(group))

    def adjusted_lr(self, group: Group, shape: tuple[int, int]) -> float | Tensor:
        return adjusted_lr(group["lr"], group["adjust_lr_fn"], shape)

    def distributed_direction(
        self, block: Tensor, long_dim: int, all_reduce: Callable[[Tensor], None], group: Group
    ) -> Tensor:
        """This rank's block of O = NS(U), U's long side split over a tensor-parallel group (``tp_mode=
        "distributed"``; the standard iteration, whatever ``ns_algorithm`` says)."""
        coefficients, steps, eps, dtype, _ = newton_schulz_settings(group)
        return distributed_newton_schulz(
            block,
            long_dim=long_dim,
            all_reduce=all_reduce,
            coefficients=coefficients,
            steps=steps,
            eps=eps,
            dtype=dtype,
        )
