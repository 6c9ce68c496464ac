"""The distributed step: preflight → consensus → prepare → exchange out → Newton–Schulz → exchange back → apply.

Every parameter is either a Muon parameter (its matrices are orthogonalized) or an AdamW parameter
(element-wise, on local shards). Muon parameters are grouped by device mesh; each mesh gets a
:class:`~dtensor_muon.plan.Plan`. Plain tensors form a world of one: all their matrices are local.

Exactness: momentum and the final update are element-wise on shards; the exchange only moves values
(in a wire dtype that loses nothing, checked at construction), and each owner runs the same
Newton–Schulz on the same full matrix as a single process would.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from . import metrics as metrics_lib
from .exchange import MeshGroup, PendingExchange, mesh_group, start_all_to_all
from .kernels import resolve_ns_algorithm
from .layout import ParamLayout, box_numel, box_shape, box_slices, relative_slices
from .newton_schulz import newton_schulz, resolve_coefficients, resolve_ns_dtype
from .ns_graphs import NewtonSchulzGraphs
from .pending import BackExchange, PendingUpdates
from .plan import MatrixRoute, Plan, build_plan, chunk_by_budget, matrix_shape, ns_iteration_flops
from .rules import adamw as adamw_rule
from .rules import muon as muon_rule

EXCHANGE_MODES = ("owner", "gather_all")


@dataclass
class Entry:
    """One parameter as the engine sees it."""

    index: int
    name: str
    param: Tensor
    group: dict[str, Any]
    use_muon: bool
    layout: ParamLayout


class PreflightError(RuntimeError):
    """A parameter failed the local checks of a step (raised on the rank that found it)."""

    def __init__(self, entry: Entry, reason: str) -> None:
        super().__init__(f"parameter {entry.name!r}: {reason}")
        self.index = entry.index


@dataclass
class MeshWork:
    """The Muon parameters of one mesh, their plan and the group the exchange runs on."""

    mesh: Any
    entries: list[Entry]
    plan: Plan
    comm: MeshGroup
    wire_dtype: torch.dtype
    fully_local: set[int] = field(default_factory=set)
    """Parameters all of whose matrices are local: computed in chunks and applied at once, no buffers."""

    def update_dtype(self, e: Entry) -> torch.dtype:
        """dtype of a parameter's received update: the wire dtype, or the Newton–Schulz dtype without a mesh."""
        return self.wire_dtype if self.mesh is not None else resolve_ns_dtype(e.group["ns_dtype"])


@dataclass
class ConsensusGroup:
    """The DTensor parameters (Muon and AdamW) of one mesh with more than one rank, and that mesh's group."""

    entries: list[Entry]
    comm: MeshGroup


@dataclass
class StepScratch:
    """Per-step tensors: the matrix to orthogonalize (U) and the received update (O), per parameter."""

    grads: dict[int, Tensor | None]
    state: dict[Tensor, dict[str, Any]]
    updates_in: dict[int, Tensor] = field(default_factory=dict)
    updates_out: dict[int, Tensor] = field(default_factory=dict)


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor, or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


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


def _ns_settings(group: dict[str, Any]) -> tuple:
    """Hashable Newton–Schulz settings of a param group (matrices batch together only when these agree)."""
    return (
        resolve_coefficients(group["ns_coefficients"]),
        int(group["ns_steps"]),
        float(group["eps"]),
        resolve_ns_dtype(group["ns_dtype"]),
        resolve_ns_algorithm(group["ns_algorithm"]),
    )


def wire_is_lossless(wire: torch.dtype, ns_dtype: torch.dtype) -> bool:
    """Moving values in ``wire`` then casting to ``ns_dtype`` equals casting directly (and back)."""
    return wire == ns_dtype or torch.finfo(wire).bits >= 32


class Engine:
    """Holds the per-mesh plans and runs one optimizer step over all parameters."""

    def __init__(
        self,
        entries: list[Entry],
        *,
        wire_dtype: torch.dtype | None,
        bucket_bytes: int,
        exchange: str,
        skip_nonfinite: bool,
        diagnostics_interval: int,
        overlap: bool = False,
        ns_cuda_graphs: bool = True,
    ) -> None:
        if exchange not in EXCHANGE_MODES:
            raise ValueError(f"exchange: expected one of {EXCHANGE_MODES}, got {exchange!r}")
        self.entries = entries
        self.wire_dtype_option = wire_dtype
        self.bucket_bytes = bucket_bytes
        self.exchange = exchange
        self.skip_nonfinite = skip_nonfinite
        self.diagnostics_interval = diagnostics_interval
        self.overlap = overlap
        # Newton–Schulz on owners: replayed from CUDA graphs where that pays (ns_graphs.py), else eager.
        self.ns_runner = NewtonSchulzGraphs() if ns_cuda_graphs else newton_schulz
        self.pending: PendingUpdates | None = None
        self.deferred_seconds = 0.0
        self.skipped_steps = 0
        self.steps_taken = 0
        self._metrics: dict[str, float] = {}
        self._metrics_source: tuple | None = None
        self._unchecked_stats: metrics_lib.StepStats | None = None  # last step's, until its norms are read
        self._warned_nonfinite = False
        self.meshes: list[MeshWork] = []
        self.mesh_of: dict[int, MeshWork] = {}
        self.consensus_groups: list[ConsensusGroup] = []
        self.rebuild_plans()

    # ------------------------------------------------------------------ plans
    def rebuild_plans(self) -> None:
        """(Re)build one plan per mesh and check that every rank of the mesh built the same one."""
        by_mesh: dict[tuple | None, list[Entry]] = defaultdict(list)
        for e in self.entries:
            if e.use_muon:
                by_mesh[_mesh_key(e.param)].append(e)
        self.meshes = []
        for key, entries in sorted(by_mesh.items(), key=lambda kv: _mesh_order(kv[0])):
            wire = self._wire_dtype(entries)
            layouts = [e.layout for e in entries]
            plan = build_plan(layouts, [e.index for e in entries], self.bucket_bytes, wire.itemsize)
            mesh = entries[0].param.device_mesh if key is not None else None
            comm = mesh_group(mesh, entries[0].layout.mesh_rank)
            _check_same_plan_everywhere(plan, comm)
            fully_local: set[int] = set()
            if self.exchange == "owner" or mesh is None:
                routed = {r.spec.param_index for r in plan.routes if not r.is_local}
                fully_local = {e.index for e in entries} - routed
            self.meshes.append(MeshWork(mesh, entries, plan, comm, wire, fully_local))
        self.mesh_of = {e.index: work for work in self.meshes for e in work.entries}
        # the shape of this rank's local piece of each DTensor parameter (and of its gradient), by its layout
        self.local_shapes = {
            e.index: torch.Size(box_shape(e.layout.local_box)) for e in self.entries if isinstance(e.param, DTensor)
        }
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

    def _wire_dtype(self, entries: list[Entry]) -> torch.dtype:
        wire = self.wire_dtype_option
        if wire is None:
            wire = entries[0].param.dtype
            for e in entries[1:]:
                wire = torch.promote_types(wire, e.param.dtype)
        if any(isinstance(e.param, DTensor) for e in entries):
            for e in entries:
                ns_dtype = resolve_ns_dtype(e.group["ns_dtype"])
                if not wire_is_lossless(wire, ns_dtype):
                    raise ValueError(
                        f"wire_dtype {wire} would round the {ns_dtype} Newton–Schulz input of parameter "
                        f"{e.name!r}; use wire_dtype=None (the parameter dtype) or {ns_dtype}"
                    )
        return wire

    # ------------------------------------------------------------------ step
    def step(self, state: dict[Tensor, dict[str, Any]]) -> bool:
        """One optimizer step. Returns False when the step was skipped (non-finite gradients).

        Without overlap every update is applied before returning. With overlap the return exchanges may
        still be in flight: :meth:`finish` applies chosen parameters' updates, :meth:`flush` all of them.
        """
        self.flush()
        timer = metrics_lib.PhaseTimer()
        failure: PreflightError | None = None
        with timer.phase("preflight"):
            try:
                grads = self._preflight()
            except PreflightError as exc:
                failure, grads = exc, {e.index: None for e in self.entries}
        with timer.phase("consensus"):
            active, nonfinite, failed = self._consensus(grads, failure)
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
        self.steps_taken += 1
        diagnostics = self.diagnostics_interval > 0 and self.steps_taken % self.diagnostics_interval == 0
        stats = metrics_lib.StepStats(sample_orthogonality=diagnostics)
        with timer.phase("adamw"):
            self._adamw_step(grads, active, state, stats, diagnostics)
        with timer.phase("prepare"):
            scratch = self._prepare(grads, active, state)
        # parameters with every matrix local are prepared, orthogonalized and applied in chunks
        backs: list[BackExchange] = []
        for work in self.meshes:
            if self.exchange == "gather_all" and work.mesh is not None:
                self._gather_all(work, scratch, active, timer, stats)
            else:
                backs.extend(self._owner_exchange(work, scratch, active, timer, stats))
        hyper = {e.index: _hyperparameters(e) for e in self.entries if e.index in scratch.updates_out}
        self.pending = PendingUpdates(self, scratch, active, backs, hyper)
        if not self.overlap:
            with timer.phase("finish"):
                self.flush()
        self._metrics_source = (timer, stats)
        self._report_nonfinite(wait=True)  # a step older than this one (its flags arrived long ago)
        stats.start_nonfinite_check()
        self._unchecked_stats = stats
        self._report_nonfinite(wait=False)  # at once on the CPU
        return True

    def _report_nonfinite(self, wait: bool) -> None:
        """Warn (once per engine) if the last checked step's Newton–Schulz output of some matrix was not finite.

        Reads the scalar of :meth:`StepStats.start_nonfinite_check` (the squared update norms summed anyway
        for ``muon/update_rms/muon``) without synchronizing the device: at once on the CPU; on CUDA at the
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
                f"the Muon update of {names[0]!r}{others} is not finite (inf or NaN in the gradient or the momentum), "
                "so the parameter becomes NaN; skip_nonfinite=True skips every step in which any rank's "
                "gradients are not finite, and optimizer.metrics['muon/nonfinite_updates'] counts such matrices "
                "per step (this warning is shown once)",
                RuntimeWarning,
                stacklevel=2,
            )

    def finish(self, indices: list[int]) -> None:
        """Apply the pending updates of the parameters with these engine indices (no-op when none)."""
        if self.pending is not None:
            self.pending.finish(indices)

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
        """Local checks only (no collective): every gradient matches its parameter's type, layout and piece.

        A DTensor gradient must have its parameter's global shape and placements, and its local piece (and
        the parameter's) the shape of the box :mod:`.layout` computed for this rank. Raises
        :class:`PreflightError` naming the first parameter that fails.
        """
        grads: dict[int, Tensor | None] = {}
        for e in self.entries:
            g = e.param.grad
            if g is not None:
                if g.is_sparse:
                    raise PreflightError(e, "sparse gradients are not supported")
                if g.shape != e.param.shape:
                    raise PreflightError(e, f"gradient shape {tuple(g.shape)} != {tuple(e.param.shape)}")
                if isinstance(e.param, DTensor) != isinstance(g, DTensor) or (
                    isinstance(g, DTensor) and tuple(g.placements) != tuple(e.param.placements)
                ):
                    raise PreflightError(e, "gradient layout differs from the parameter's")
            expected = self.local_shapes.get(e.index)
            if expected is not None:  # _local_tensor: what to_local() returns, without its 2-3 us of checks
                if e.param._local_tensor.shape != expected:
                    raise _wrong_piece(e, "parameter", e.param)
                if g is not None and g._local_tensor.shape != expected:
                    raise _wrong_piece(e, "gradient", g)
            grads[e.index] = g
        return grads

    def _consensus(
        self, grads: dict[int, Tensor | None], failure: PreflightError | None
    ) -> tuple[set[int], bool, tuple[int, int] | None]:
        """Which parameters got a gradient on any rank, whether any rank saw inf/NaN, and which parameter
        (index, global rank) failed the local checks on some rank (None when none did).

        One small all-reduce (MAX) per mesh of [has-grad flags…, non-finite flag, failure code], meshes in
        increasing size so the last (largest) carries every flag to every rank. The failure code is
        ``(index + 1)·2³² + global rank`` of a failing rank's parameter (0: none), so every rank can name it.
        A rank whose local checks failed still joins, so the others learn of it instead of waiting in the
        exchange.
        """
        nonfinite = False
        if self.skip_nonfinite and failure is None:
            local_grads = [local(g) for g in grads.values() if g is not None]
            if local_grads:
                finite = torch.stack([torch.isfinite(g).all() for g in local_grads]).all()
                nonfinite = not bool(finite)
        code = 0
        if failure is not None:
            code = ((failure.index + 1) << 32) + (dist.get_rank() if dist.is_initialized() else 0)
        active = {i for i, g in grads.items() if g is not None}
        for group in self.consensus_groups:
            entries = group.entries
            flags = torch.tensor([int(e.index in active) for e in entries] + [int(nonfinite), code], dtype=torch.int64)
            flags = flags.to(local(entries[0].param).device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.comm.group)
            flags = flags.cpu()
            for e, flag in zip(entries, flags[:-2].tolist()):
                if flag:
                    active.add(e.index)
            nonfinite, code = bool(flags[-2]), int(flags[-1])
        failed = ((code >> 32) - 1, code & 0xFFFFFFFF) if code else None
        return active, nonfinite, failed

    def _grad_or_zeros(self, e: Entry, grads: dict[int, Tensor | None]) -> Tensor:
        g = grads[e.index]
        return local(g) if g is not None else torch.zeros_like(local(e.param))

    def _adamw_step(self, grads, active, state, stats, diagnostics: bool) -> None:
        by_group: dict[int, list[Entry]] = defaultdict(list)
        for e in self.entries:
            if not e.use_muon and e.index in active:
                by_group[id(e.group)].append(e)
        for entries in by_group.values():
            group = entries[0].group
            params = [local(e.param) for e in entries]
            before = [p.detach().clone() for p in params] if diagnostics else None
            adamw_rule.step(
                params,
                [self._grad_or_zeros(e, grads) for e in entries],
                [local(state[e.param]["exp_avg"]) for e in entries],
                [local(state[e.param]["exp_avg_sq"]) for e in entries],
                [state[e.param]["step"] for e in entries],
                lr=group["lr"],
                betas=tuple(group["adamw_betas"]),
                eps=group["adamw_eps"],
                weight_decay=group["weight_decay"],
            )
            if before is not None:
                for p, b in zip(params, before):
                    stats.add_update("adamw", p - b)

    def _prepare(self, grads, active, state) -> StepScratch:
        """Momentum on the shards of the parameters that are exchanged, and their update buffers."""
        scratch = StepScratch(grads, state)
        fully_local = set().union(*(w.fully_local for w in self.meshes))
        for e in self.entries:
            if e.use_muon and e.index in active and e.index not in fully_local:
                scratch.updates_in[e.index] = self._momentum(e, scratch)
                scratch.updates_out[e.index] = torch.empty_like(
                    local(e.param), dtype=self.mesh_of[e.index].update_dtype(e)
                )
        return scratch

    def _momentum(self, e: Entry, scratch: StepScratch) -> Tensor:
        """U for parameter ``e`` (updating its momentum buffer in place)."""
        buf = local(scratch.state[e.param]["momentum_buffer"])
        return muon_rule.prepare(self._grad_or_zeros(e, scratch.grads), buf, e.group["momentum"], e.group["nesterov"])

    # ------------------------------------------------------------------ Newton–Schulz on owners
    def _orthogonalize(self, jobs: list[tuple[MatrixRoute, Entry, Tensor]], stats) -> list[Tensor]:
        """Newton–Schulz on full matrices, batching those of equal shape and settings; returns O per job."""
        results: list[Tensor | None] = [None] * len(jobs)
        batches: dict[tuple, list[int]] = defaultdict(list)
        for j, (route, entry, _) in enumerate(jobs):
            batches[(route.spec.shape, _ns_settings(entry.group))].append(j)
        for (shape, (coefficients, steps, eps, ns_dtype, algorithm)), members in batches.items():
            mats = [jobs[j][2].reshape(shape) for j in members]
            stacked = mats[0] if len(mats) == 1 else torch.stack(mats)
            out = muon_rule.direction(stacked, coefficients, steps, eps, ns_dtype, algorithm, self.ns_runner)
            stats.add_flops(len(mats) * steps * ns_iteration_flops(shape))
            outs = [out] if len(mats) == 1 else list(out.unbind(0))
            for j, o in zip(members, outs):
                results[j] = o
                route, entry, _ = jobs[j]
                lr_adjusted = muon_rule.adjusted_lr(entry.group["lr"], entry.group["adjust_lr_fn"], shape)
                stats.add_orthogonal(o, lr_adjusted, route.spec.name)
        return results  # type: ignore[return-value]

    def _owner_exchange(self, work: MeshWork, scratch: StepScratch, active, timer, stats) -> list[BackExchange]:
        """Compute local matrices, exchange out, orthogonalize owned matrices, launch the return exchanges."""
        plan = work.plan
        with timer.phase("local_compute"):
            self._compute_local(work, scratch, active, stats)
        if not plan.buckets:
            return []
        device = local(work.entries[0].param).device
        with timer.phase("exchange_out_launch"):
            pending_out = [self._launch_out(work, bucket, scratch, active, device, stats) for bucket in plan.buckets]
        backs: list[BackExchange] = []
        for bucket, pending in zip(plan.buckets, pending_out):
            with timer.phase("exchange_out_wait"):
                received = pending.wait()
            with timer.phase("owner_compute"):
                updates = self._compute_owned(work, bucket, received, active, device, stats)
            with timer.phase("exchange_back_launch"):
                backs.append(
                    BackExchange(work, bucket, self._launch_back(work, bucket, updates, active, device, stats))
                )
        return backs

    def _compute_local(self, work: MeshWork, scratch: StepScratch, active, stats) -> None:
        """Local matrices, in chunks of at most ``bucket_bytes`` of Newton–Schulz input (batched by shape).

        Matrices of fully local parameters are applied as soon as they are orthogonalized, and a parameter's
        U lives only until its last matrix is done, so peak memory is about one chunk, not the model.
        """
        routes = [work.plan.routes[i] for i in work.plan.local_to(work.comm.mesh_rank)]
        routes = [r for r in routes if r.spec.param_index in active]
        left = defaultdict(int)
        for r in routes:
            left[r.spec.param_index] += 1
        momentum: dict[int, Tensor] = {}
        for chunk in chunk_by_budget(routes, self.bucket_bytes, lambda r: r.spec.numel * self._ns_itemsize(r)):
            jobs = []
            for route in chunk:
                e = self.entries[route.spec.param_index]
                if e.index in work.fully_local and e.index not in momentum:
                    momentum[e.index] = self._momentum(e, scratch)
                u = momentum[e.index] if e.index in work.fully_local else scratch.updates_in[e.index]
                jobs.append((route, e, u[relative_slices(route.spec.box, e.layout.local_box)]))
            for (route, e, _), o in zip(jobs, self._orthogonalize(jobs, stats)):
                sl = relative_slices(route.spec.box, e.layout.local_box)
                if e.index in work.fully_local:
                    target = local(e.param)[sl]
                    muon_rule.apply(target, o.reshape(target.shape), *_hyperparameters(e))
                    left[e.index] -= 1
                    if left[e.index] == 0:
                        del momentum[e.index]
                else:
                    target = scratch.updates_out[e.index][sl]
                    target.copy_(o.reshape(target.shape))

    def _ns_itemsize(self, route: MatrixRoute) -> int:
        return resolve_ns_dtype(self.entries[route.spec.param_index].group["ns_dtype"]).itemsize

    def _active_routes(self, work: MeshWork, bucket: list[int], active) -> list[MatrixRoute]:
        return [work.plan.routes[i] for i in bucket if work.plan.routes[i].spec.param_index in active]

    def _launch_out(self, work, bucket, scratch, active, device, stats) -> PendingExchange:
        me = work.comm.mesh_rank
        send: dict[int, list[Tensor]] = defaultdict(list)
        recv: dict[int, int] = defaultdict(int)
        for route in self._active_routes(work, bucket, active):
            e = self.entries[route.spec.param_index]
            for box, source in route.pieces:
                if source == me:
                    send[route.owner].append(scratch.updates_in[e.index][relative_slices(box, e.layout.local_box)])
                if route.owner == me:
                    recv[source] += box_numel(box)
        stats.bytes_sent += sum(p.numel() for r, ps in send.items() if r != me for p in ps) * work.wire_dtype.itemsize
        return start_all_to_all(work.comm, send, recv, work.wire_dtype, device)

    def _compute_owned(self, work, bucket, received: dict[int, Tensor], active, device, stats) -> dict[int, Tensor]:
        """Assemble each owned matrix from its pieces (in route order per source) and orthogonalize."""
        me = work.comm.mesh_rank
        offsets: dict[int, int] = defaultdict(int)
        jobs = []
        for route in self._active_routes(work, bucket, active):
            if route.owner != me:
                continue
            e = self.entries[route.spec.param_index]
            full = torch.empty(box_shape(route.spec.box), dtype=work.wire_dtype, device=device)
            for box, source in route.pieces:
                n = box_numel(box)
                chunk = received[source][offsets[source] : offsets[source] + n]
                offsets[source] += n
                target = full[relative_slices(box, route.spec.box)]
                target.copy_(chunk.view(target.shape))
            jobs.append((route, e, full))
        outs = self._orthogonalize(jobs, stats)
        return {id(route): o.reshape(box_shape(route.spec.box)) for (route, _, _), o in zip(jobs, outs)}

    def _launch_back(self, work, bucket, updates: dict[int, Tensor], active, device, stats) -> PendingExchange:
        me = work.comm.mesh_rank
        send: dict[int, list[Tensor]] = defaultdict(list)
        recv: dict[int, int] = defaultdict(int)
        for route in self._active_routes(work, bucket, active):
            for holder, box in route.holders:
                if route.owner == me:
                    send[holder].append(updates[id(route)][relative_slices(box, route.spec.box)])
                if holder == me:
                    recv[route.owner] += box_numel(box)
        stats.bytes_sent += sum(p.numel() for r, ps in send.items() if r != me for p in ps) * work.wire_dtype.itemsize
        return start_all_to_all(work.comm, send, recv, work.wire_dtype, device)

    def unpack_back(self, work, bucket, received: dict[int, Tensor], scratch: StepScratch, active) -> None:
        """Copy the update pieces of one bucket's return exchange into the per-parameter update buffers."""
        me = work.comm.mesh_rank
        offsets: dict[int, int] = defaultdict(int)
        for route in self._active_routes(work, bucket, active):
            e = self.entries[route.spec.param_index]
            for holder, box in route.holders:
                if holder != me:
                    continue
                n = box_numel(box)
                chunk = received[route.owner][offsets[route.owner] : offsets[route.owner] + n]
                offsets[route.owner] += n
                target = scratch.updates_out[e.index][relative_slices(box, e.layout.local_box)]
                target.copy_(chunk.view(target.shape))

    # ------------------------------------------------------------------ baseline: every rank computes all
    def _gather_all(self, work: MeshWork, scratch: StepScratch, active, timer, stats) -> None:
        """Baseline: ``full_tensor()`` of U on every rank, every matrix orthogonalized on every rank."""
        jobs = []
        fulls: dict[int, Tensor] = {}
        with timer.phase("gather_all"):
            for e in work.entries:
                if e.index not in active:
                    continue
                u = DTensor.from_local(
                    scratch.updates_in[e.index],
                    e.param.device_mesh,
                    e.param.placements,
                    run_check=False,
                    shape=e.param.shape,
                    stride=e.param.stride(),
                )
                fulls[e.index] = u.full_tensor()
                stats.bytes_sent += (
                    scratch.updates_in[e.index].numel()
                    * scratch.updates_in[e.index].element_size()
                    * (work.comm.world_size - 1)
                )
        with timer.phase("owner_compute"):
            for route in work.plan.routes:
                e = self.entries[route.spec.param_index]
                if e.index in fulls:
                    jobs.append((route, e, fulls[e.index][box_slices(route.spec.box)]))
            outs = self._orthogonalize(jobs, stats)
            full_out = {i: torch.empty_like(f, dtype=work.wire_dtype) for i, f in fulls.items()}
            for (route, e, _), o in zip(jobs, outs):
                target = full_out[e.index][box_slices(route.spec.box)]
                target.copy_(o.reshape(target.shape))
            for i, f in full_out.items():
                e = self.entries[i]
                scratch.updates_out[i].copy_(f[box_slices(e.layout.local_box)])

    # ------------------------------------------------------------------ apply
    def apply_one(self, index: int, update: Tensor, lr: float, weight_decay: float, lr_adjusted: float) -> None:
        """θ ← θ·(1 − γλ) − γ'·O on this rank's shard of parameter ``index``."""
        muon_rule.apply(local(self.entries[index].param), update, lr, weight_decay, lr_adjusted)


def _wrong_piece(e: Entry, what: str, t: DTensor) -> PreflightError:
    return PreflightError(
        e,
        f"this rank's local piece of the {what} has shape {tuple(t.to_local().shape)}; the layout (global shape "
        f"{tuple(e.param.shape)}, placements {tuple(e.param.placements)}) gives mesh rank {e.layout.mesh_rank} "
        f"the box {e.layout.local_box}, shape {box_shape(e.layout.local_box)}",
    )


def _hyperparameters(e: Entry) -> tuple[float, float, float]:
    """(γ, λ, γ') of a Muon parameter, read from its group now (schedulers may change them later)."""
    lr = e.group["lr"]
    return lr, e.group["weight_decay"], muon_rule.adjusted_lr(lr, e.group["adjust_lr_fn"], matrix_shape(e.param.shape))


def _check_same_plan_everywhere(plan: Plan, comm: MeshGroup) -> None:
    """Compare the plan digest across the mesh's ranks; raise on every rank if any differs."""
    if comm.group is None:
        return
    mine = torch.tensor([int(plan.digest[:15], 16)], dtype=torch.int64)
    backend = dist.get_backend(comm.group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    gathered = [torch.zeros_like(mine, device=device) for _ in range(comm.world_size)]
    dist.all_gather(gathered, mine.to(device), group=comm.group)
    values = {int(t.item()) for t in gathered}
    if len(values) != 1:
        raise RuntimeError(
            f"the Muon plan differs across ranks ({len(values)} different digests): the ranks were given "
            "different parameter names, shapes, placements or options"
        )
