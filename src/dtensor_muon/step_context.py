"""What the strategies of one step share: the rule, the parameters, their inputs U and outputs O.

The engine builds one :class:`StepContext` per step; each strategy (:mod:`dtensor_muon.strategies`) reads
the prepared inputs from it, computes its units with :meth:`StepContext.compute` (the rule's ``direction``
on whole matrices, batched as the plan's units say), and writes each parameter's received update with
:meth:`StepContext.write_update` or applies a fully local parameter's update at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from .exchange import MeshGroup
from .layout import ParamLayout
from .metrics import PhaseTimer, StepStats
from .plan import MatrixSpec, Plan
from .rules.base import ApplyScalars, MatrixRule, NewtonSchulzRunner
from .views import MatrixSplit

OWNER_STATE_KEY = "owner_state"
"""Key of a parameter's optimizer state that holds its matrices' owner state: ``{matrix key: {name: tensor}}``."""


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Entry:
    """One parameter as the engine sees it; ``regions``: (slices in the local shard or None, matrix shape)
    of each part of the local shard with its own γ' (one region, None, when every matrix has one shape)."""

    index: int
    name: str
    param: Tensor
    group: dict[str, Any]
    use_muon: bool
    layout: ParamLayout
    split: MatrixSplit | None = None
    regions: list[tuple[tuple[slice, ...] | None, tuple[int, int]]] = field(default_factory=list)


@dataclass
class MeshWork:
    """The matrix-rule parameters of one mesh, their plan and the group their exchanges run on."""

    mesh: Any
    entries: list[Entry]
    plan: Plan
    comm: MeshGroup
    wire_dtype: torch.dtype
    fully_local: set[int] = field(default_factory=set)
    """Parameters all of whose matrices are local here: computed in chunks and applied at once, no buffers."""


class StepContext:
    """One step's shared data (see the module docstring)."""

    def __init__(
        self,
        rule: MatrixRule,
        entries: list[Entry],
        state: dict[Tensor, dict[str, Any]],
        grads: dict[int, Tensor | None],
        active: set[int],
        stats: StepStats,
        timer: PhaseTimer,
        runner: NewtonSchulzRunner,
        bucket_bytes: int,
    ) -> None:
        self.rule = rule
        self.entries = entries
        self.state = state
        self.grads = grads
        self.active = active
        self.stats = stats
        self.timer = timer
        self.runner = runner
        self.bucket_bytes = bucket_bytes
        self.inputs: dict[int, Tensor] = {}
        self.updates: dict[int, Tensor] = {}
        self.scalars: dict[int, ApplyScalars] = {}

    def prepare(self, e: Entry) -> Tensor:
        """U on this rank's shard of parameter ``e`` (updating its shard state in place)."""
        g = self.grads[e.index]
        grad = local(g) if g is not None else torch.zeros_like(local(e.param))
        shard_state = {key: local(self.state[e.param][key]) for key in self.rule.shard_state_keys}
        return self.rule.prepare(grad, shard_state, e.group)

    def owner_state(self, spec: MatrixSpec) -> dict[str, Tensor]:
        """The owner state of one matrix ({} for rules without owner state)."""
        held = self.state[self.entries[spec.param_index].param].get(OWNER_STATE_KEY)
        return held[spec.key] if held is not None else {}

    def compute(self, jobs: list[tuple[MatrixSpec, Tensor]]) -> list[Tensor]:
        """The rule's direction for one unit's matrices (inputs of any shape holding ``spec.shape`` elements),
        stacked into one batch when there are several; returns O per job, shaped ``spec.shape``."""
        if not jobs:
            return []
        first = self.entries[jobs[0][0].param_index]
        mats = [u.reshape(spec.shape) for spec, u in jobs]
        stacked = mats[0] if len(mats) == 1 else torch.stack(mats)
        states = [self.owner_state(spec) for spec, _ in jobs]
        out = self.rule.direction(stacked, states, first.group, self.runner)
        outs = [out] if len(mats) == 1 else list(out.unbind(0))
        for (spec, _), o in zip(jobs, outs):
            e = self.entries[spec.param_index]
            self.stats.add_flops(self.rule.cost(e.group, spec.shape).flops)
            self.stats.add_orthogonal(o, self.rule.adjusted_lr(e.group, spec.shape), spec.name)
        return outs

    def input_itemsize(self, spec: MatrixSpec) -> int:
        """Bytes per element of a matrix's input where its direction runs."""
        return self.rule.input_dtype(self.entries[spec.param_index].group).itemsize

    def apply_local(self, e: Entry, target: Tensor, o: Tensor, shape: tuple[int, int]) -> None:
        """Apply one matrix's update to its region ``target`` of a fully local parameter, at once."""
        self.rule.apply_region(target, o.reshape(target.shape), e.group, shape)

    def apply(self, index: int) -> None:
        """Apply parameter ``index``'s complete update with the scalars captured when the step ran."""
        e = self.entries[index]
        self.rule.apply(local(e.param), self.updates[index], self.scalars[index])
