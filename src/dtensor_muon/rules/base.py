"""The rule protocol: the per-matrix math of one matrix optimizer, in the three places it runs.

A step of a matrix rule on one matrix W (a 2-D parameter, one expert, or one view of a fused parameter):

1. ``prepare`` on each rank's shard, element-wise: reads the gradient and the **shard state** (e.g. the
   momentum buffer, kept in the parameter's layout), returns the matrix input U (a shard of it) without
   changing the state; ``advance`` writes the state's change once the step is known to succeed everywhere;
2. ``direction`` on the matrix's owner, on the whole U (a batch of same-key matrices ``[B, m, n]`` or one
   ``[m, n]``): returns the direction O and may read and write the **owner state** of each matrix (state
   that only makes sense whole, kept on the owner and saved under the matrix's name; the engine hands it
   a copy when other ranks could still fail, and keeps the copy only if every rank succeeds);
3. ``apply_many`` on each rank's shards, element-wise: θ ← θ·(1 − γλ) − γ'·O with the scalars captured at
   step time by ``scalars`` (γ' per matrix: a fused parameter's views may have different shapes).

A rule also declares: whether its ``direction`` may run on a batch (``can_batch``: same-shape matrices of
one parameter, which share its group's settings, are then stacked where that pays), its ``cost`` (FLOPs of ``direction`` and owner-state bytes, which the plan balances), and ``input_dtype``
(the dtype the owner's input must not be rounded below: the transport's wire dtype is checked against it).
The engine calls only these methods and never names a rule.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _to_scalar

from ..kernels.elementwise import decay_and_add_, decay_and_add_many, decay_and_add_with_norms_

Group = dict[str, Any]
NewtonSchulzRunner = Callable[..., Tensor]


@dataclass(frozen=True)
class MatrixCost:
    """What one matrix costs its owner per step: FLOPs of ``direction``, bytes of owner state kept, and the
    work the plan balances where it is not the FLOPs: ``balance_flops``, the direction's time expressed as
    FLOPs at the rate of a TF32 matrix product, for a rule whose operations run at very different rates (a
    float32 Cholesky factorization runs many times slower per FLOP than a TF32 product)."""

    flops: int
    owner_state_bytes: int = 0
    balance_flops: int | None = None
    batch_flops: int = 0
    """Planned cost (as ``balance_flops``) of a fixed time that the matrices computed together as one unit
    share: the plan counts it once per unit."""

    @property
    def planned(self) -> int:
        """What the plan balances: ``balance_flops`` where given, else ``flops``."""
        return self.flops if self.balance_flops is None else self.balance_flops

    def plan_entry(self) -> tuple[int, int, int]:
        """(planned cost, owner-state bytes, cost shared per unit): what ``build_plan``'s ``cost_fn`` returns."""
        return self.planned, self.owner_state_bytes, self.batch_flops


@dataclass(frozen=True)
class ApplyScalars:
    """The scalars of one parameter's ``apply``, read from its group when the step ran: γ, λ, and (γ', box
    slices relative to the local shard or None for the whole shard) per region with its own γ'."""

    lr: float | Tensor
    weight_decay: float | Tensor
    regions: tuple[tuple[tuple[slice, ...] | None, float | Tensor], ...]


class MatrixRule(ABC):
    """One matrix optimizer's math (see the module docstring). Subclasses are stateless; state lives in dicts."""

    name: str
    """Short name used in metric keys and messages (``"muon"``)."""

    shard_state_keys: tuple[str, ...] = ()
    """Every key of the state :meth:`init_shard_state` may create (in the parameter's layout)."""

    has_owner_state: bool = False
    """Whether :meth:`init_owner_state` creates any state."""

    host_owner_state_keys: tuple[str, ...] = ()
    """Owner-state entries kept in host memory whatever the parameter's device (a step count the direction reads
    on the host: no device sync, as torch.optim keeps Adam's ``step``); loading a state dict puts them there too."""

    def state_keys(self, group: Group) -> tuple[str, ...]:
        """The shard-state keys of a parameter of ``group`` (those of :attr:`shard_state_keys` its settings use)."""
        return self.shard_state_keys

    def init_shard_state(self, param: Tensor, group: Group, name: str) -> dict[str, Tensor]:
        """Fresh shard state of parameter ``name`` of ``group`` (DTensor parameters get DTensors in the same
        layout)."""
        return {key: torch.zeros_like(param) for key in self.state_keys(group)}

    def init_owner_state(self, shape: tuple[int, int], group: Group, device: torch.device) -> dict[str, Tensor]:
        """Fresh owner state of one ``shape`` matrix (none by default)."""
        return {}

    def stacks_units(self, group: Group, shape: tuple[int, int], unit_size: int, device: torch.device) -> bool:
        """Whether units of ``unit_size`` ``shape`` matrices may be computed several in one call
        (:mod:`dtensor_muon.engine.stacks`): only where ``direction`` gives each matrix of a batch the bits it gets
        in its unit alone when the dispatch decides as for the unit
        (:func:`dtensor_muon.kernels.shapes.decide_as_batch`). No rule's units stack by default."""
        return False

    def can_batch(self, group: Group) -> bool:
        """Whether ``direction`` may take several same-shape matrices of a parameter as one [B, m, n] batch."""
        return True

    @abstractmethod
    def cost(self, group: Group, shape: tuple[int, int]) -> MatrixCost:
        """Cost of ``direction`` on one ``shape`` matrix and the bytes of its owner state."""

    @abstractmethod
    def input_dtype(self, group: Group) -> torch.dtype:
        """The dtype the owner's input is first used in (the wire must not round below it)."""

    @abstractmethod
    def prepare(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> Tensor:
        """U on a shard, from the shard state as it was before the step (which it must not change)."""

    @abstractmethod
    def advance(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> None:
        """The step's change of the shard state, in place, once every rank's directions succeeded: the same
        operations :meth:`prepare` ran out of place, so the state takes the bits U was computed from."""

    def prepare_and_advance(self, grad: Tensor, shard_state: dict[str, Tensor], group: Group) -> Tensor:
        """:meth:`prepare` and :meth:`advance` at once, for a step that keeps whatever it computes (one
        process); a rule may fuse them (fewer passes over the state), giving the same bits."""
        u = self.prepare(grad, shard_state, group)
        self.advance(grad, shard_state, group)
        return u

    def prepare_many(
        self, grads: list[Tensor], shard_states: list[dict[str, Tensor]], group: Group, *, advance: bool
    ) -> list[Tensor]:
        """:meth:`prepare` (``advance``: :meth:`prepare_and_advance`) on several shards of one group at once; a
        rule may run them as multi-tensor operations (fewer launches), giving the same bits."""
        step = self.prepare_and_advance if advance else self.prepare
        return [step(g, s, group) for g, s in zip(grads, shard_states)]

    def advance_many(self, grads: list[Tensor], shard_states: list[dict[str, Tensor]], group: Group) -> None:
        """:meth:`advance` on several shards of one group at once (the same bits)."""
        for g, s in zip(grads, shard_states):
            self.advance(g, s, group)

    @abstractmethod
    def direction(
        self, u: Tensor, owner_states: list[dict[str, Tensor]], group: Group, runner: NewtonSchulzRunner
    ) -> Tensor:
        """O for ``u`` ([m, n], or [B, m, n] with one owner-state dict per matrix); ``runner`` runs Newton–Schulz
        with :func:`dtensor_muon.linalg.newton_schulz.newton_schulz`'s signature (the owner's CUDA-graph cache). Call
        it at most once per direction: its result may be a buffer that its next call overwrites."""

    @abstractmethod
    def adjusted_lr(self, group: Group, shape: tuple[int, int]) -> float | Tensor:
        """γ' of a ``shape`` matrix under this group's settings."""

    def scalars(self, group: Group, regions: list[tuple[tuple[slice, ...] | None, tuple[int, int]]]) -> ApplyScalars:
        """The apply scalars of a parameter whose local shard has these (slices, matrix shape) regions."""
        return ApplyScalars(
            group["lr"], group["weight_decay"], tuple((sl, self.adjusted_lr(group, shape)) for sl, shape in regions)
        )

    def apply_many(self, params: list[Tensor], updates: list[Tensor], scalars: list[ApplyScalars]) -> None:
        """θ ← θ·(1 − γλ) − γ'·O in place on several shards (each region with its own γ'): the regions of every
        shard whose regions tile it as one :func:`decay_and_add_many` (multi-tensor passes over the small ones),
        the others region by region."""
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        decays: list[float | Tensor] = []
        alphas: list[float | Tensor] = []
        for param, update, s in zip(params, updates, scalars):
            decay = 1 - _to_scalar(s.lr) * s.weight_decay
            pieces = [(param, update) if sl is None else (param[sl], update[sl]) for sl, _ in s.regions]
            if sum(target.numel() for target, _ in pieces) == param.numel():  # the regions tile the shard
                for (target, source), (_, lr_adjusted) in zip(pieces, s.regions):
                    targets.append(target)
                    sources.append(source)
                    decays.append(decay)
                    alphas.append(-_to_scalar(lr_adjusted))
                continue
            param.mul_(decay)
            for (target, source), (_, lr_adjusted) in zip(pieces, s.regions):
                target.add_(source, alpha=-_to_scalar(lr_adjusted))
        decay_and_add_many(targets, sources, decays, alphas)

    def apply_region(
        self, target: Tensor, update: Tensor, group: Group, shape: tuple[int, int], *, return_norms: bool = False
    ) -> Tensor | None:
        """:meth:`apply_many` on one region of ``shape`` matrices alone (the same element-wise operations, so the
        same bits). ``return_norms``: also returns ‖O_b‖_F (float32) of each matrix of the region where the
        apply's own pass computes them (:func:`decay_and_add_with_norms_`), else None (the caller takes them)."""
        decay, alpha = self.region_factors(group, shape)
        if not return_norms:
            decay_and_add_(target, update, decay, alpha)
            return None
        return decay_and_add_with_norms_(target, update, decay, alpha, update.numel() // (shape[0] * shape[1]))

    def region_factors(self, group: Group, shape: tuple[int, int]) -> tuple[float | Tensor, float | Tensor]:
        """(1 − γλ, −γ') of a ``shape`` matrix's apply under this group's settings now."""
        return 1 - _to_scalar(group["lr"]) * group["weight_decay"], -_to_scalar(self.adjusted_lr(group, shape))
