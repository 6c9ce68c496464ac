"""The distributed step: preflight → consensus → prepare → strategies (direction where the plan says) → apply.

Every parameter is either a matrix-rule parameter (its matrices get the rule's direction) or an AdamW
parameter (element-wise, on local shards). Matrix-rule parameters are grouped by device mesh; each mesh gets
a :class:`~dtensor_muon.plan.Plan`. Plain tensors form a world of one: all their matrices are local. The
engine runs the strategies of :mod:`dtensor_muon.engine.strategies` on each plan and never names a rule or a
strategy.

Gradients in other placements than their parameter's (tensor parallelism's ``Partial`` gradients of replicated
norms, a ``Replicate`` gradient of a row-sharded embedding) are checked in preflight and redistributed to the
parameter's placements after the consensus, in entry order on every rank.

All or nothing: a step over meshes of more than one rank keeps nothing until every rank's directions have
succeeded. ``prepare`` leaves the shard state as it is (``advance`` changes it afterwards, with the same operation
in place, so the bits are those U was computed from); each unit's direction works on a copy of its owner state; a
direction that raises is recorded, and its rank still takes part in every exchange out (its later directions are
zeros). Each return exchange is packed as soon as its directions are computed but not launched
(:class:`~..distributed.exchange.PackedExchange`). After the strategies, one all-reduce (MAX) of a failure flag per
mesh tells every rank; it follows the exchanges out only, not the exchanges back. On a failure each raises
:class:`StepFailedError` naming the matrix, its owner's global rank and the error, the packed exchanges back are
dropped unsent, and parameters, shard state, owner state and AdamW state are bitwise as before the step. Otherwise
the exchanges back are launched, from a side stream that waits for each one's packing alone (so they run beside
whatever the device still computes), the owner states' copies replace the old ones, the shard states advance, AdamW
runs and the updates are applied (with ``overlap=True`` each module's in its next forward; a step that fails raises
inside ``step()`` in both modes). Cost: one small all-reduce and host sync per step, one more element-wise pass
over the shard state (the advance), and this rank's owner state held twice during the step (NorMuon: one float per
row; SOAP: its factors, bases and moments). On one process nothing waits: the state advances in ``prepare`` and
local updates are applied as they are computed, so a direction that raises there leaves the matrices computed
before it updated.

Exactness: prepare and apply are element-wise on shards; transports only move values (in a wire dtype that
does not round the rule's input, checked at construction), and every unit is computed on the same whole
matrices, in the same batches, as in one process.

Owner state (per-matrix state that only makes sense whole, e.g. NorMuon's row second moment) lives in the
parameter's optimizer state under ``"owner_state"``, as ``{matrix key: {name: tensor}}``, on the ranks that
compute that matrix (its owner; every holder of a local matrix; every rank with ``exchange="gather_all"``).
So ``state_dict()`` holds each rank's own matrices, and torch.distributed.checkpoint saves each under the
parameter's name and the matrix key. Loading on another world size works through DCP's templates
(``get_optimizer_state_dict`` on the new ranks lists exactly the matrices each now computes, and
``dcp.load`` fills them whoever saved them); a plain ``load_state_dict`` that lacks a matrix this rank now
computes raises instead of starting it from zeros. Chosen over re-laying the state out in the parameter's
layout at each save: no collective at save or load, and nothing but the owner's copy is ever kept.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..distributed import consensus
from ..distributed.exchange import MeshGroup, mesh_group
from ..distributed.host_memory import on_host
from ..distributed.layout import (
    TensorParallelLayout,
    box_shape,
    intersect,
    local,
    read_tensor_parallel_layout,
    relative_slices,
)
from ..linalg.newton_schulz import newton_schulz
from ..linalg.ns_graphs import NewtonSchulzGraphs
from ..plan import Plan, build_plan, matrices_of
from ..rules import adamw as adamw_rule
from ..rules.base import MatrixRule
from . import metrics as metrics_lib
from . import preflight
from .context import OWNER_STATE_KEY, DirectionFailure, Entry, MeshWork, StepContext
from .offload import OFFLOAD_MODES, HostOffload, offloaded_keys, streamed
from .pending import PendingUpdates
from .preflight import ConsensusGroup, PreflightError
from .strategies import STRATEGIES

EXCHANGE_MODES = ("owner", "gather_all")


class StepFailedError(RuntimeError):
    """A rule's direction raised on some rank; every rank raises this, and nothing of the step was kept."""

    def __init__(self, rule: str, failure: DirectionFailure | None) -> None:
        where = failure.describe() if failure is not None else "a matrix on a rank outside this mesh (its error says)"
        super().__init__(
            f"the {rule} direction failed for {where}; no rank changed anything (parameters, shard state and "
            "owner state are as before the step)"
        )
        self.failure = failure


def _mesh_key(t: Tensor) -> tuple | None:
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.device_type, mesh.mesh_dim_names)


def _mesh_order(key: tuple | None) -> tuple:
    """Order in which meshes run their collectives: plain tensors, then by rank count, then by ranks.

    Every rank sorts the meshes it belongs to the same way, so two ranks never wait on each other's
    collectives in opposite orders (e.g. expert meshes {0, 1} and {2, 3} both come before the dense mesh).
    """
    if key is None:
        return (0, 0, ())
    return (1, len(key[0]), key[0])


def wire_is_lossless(wire: torch.dtype, input_dtype: torch.dtype) -> bool:
    """Moving values in ``wire`` then casting to ``input_dtype`` equals casting directly (and back)."""
    return wire == input_dtype or torch.finfo(wire).bits >= 32


def apply_regions(e: Entry) -> list[tuple[tuple[slice, ...] | None, tuple[int, int]]]:
    """The parts of ``e``'s local shard with their own γ': one (None, shape) when all its matrices share a
    shape, else (slices relative to the local shard, shape) per matrix (per part of a grouped split's matrix,
    with the whole matrix's shape) that meets the shard."""
    specs = matrices_of(e.index, e.layout, e.split)
    if len({s.whole_shape for s in specs}) == 1:
        return [(None, specs[0].whole_shape)]
    out = []
    for s in specs:
        part = intersect(s.box, e.layout.local_box)
        if part is not None:
            out.append((relative_slices(part, e.layout.local_box), s.whole_shape))
    return out


class Engine:
    """Holds the per-mesh plans and runs one optimizer step over all parameters."""

    def __init__(
        self,
        rule: MatrixRule,
        entries: list[Entry],
        state: dict[Tensor, dict[str, Any]],
        *,
        wire_dtype: torch.dtype | None,
        bucket_bytes: int,
        exchange: str,
        skip_nonfinite: bool,
        diagnostics_interval: int,
        overlap: bool = False,
        ns_cuda_graphs: bool = True,
        offload: str = "none",
        loaded_owner_state: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> None:
        if exchange not in EXCHANGE_MODES:
            raise ValueError(f"exchange: expected one of {EXCHANGE_MODES}, got {exchange!r}")
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"offload: expected one of {OFFLOAD_MODES}, got {offload!r}")
        self.rule = rule
        self.entries = entries
        self.state = state
        self.wire_dtype_option = wire_dtype
        self.bucket_bytes = bucket_bytes
        self.exchange = exchange
        self.skip_nonfinite = skip_nonfinite
        self.diagnostics_interval = diagnostics_interval
        self.overlap = overlap
        # Newton–Schulz on owners: replayed from CUDA graphs where that pays (ns_graphs.py), else eager.
        self.ns_runner = NewtonSchulzGraphs() if ns_cuda_graphs else newton_schulz
        self.offload: HostOffload | None = None
        if offload == "host" and entries:
            self.offload = HostOffload(local(entries[0].param).device, bucket_bytes)
            self._check_offloaded_state()
        self.pending: PendingUpdates | None = None
        self.deferred_seconds = 0.0
        self.skipped_steps = 0
        self.steps_taken = 0
        self._metrics: dict[str, float] = {}
        self._metrics_source: tuple | None = None
        self._unchecked_stats: metrics_lib.StepStats | None = None  # last step's, until its norms are read
        self._warned_nonfinite = False
        self._redistributed: dict[int, str] = {}  # this step's gradients in other placements: index → placements
        self.meshes: list[MeshWork] = []
        self.consensus_groups: list[ConsensusGroup] = []
        self.rebuild_plans()
        self._sync_owner_state(loaded_owner_state)
        if self.offload is not None and self.consensus_groups:  # steps write the new momentum beside the old
            with torch.no_grad():  # the local tensors the steps see (to_local() under no_grad)
                self.offload.spares(
                    [
                        {key: local(self.state[e.param][key]) for key in self.rule.state_keys(e.group)}
                        for e in entries
                        if e.use_muon and streamed(self.rule, e.group)
                    ]
                )

    # ------------------------------------------------------------------ plans
    def rebuild_plans(self) -> None:
        """(Re)build one plan per mesh and check that every rank of the mesh has the same options, parameters
        and hyperparameters (:mod:`..distributed.consensus`) and built the same plan. Meshes over the same set
        of ranks are planned in :func:`_mesh_order`, each given the loads of the ones before (the plan
        package's docstring)."""
        self._build_consensus_groups()
        for group in self.consensus_groups:
            consensus.check_same_everywhere(
                self._describe(group.entries),
                group.comm.group,
                local(group.entries[0].param).device,
                "the optimizer was built differently across ranks",
            )
        for e in self.entries:
            if e.use_muon:
                e.regions = apply_regions(e)
        by_mesh: dict[tuple | None, list[Entry]] = defaultdict(list)
        for e in self.entries:
            if e.use_muon:
                by_mesh[_mesh_key(e.param)].append(e)
        self.meshes = []
        # per set of global ranks, the FLOPs each computes in the plans built so far over exactly that set
        # (torchtitan's dense and expert meshes of one model): each next plan there balances the sum
        loads: dict[frozenset[int], dict[int, int]] = {}
        for key, entries in sorted(by_mesh.items(), key=lambda kv: _mesh_order(kv[0])):
            wire = self._wire_dtype(entries)
            mesh = entries[0].param.device_mesh if key is not None else None
            ranks = mesh.mesh.flatten().tolist() if mesh is not None else []
            earlier = loads.setdefault(frozenset(ranks), {})

            def cost(k: int, shape: tuple[int, int], entries: list[Entry] = entries) -> tuple[int, int, int]:
                return self.rule.cost(entries[k].group, shape).plan_entry()

            plan = build_plan(
                [e.layout for e in entries],
                [e.index for e in entries],
                self.bucket_bytes,
                wire.itemsize,
                splits=[e.split for e in entries],
                batchable=[self.rule.can_batch(e.group) for e in entries],
                cost_fn=cost,
                gather_all=self.exchange == "gather_all" and mesh is not None,
                tensor_parallel=[self._tensor_parallel(e) for e in entries],
                base_load=[earlier.get(r, 0) for r in ranks] if earlier else None,
            )
            for r, flops in zip(ranks, plan.rank_flops):
                earlier[r] = earlier.get(r, 0) + flops
            comm = mesh_group(mesh, entries[0].layout.mesh_rank)
            _check_same_plan_everywhere(plan, comm, local(entries[0].param).device)
            self.meshes.append(MeshWork(mesh, entries, plan, comm, wire, plan.fully_local_params()))
        # the shape of this rank's local piece of each DTensor parameter (and of its gradient), by its layout
        self.local_shapes = {
            e.index: torch.Size(box_shape(e.layout.local_box)) for e in self.entries if isinstance(e.param, DTensor)
        }

    def _build_consensus_groups(self) -> None:
        """The DTensor parameters of each mesh of more than one rank, meshes in :func:`_mesh_order`."""
        dtensors: dict[tuple, list[Entry]] = defaultdict(list)
        for e in self.entries:
            key = _mesh_key(e.param)
            if key is not None:
                dtensors[key].append(e)
        self.consensus_groups = []
        for key in sorted(dtensors, key=_mesh_order):
            entries = dtensors[key]
            comm = mesh_group(entries[0].param.device_mesh, entries[0].layout.mesh_rank)
            if comm.world_size > 1:  # a one-rank mesh has nothing to agree on: no collective, no host sync
                self.consensus_groups.append(ConsensusGroup(entries, comm))

    @property
    def options(self) -> dict[str, Any]:
        """The engine options every rank must share (compared at construction, :mod:`..distributed.consensus`)."""
        return dict(
            wire_dtype=self.wire_dtype_option,
            bucket_bytes=self.bucket_bytes,
            exchange=self.exchange,
            skip_nonfinite=self.skip_nonfinite,
            diagnostics_interval=self.diagnostics_interval,
            overlap=self.overlap,
            ns_cuda_graphs=isinstance(self.ns_runner, NewtonSchulzGraphs),
            offload="host" if self.offload is not None else "none",
        )

    def consensus_meshes(self) -> list[tuple[Any, torch.device]]:
        """(process group, device of its parameters) of every mesh of more than one rank, in consensus order."""
        return [(g.comm.group, local(g.entries[0].param).device) for g in self.consensus_groups]

    def _describe(self, entries: list[Entry]) -> consensus.Description:
        """What the ranks of a mesh must agree on at construction (:func:`consensus.describe_engine`)."""
        return consensus.describe_engine(
            self.options, [(e.name, e.param, e.use_muon) for e in entries], preflight.groups_of(entries)
        )

    def _check_offloaded_state(self) -> None:
        """Raise RuntimeError naming the first parameter whose offloaded state is not in host memory (the front
        end puts it there when it creates or loads it)."""
        for e in self.entries:
            held = self.state[e.param]
            for key in offloaded_keys(self.rule, e.group):
                if key in held and not on_host(held[key]):
                    raise RuntimeError(
                        f"parameter {e.name!r}: offload='host' keeps its {key!r} in host memory, but it is on "
                        f"{local(held[key]).device}"
                    )

    def settle(self) -> None:
        """Wait until the offloaded state's copies back have reached host memory (before it is read there)."""
        if self.offload is not None:
            self.offload.settle()

    def _tensor_parallel(self, e: Entry) -> tuple[str, TensorParallelLayout] | None:
        """(tp_mode, TP layout) of a parameter whose group computes it on a TP group, else None."""
        mode = e.group.get("tp_mode", "owned")
        if mode not in ("duplicated", "distributed", "auto"):
            return None
        if mode != "duplicated" and not hasattr(self.rule, "distributed_direction"):
            raise ValueError(
                f"parameter {e.name!r}: tp_mode={mode!r} runs Newton–Schulz across a tensor-parallel group; "
                f"{self.rule.name} has no distributed form (use 'owned' or 'duplicated')"
            )
        tpl = read_tensor_parallel_layout(e.param)
        return (mode, tpl) if tpl is not None else None

    def _sync_owner_state(self, loaded: set[int]) -> None:
        """Create the owner state of every matrix computed here, drop that of matrices computed elsewhere.

        ``loaded``: ids of the parameters whose owner state a load just put back; a matrix of one of them that
        this rank computes but the load lacks raises (a state dict from another world size or plan, loaded
        without DCP) instead of restarting from zeros.
        """
        if not self.rule.has_owner_state:
            return
        missing = []
        for work in self.meshes:
            for e in work.entries:
                self.state[e.param].setdefault(OWNER_STATE_KEY, {})
            keep: dict[int, set[str]] = defaultdict(set)
            for i in work.plan.computed_by(work.comm.mesh_rank):
                spec = work.plan.routes[i].spec
                e = self.entries[spec.param_index]
                keep[e.index].add(spec.key)
                held = self.state[e.param][OWNER_STATE_KEY]
                if spec.key not in held:
                    if id(e.param) in loaded:
                        missing.append(spec.name)
                    held[spec.key] = self.rule.init_owner_state(spec.whole_shape, e.group, local(e.param).device)
            for e in work.entries:
                held = self.state[e.param][OWNER_STATE_KEY]
                for key in [k for k in held if k not in keep[e.index]]:
                    del held[key]
        if missing:
            raise RuntimeError(
                f"the loaded optimizer state lacks the owner state of {len(missing)} matrices this rank computes "
                f"({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}): it was saved with another world "
                "size or plan. Load it through torch.distributed.checkpoint (get_optimizer_state_dict, dcp.load, "
                "set_optimizer_state_dict), which gives each matrix to its new owner."
            )

    def _wire_dtype(self, entries: list[Entry]) -> torch.dtype:
        wire = self.wire_dtype_option
        if wire is None:
            wire = entries[0].param.dtype
            for e in entries[1:]:
                wire = torch.promote_types(wire, e.param.dtype)
        if any(isinstance(e.param, DTensor) for e in entries):
            for e in entries:
                needed = self.rule.input_dtype(e.group)
                if not wire_is_lossless(wire, needed):
                    raise ValueError(
                        f"wire_dtype {wire} would round the {needed} input of parameter {e.name!r}'s "
                        f"{self.rule.name} direction; use wire_dtype=None (the parameter dtype) or {needed}"
                    )
        return wire

    def update_dtype(self, work: MeshWork, e: Entry) -> torch.dtype:
        """dtype of a parameter's received update: the wire dtype, or the rule's input dtype without a mesh."""
        return work.wire_dtype if work.mesh is not None else self.rule.input_dtype(e.group)

    # ------------------------------------------------------------------ step
    def step(self) -> bool:
        """One optimizer step. Returns False when the step was skipped (non-finite gradients).

        Without overlap every update is applied before returning. With overlap the return exchanges may
        still be in flight: :meth:`finish` applies chosen parameters' updates, :meth:`flush` all of them.
        """
        self.flush()
        if self.offload is not None:
            self.offload.start_step()
        timer = metrics_lib.PhaseTimer()
        failure: PreflightError | None = None
        with timer.phase("preflight"):
            try:
                grads = self._preflight()
            except PreflightError as exc:
                failure, grads = exc, {e.index: None for e in self.entries}
        with timer.phase("consensus"):
            active, nonfinite, failed = preflight.agree(
                self.consensus_groups, self.entries, grads, failure, self._redistributed, self.skip_nonfinite
            )
        self._report_nonfinite(wait=False)  # the last step's, if its flags have reached the host
        if failure is not None:
            raise failure
        if failed is not None:
            index, rank = failed
            raise RuntimeError(
                f"parameter {self.entries[index].name!r}: the optimizer step failed its local checks on another "
                f"rank (global rank {rank}; its error says why); no rank changed anything"
            )
        if nonfinite:
            self.skipped_steps += 1
            self._metrics = {"muon/skipped_steps": float(self.skipped_steps), "muon/step_skipped": 1.0}
            self._metrics_source = None
            return False
        with timer.phase("redistribute"):
            self._redistribute(self.entries, grads)
        step_number = self.steps_taken + 1
        diagnostics = self.diagnostics_interval > 0 and step_number % self.diagnostics_interval == 0
        stats = metrics_lib.StepStats(sample_orthogonality=diagnostics, rule=self.rule.name)
        transactional = bool(self.consensus_groups)
        ctx = StepContext(
            self.rule,
            self.entries,
            self.state,
            grads,
            active,
            stats,
            timer,
            self.ns_runner,
            self.bucket_bytes,
            transactional=transactional,
            hold_backs=transactional,
            offload=self.offload,
        )
        with timer.phase("prepare"):
            self._prepare(ctx)
        backs = []
        for work in self.meshes:
            for strategy in STRATEGIES:
                backs.extend(strategy(ctx, work))
        ctx.release_inputs(list(ctx.inputs))  # U is in the send buffers or consumed: not kept past the step
        with timer.phase("outcome"):
            self._agree_on_outcome(ctx)  # raises on a failure: the packed exchanges back are dropped unsent
        with timer.phase("exchange_back_launch"):
            for back in backs:
                back.start()
        ctx.commit()
        self.steps_taken = step_number
        with timer.phase("adamw"):
            self._adamw_step(grads, active, stats, diagnostics)
        self.pending = PendingUpdates(list(ctx.updates), backs, ctx.apply_many)
        if not self.overlap:
            with timer.phase("finish"):
                self.flush()
        self._metrics_source = (timer, stats)
        self._report_nonfinite(wait=True)  # a step older than this one (its flags arrived long ago)
        stats.start_nonfinite_check()
        self._unchecked_stats = stats
        self._report_nonfinite(wait=False)  # at once on the CPU
        return True

    def _agree_on_outcome(self, ctx: StepContext) -> None:
        """Raise :class:`StepFailedError` on every rank if a direction failed on any rank (nothing kept).

        One all-reduce (MAX) of a failure flag per mesh, in the consensus order, after every direction of the
        step; only when it is set do the ranks gather the failure (``all_gather_object`` on the last mesh) to
        name the matrix, its owner and the error. The return exchanges are packed but not yet launched
        (``hold_backs``): the flag's all-reduce follows the exchanges out only, and a failed step drops them.
        """
        if not ctx.transactional:
            return
        if not consensus.any_rank(ctx.failure is not None, self.consensus_meshes()):
            return
        ctx.discard()
        last = self.consensus_groups[-1].comm
        failures: list[DirectionFailure | None] = [None] * last.world_size
        dist.all_gather_object(failures, ctx.failure, group=last.group)
        failure = ctx.failure or next((f for f in failures if f is not None), None)
        raise StepFailedError(self.rule.name, failure) from ctx.exception

    def _report_nonfinite(self, wait: bool) -> None:
        """Warn (once per engine) if the last checked step's Newton–Schulz output of some matrix was not finite.

        Reads the scalar of :meth:`StepStats.start_nonfinite_check` (the squared update norms summed anyway
        for ``muon/update_rms/<rule>``) without synchronizing the device: at once on the CPU; on CUDA at the
        next step once it has arrived, or when the metrics are read. ``wait=False``: leave it unread if it
        has not arrived. Only when it is set are the per-matrix norms sent, for the names (which
        can take one more step to arrive).
        """
        stats = self._unchecked_stats
        if stats is None:
            return
        names = stats.nonfinite_names(wait) if not self._warned_nonfinite else []
        if names is None:
            return
        self._unchecked_stats = None
        if names:
            self._warned_nonfinite = True
            others = f" and {len(names) - 1} other matrices" if len(names) > 1 else ""
            warnings.warn(
                f"the {self.rule.name} update of {names[0]!r}{others} is not finite (inf or NaN in the gradient or the momentum), "
                "so the parameter becomes NaN; skip_nonfinite=True skips every step in which any rank's "
                "gradients are not finite, and optimizer.metrics['muon/nonfinite_updates'] counts such matrices "
                "per step (this warning is shown once)",
                RuntimeWarning,
                stacklevel=2,
            )

    def finish(self, indices: list[int]) -> bool:
        """Apply the pending updates of the parameters with these engine indices; whether any was applied."""
        return self.pending is not None and self.pending.finish(indices)

    def flush(self) -> None:
        """Apply every pending update (waiting for the return exchanges they need)."""
        if self.pending is not None:
            self.pending.finish_all()
            self.deferred_seconds = self.pending.seconds
            self.pending = None

    @property
    def metrics(self) -> dict[str, float]:
        """Diagnostics of the last step (computed on first access, so a step never waits for them)."""
        if self._metrics_source is not None:
            timer, stats = self._metrics_source
            if stats is self._unchecked_stats:
                self._report_nonfinite(wait=True)
            self._metrics = metrics_lib.summarize(timer, stats, [w.plan for w in self.meshes], self.skipped_steps)
            if self.overlap:
                self._metrics["muon/time_deferred_finish_ms"] = 1e3 * self.deferred_seconds
            self._metrics_source = None
        return self._metrics

    def _preflight(self) -> dict[int, Tensor | None]:
        """This step's gradients by entry index after :func:`.preflight.check_gradients` (no collective)."""
        self._redistributed = {}
        grads, self._redistributed = preflight.check_gradients(self.entries, self.local_shapes)
        return grads

    @staticmethod
    def _redistribute(entries: list[Entry], grads: dict[int, Tensor | None]) -> None:
        """Bring every gradient to its parameter's placements, in entry order on every rank (the same
        collectives everywhere; a ``Partial`` gradient is summed, a ``Replicate`` one sliced)."""
        for e in entries:
            g = grads[e.index]
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(e.param.placements):
                grads[e.index] = g.redistribute(e.param.device_mesh, e.param.placements)

    def _adamw_step(self, grads, active, stats, diagnostics: bool) -> None:
        by_group: dict[int, list[Entry]] = defaultdict(list)
        for e in self.entries:
            if not e.use_muon and e.index in active:
                by_group[id(e.group)].append(e)
        for entries in by_group.values():
            group = entries[0].group
            params = [local(e.param) for e in entries]
            before = [p.detach().clone() for p in params] if diagnostics else None
            gradients = [
                local(grads[e.index]) if grads[e.index] is not None else torch.zeros_like(p)
                for e, p in zip(entries, params)
            ]
            moments = [{key: local(self.state[e.param][key]) for key in adamw_rule.MOMENTS} for e in entries]
            steps = [self.state[e.param]["step"] for e in entries]
            if self.offload is None:
                _adamw(group, params, gradients, moments, steps)
            else:
                self._adamw_offloaded(group, params, gradients, moments, steps)
            if before is not None:
                for p, b in zip(params, before):
                    stats.add_update("adamw", p - b)

    def _adamw_offloaded(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        gradients: list[Tensor],
        moments: list[dict[str, Tensor]],
        steps: list[Tensor],
    ) -> None:
        """AdamW with host-resident moments, bucket by bucket on device copies that are copied back in place. A
        parameter whose moments exceed a bucket goes in pieces of consecutive entries (AdamW is element-wise:
        the same bits); every piece reads a copy of its parameter's step count, which advances once at the end."""
        assert self.offload is not None
        per_element = 2 * max((p.element_size() for p in params), default=4)
        piece = max(1, self.offload.bucket_bytes // per_element)
        pieces: list[tuple[Tensor, Tensor, dict[str, Tensor], Tensor]] = []
        for p, g, m, step in zip(params, gradients, moments, steps):
            flat = [p, g, *m.values()]
            if p.numel() <= piece or not all(t.is_contiguous() for t in flat):
                pieces.append((p, g, m, step.clone()))
                continue
            p, g, *ms = (t.view(-1) for t in flat)
            for start in range(0, p.numel(), piece):
                cut = slice(start, start + piece)
                pieces.append((p[cut], g[cut], dict(zip(m, (t[cut] for t in ms))), step.clone()))
        hosts = [m for _, _, m, _ in pieces]
        for span, copies in self.offload.staged(hosts):
            chosen = [pieces[i] for i in span]
            _adamw(group, [c[0] for c in chosen], [c[1] for c in chosen], copies, [c[3] for c in chosen])
            self.offload.write_back(copies, [hosts[i] for i in span])
        torch._foreach_add_(steps, 1)

    def _prepare(self, ctx: StepContext) -> None:
        """U on the shards of the parameters that are not fully local, their update buffers and apply scalars."""
        for work in self.meshes:
            entries = [e for e in work.entries if e.index in ctx.active and e.index not in work.fully_local]
            for e, u in zip(entries, ctx.prepare_many(entries)):
                ctx.inputs[e.index] = u
                ctx.updates[e.index] = torch.empty_like(local(e.param), dtype=self.update_dtype(work, e))
                ctx.scalars[e.index] = self.rule.scalars(e.group, e.regions)


def _adamw(
    group: dict[str, Any],
    params: list[Tensor],
    gradients: list[Tensor],
    moments: list[dict[str, Tensor]],
    steps: list[Tensor],
) -> None:
    """torch's AdamW under ``group``'s settings on these (local) tensors, their moments and step counts."""
    adamw_rule.step(
        params,
        gradients,
        [m["exp_avg"] for m in moments],
        [m["exp_avg_sq"] for m in moments],
        steps,
        lr=group["lr"],
        betas=tuple(group["adamw_betas"]),
        eps=group["adamw_eps"],
        weight_decay=group["weight_decay"],
    )


def _check_same_plan_everywhere(plan: Plan, comm: MeshGroup, device: torch.device) -> None:
    """Compare the plan digest across the mesh's ranks (on ``device``, where the mesh's parameters live, so
    any backend of the mesh takes it); raise on every rank if any differs."""
    if comm.group is None:
        return
    digests = consensus.distinct_across(int(plan.digest[:15], 16), comm.group, device)
    if digests != 1:
        raise RuntimeError(
            f"the plan differs across ranks ({digests} different digests): the ranks were given different "
            "parameter names, shapes, placements or options"
        )
