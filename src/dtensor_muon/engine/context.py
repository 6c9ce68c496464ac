"""What the strategies of one step share: the rule, the parameters, their inputs U and outputs O.

The engine builds one :class:`StepContext` per step; each strategy (:mod:`dtensor_muon.engine.strategies`) reads
the prepared inputs from it, computes its units with :meth:`StepContext.compute` (the rule's ``direction``
on whole matrices, batched as the plan's units say), and writes each parameter's received update into its
update buffer or hands a fully local parameter's update to :meth:`StepContext.apply_local` (a whole unit of
one, in a step that is not transactional: :meth:`StepContext.compute_and_apply`, which takes the metrics'
norms from the apply's pass).

A *transactional* step (any parameter on a mesh of more than one rank) changes nothing until every rank
has computed its directions: ``prepare`` leaves the shard state as it is, each unit's direction works on a
copy of its owner state, a failing direction is recorded (:attr:`StepContext.failure`) instead of raised
(the rank still takes part in every exchange, sending zeros), and fully local updates wait. The engine then
agrees on the outcome across ranks and either :meth:`StepContext.commit` s all of it or drops all of it.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.exchange import MeshGroup
from ..distributed.layout import ParamLayout, local
from ..kernels.elementwise import decay_and_add_many
from ..kernels.shapes import decide_as_batch
from ..linalg.ns_graphs import NewtonSchulzGraphs
from ..plan import MatrixSpec, Plan
from ..plan.views import MatrixSplit
from ..rules.base import ApplyScalars, MatrixRule, NewtonSchulzRunner
from .metrics import PhaseTimer, StepStats
from .offload import HostOffload, State, streamed

OWNER_STATE_KEY = "owner_state"
"""Key of a parameter's optimizer state that holds its matrices' owner state: ``{matrix key: {name: tensor}}``."""


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


@dataclass(frozen=True)
class DirectionFailure:
    """A direction that raised: the matrix (the first of its unit), the unit's size, the global rank it ran
    on and the error, as ``"Type: message"``."""

    matrix: str
    unit_size: int
    rank: int
    error: str

    def describe(self) -> str:
        others = f" (and the {self.unit_size - 1} other matrices of its batch)" if self.unit_size > 1 else ""
        return f"matrix {self.matrix!r}{others} on its owner, global rank {self.rank}: {self.error}"


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
        *,
        transactional: bool = False,
        hold_backs: bool = False,
        offload: HostOffload | None = None,
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
        self.transactional = transactional
        self.hold_backs = hold_backs
        """Pack the return exchanges but leave them unlaunched until the engine has agreed on the outcome (a step
        over several ranks): a failed step sends nothing back, and the agreement does not queue behind them."""
        self.offload = offload
        """Shard state in host memory, streamed through the device (:mod:`.offload`); None: on the device."""
        self.failure: DirectionFailure | None = None
        self.exception: BaseException | None = None
        self._prepared: list[Entry] = []
        self._staged: list[tuple[MatrixSpec, dict[str, Tensor]]] = []
        self._local_updates: list[tuple[Entry, Tensor, Tensor, tuple[int, int]]] = []
        self._written_beside: list[tuple[State, State]] = []  # offloaded (state, new state) until the commit
        self.stacking_allowed: dict[tuple, bool] = {}
        """The rule's ``stacks_units`` per (group id, shape, unit size, device), asked once a step (:mod:`.stacks`)."""

    def _shard_inputs(self, e: Entry) -> tuple[Tensor, dict[str, Tensor]]:
        g = self.grads[e.index]
        grad = local(g) if g is not None else torch.zeros_like(local(e.param))
        held = self.state[e.param]
        return grad, {key: local(held[key]) for key in self.rule.shard_state_keys if key in held}

    def _shards_by_group(self, entries: list[Entry]) -> list[tuple[list[Entry], list[Tensor], list[dict[str, Tensor]]]]:
        """``entries`` split by param group (the same dict), each part in the given order, with its shards'
        gradients and shard states."""
        groups: dict[int, list[Entry]] = {}
        for e in entries:
            groups.setdefault(id(e.group), []).append(e)
        out = []
        for members in groups.values():
            shards = [self._shard_inputs(e) for e in members]
            out.append((members, [g for g, _ in shards], [s for _, s in shards]))
        return out

    def prepare(self, e: Entry) -> Tensor:
        """U on this rank's shard of parameter ``e``; its shard state advances now, or at :meth:`commit` in a
        transactional step."""
        if self._streams(e.group):
            return self.prepare_many([e])[0]
        grad, shard_state = self._shard_inputs(e)
        if not self.transactional:
            return self.rule.prepare_and_advance(grad, shard_state, e.group)
        self._prepared.append(e)
        return self.rule.prepare(grad, shard_state, e.group)

    def prepare_many(self, entries: list[Entry]) -> list[Tensor]:
        """:meth:`prepare` on several parameters, those of one group at once through the rule's
        ``prepare_many`` (multi-tensor passes where the rule has them); U in ``entries``' order."""
        inputs: dict[int, Tensor] = {}
        for members, grads, shard_states in self._shards_by_group(entries):
            group = members[0].group
            if self._streams(group):
                prepared = self._prepare_offloaded(grads, shard_states, group)
            else:
                prepared = self.rule.prepare_many(grads, shard_states, group, advance=not self.transactional)
                if self.transactional:
                    self._prepared.extend(members)
            inputs.update((e.index, u) for e, u in zip(members, prepared))
        return [inputs[e.index] for e in entries]

    def _streams(self, group: dict[str, Any]) -> bool:
        """Whether the shard state of ``group``'s parameters is in host memory and streamed (offload, and every
        key of it offloaded: SOAP's shard state is only a step count, which stays where it is)."""
        return self.offload is not None and streamed(self.rule, group)

    def _prepare_offloaded(self, grads: list[Tensor], hosts: list[State], group: dict[str, Any]) -> list[Tensor]:
        """U from host-resident shard states, bucket by bucket on their device copies, which advance there (the
        rule's ``prepare_and_advance``: the bits of ``prepare`` then ``advance``) and are copied back: into the
        state itself, or, in a transactional step, beside it until :meth:`commit`."""
        assert self.offload is not None
        out: list[Tensor] = []
        for span, copies in self.offload.staged(hosts):
            out.extend(self.rule.prepare_many([grads[i] for i in span], copies, group, advance=True))
            states = [hosts[i] for i in span]
            targets = self.offload.spares(states) if self.transactional else states
            self.offload.write_back(copies, targets)
            if self.transactional:
                self._written_beside.extend(zip(states, targets))
        return out

    def release_inputs(self, indices: list[int]) -> None:
        """Let go of the prepared U of these parameters: no strategy reads it any more."""
        for i in indices:
            self.inputs.pop(i, None)

    def owner_state(self, spec: MatrixSpec) -> dict[str, Tensor]:
        """The owner state of one matrix ({} for rules without owner state)."""
        held = self.state[self.entries[spec.param_index].param].get(OWNER_STATE_KEY)
        return held[spec.key] if held is not None else {}

    def compute(self, jobs: list[tuple[MatrixSpec, Tensor]]) -> list[Tensor]:
        """The rule's direction for one unit's matrices (inputs of any shape holding ``spec.shape`` elements),
        stacked into one batch when there are several; returns O per job, shaped ``spec.shape``."""
        if not jobs:
            return []
        mats = [u.reshape(spec.shape) for spec, u in jobs]
        out = self.compute_unit([spec for spec, _ in jobs], mats[0] if len(mats) == 1 else torch.stack(mats))
        return [out] if len(mats) == 1 else list(out.unbind(0))

    def compute_unit(
        self, specs: list[MatrixSpec], stacked: Tensor, decide_as: int | None = None, *, borrow: bool = False
    ) -> Tensor:
        """The rule's direction for one unit given whole: ``stacked`` is ``[m, n]`` (one matrix) or ``[B, m, n]``
        (B same-shape matrices of one parameter, ``specs`` in order; or a stack of such units of one param group,
        :mod:`.stacks`, with ``decide_as`` matrices per unit); returns O shaped like ``stacked``. Host work is per
        call: one owner-state lookup per matrix, one norm over the batch for the metrics.

        The ``[P, r, c]`` parts of one grouped-split matrix (``specs[0].parts == P > 1``) are computed as the one
        ``[P·r, c]`` matrix their rows stack into, with its one owner state and γ'.

        ``borrow``: O may be the CUDA graph's own output buffer (:class:`~..linalg.ns_graphs.NewtonSchulzGraphs`),
        not a copy: the caller must enqueue everything that reads it before the next call of the same signature."""
        computed = self._direction(specs, stacked, borrow=borrow, decide_as=decide_as)
        if computed is None:  # the step fails anyway: zeros keep the exchanges going
            return torch.zeros(stacked.shape, dtype=stacked.dtype, device=stacked.device)
        out, matrices = computed
        group = self.entries[matrices[0].param_index].group
        lr_adjusted = self.rule.adjusted_lr(group, matrices[0].whole_shape)
        self.stats.add_orthogonal(out, lr_adjusted, [spec.name for spec in matrices])
        return out.reshape(stacked.shape)

    def compute_and_apply(
        self, e: Entry, specs: list[MatrixSpec], stacked: Tensor, target: Tensor, decide_as: int | None = None
    ) -> None:
        """:meth:`compute_unit` for a unit (or a stack of units) of the fully local parameter ``e`` in a step
        that is not transactional, its O applied at once to ``target``, the unit's region of the local shard
        (``stacked``'s entries in the same order). O is applied before another unit is computed, so it may be the CUDA graph's
        own output buffer (:class:`~..linalg.ns_graphs.NewtonSchulzGraphs`, ``borrow``), not a copy of it. The metrics'
        norm of each matrix comes from the apply's own pass where it computes them
        (:meth:`MatrixRule.apply_region`, ``return_norms``: one launch where a norm and the apply took two),
        else from one norm over the batch, as in :meth:`compute_unit`."""
        if self.transactional:
            raise RuntimeError("compute_and_apply: a transactional step applies what it computed at its commit")
        computed = self._direction(specs, stacked, borrow=True, decide_as=decide_as)
        assert computed is not None  # only a transactional step records a failure instead of raising it
        out, matrices = computed
        shape = matrices[0].whole_shape
        lr_adjusted = self.rule.adjusted_lr(e.group, shape)
        names = [spec.name for spec in matrices]
        norms = self.rule.apply_region(target, out.reshape(target.shape), e.group, shape, return_norms=True)
        if norms is None:
            self.stats.add_orthogonal(out, lr_adjusted, names)
        else:
            self.stats.add_orthogonal_norms(norms, lr_adjusted, names, out)

    def _direction(
        self, specs: list[MatrixSpec], stacked: Tensor, *, borrow: bool, decide_as: int | None = None
    ) -> tuple[Tensor, list[MatrixSpec]] | None:
        """The rule's direction for one unit (:meth:`compute_unit`), its FLOPs counted: O shaped as the matrices
        it computed, with their specs (a grouped split's parts: the one spec of their matrix). None in a
        transactional step that has failed, here (recorded in :attr:`failure`) or before (the work is
        skipped). ``borrow``: O may be the CUDA graph's own output buffer. ``decide_as``: the dispatch decides as
        for that many matrices (a stack of units, :mod:`.stacks`)."""
        first = specs[0]
        if first.parts > 1:
            specs, stacked = [first], stacked.reshape(first.whole_shape)
        group = self.entries[first.param_index].group
        if self.failure is not None:
            return None
        states = [self.owner_state(spec) for spec in specs]
        staged = self.transactional and self.rule.has_owner_state
        if staged:
            states = [{name: t.clone() for name, t in s.items()} for s in states]
        runner = self.runner
        if borrow and isinstance(runner, NewtonSchulzGraphs):
            runner = functools.partial(runner, borrow=True)
        try:
            with decide_as_batch(decide_as) if decide_as is not None else contextlib.nullcontext():
                out = self.rule.direction(stacked, states, group, runner)
        except Exception as exc:
            if not self.transactional:
                raise
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.failure = DirectionFailure(first.name, len(specs), rank, f"{type(exc).__name__}: {exc}")
            self.exception = exc
            return None
        if staged:
            self._staged.extend(zip(specs, states))
        self.stats.add_flops(self.rule.cost(group, first.whole_shape).flops * len(specs))
        return out, specs

    def input_buffer(self, specs: list[MatrixSpec], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A flat buffer to assemble the input of one call of :meth:`compute_unit` (its matrices ``specs``) in. Where
        the input is in the dtype the direction works in and the runner replays CUDA graphs, its staging buffer for
        the input's shape (:meth:`~..linalg.ns_graphs.NewtonSchulzGraphs.staging_buffer`), which the call's graph
        reads in place instead of copying it into a start of its own: calls of one shape share it, so assemble
        each after the call before has been enqueued. Else a new buffer."""
        shape, numel = newton_schulz_input_shape(specs), len(specs) * specs[0].numel
        buffer = None
        group = self.entries[specs[0].param_index].group
        if (
            isinstance(self.runner, NewtonSchulzGraphs)
            and dtype == self.rule.input_dtype(group)
            and math.prod(shape) == numel
        ):
            buffer = self.runner.staging_buffer(shape, dtype, device)
        return (buffer if buffer is not None else torch.empty(numel, dtype=dtype, device=device)).view(-1)

    def input_itemsize(self, spec: MatrixSpec) -> int:
        """Bytes per element of a matrix's input where its direction runs."""
        return self.rule.input_dtype(self.entries[spec.param_index].group).itemsize

    def apply_local(self, e: Entry, target: Tensor, o: Tensor, shape: tuple[int, int]) -> None:
        """Apply one matrix's update to its region ``target`` of a fully local parameter: at once, or at
        :meth:`commit` in a transactional step."""
        if self.transactional:
            self._local_updates.append((e, target, o, shape))
        else:
            self.rule.apply_region(target, o.reshape(target.shape), e.group, shape)

    def commit(self) -> None:
        """Keep what a transactional step computed: the owner states' new values, the shard states' advance,
        the fully local updates (in the order they were computed)."""
        for spec, s in self._staged:
            self.state[self.entries[spec.param_index].param][OWNER_STATE_KEY][spec.key] = s
        for members, grads, shard_states in self._shards_by_group(self._prepared):
            self.rule.advance_many(grads, shard_states, members[0].group)
        if self._written_beside:
            HostOffload.exchange(self._written_beside)
        factors = [self.rule.region_factors(e.group, shape) for e, _, _, shape in self._local_updates]
        decay_and_add_many(
            [target for _, target, _, _ in self._local_updates],
            [o.reshape(target.shape) for _, target, o, _ in self._local_updates],
            [decay for decay, _ in factors],
            [alpha for _, alpha in factors],
        )
        self.discard()

    def discard(self) -> None:
        """Drop what a transactional step computed (nothing of it was kept)."""
        self._prepared, self._staged, self._local_updates, self._written_beside = [], [], [], []

    def apply_many(self, indices: list[int]) -> None:
        """Apply these parameters' complete updates with the scalars captured when the step ran, at once
        (:meth:`MatrixRule.apply_many`)."""
        self.rule.apply_many(
            [local(self.entries[i].param) for i in indices],
            [self.updates[i] for i in indices],
            [self.scalars[i] for i in indices],
        )


def newton_schulz_input_shape(specs: list[MatrixSpec]) -> tuple[int, ...]:
    """The shape of the input a call of these matrices hands the direction: the whole matrix of a grouped split's
    parts (:meth:`StepContext.compute_unit`), else ``[B, m, n]`` or ``[m, n]``."""
    first = specs[0]
    if first.parts > 1:
        return tuple(first.whole_shape)
    return (len(specs), *first.shape) if len(specs) > 1 else tuple(first.shape)
