"""Diagnostics of one optimizer step, as a flat ``dict[str, float]`` ready for a logger.

Every key is rank-local (what this rank did; no extra collective). "Typical" values were measured on
torchtitan's Llama3 debugmodel (dim 256, 6 layers, vocab 2048; batch 4 × 256; lr 1e-2, Keller's
coefficients, ``adjust_lr_fn="match_rms_adamw"``) on one CPU process.

- ``muon/time_<phase>_ms``: host wall time of each phase (preflight, consensus, redistribute, prepare,
  local_compute, exchange_out_launch, exchange_out_wait, owner_compute, exchange_back_launch (packing the
  exchanges back and launching them, which a step over several ranks does after the outcome), outcome (the
  agreement that every rank's directions succeeded: it waits for the ranks and the exchanges out, not for the
  directions still queued on the device), adamw, finish; gather_all with ``exchange="gather_all"``). On CUDA it
  is launch time, not GPU time, except for outcome.
- ``muon/time_step_ms``: their sum. ``muon/time_deferred_finish_ms`` (``overlap=True``): time spent applying
  the previous step's updates in forward pre-hooks and flushes.
- ``muon/bytes_sent``: bytes this rank put on the wire (exchange out + back); 0 on one rank.
- ``muon/optimizer_flops``: the rule's FLOPs run on this rank in this step, per matrix it computed (m ≤ n):
  Muon and NorMuon ``ns_steps · (4m²n + 2m³)`` (the Gram form runs fewer), MOP's SVD ``4m²n + 22m³``, the
  plan's cost model; summed over the
  ranks it is the step's total (each matrix once with ``exchange="owner"``, once per rank with
  ``"gather_all"``). 3.3·10¹⁰ for the debugmodel (42 matrices on one rank).
- ``muon/nonfinite_updates``: matrices whose Newton–Schulz output was not finite on this rank in this step
  (an inf/NaN gradient or momentum; their parameters become NaN). 0 normally; the first one also warns
  (``RuntimeWarning``, once). ``skip_nonfinite=True`` skips such steps on every rank instead.
- ``muon/skipped_steps``: steps skipped so far (``skip_nonfinite=True``); ``muon/step_skipped``: 1.0 on a skipped
  step, whose metrics are only these two.
- ``muon/plan_imbalance``: max/mean of the per-rank cost the plan balanced (worst mesh); 1.0 is perfect
  balance. The cost is the rule's ``MatrixCost.planned``: FLOPs, or for SOAP its operations' time as TF32
  product FLOPs.
- ``muon/plan_max_gflop``: the busiest rank's planned cost per step, in GFLOP (worst mesh).
- ``muon/plan_owner_state_mb``: the most owner state one rank keeps (MiB; rules with owner state only, e.g.
  NorMuon: 4 bytes per matrix row).
- ``muon/update_rms/<rule>`` (``muon``, ``mop``, ``normuon``, ``soap``): RMS of γ'·O over the matrices this
  rank computed (a run about to diverge shows here first: SOAP's is at most lr by default). For Muon, with
  ``adjust_lr_fn="match_rms_adamw"`` about 0.2·lr·(RMS of σ) (0.0018 at lr 1e-2); with the default
  ``"original"`` about lr·√(max(1, A/B)/max(A, B)) per A×B matrix, less where σ < 1.
- ``muon/update_rms_max/<rule>``: the largest RMS(γ'·O) of one matrix this rank computed: one matrix blowing
  up shows here even when the mean over many matrices hides it.
- ``muon/update_rms/adamw``: RMS of the AdamW parameter change on this rank (diagnostic steps only); a
  fraction of lr (0.0035–0.0084 at lr 1e-2 over the debugmodel's first 12 steps).
- ``muon/sigma_min``, ``muon/sigma_max``, ``muon/orthogonality_error`` (diagnostic steps only, every
  ``diagnostics_interval`` steps): the smallest and largest singular value of the first Newton–Schulz output
  of the step on this rank, and max |σ − 1|. Newton–Schulz maps σ toward 1, not onto it: Keller's
  coefficients (``"simple"``, the default) put a well-conditioned input's σ in about [0.68, 1.14] (measured:
  Gaussian 64×256 and 256×1024), so the error is about 0.32; singular values far below the largest stay
  small, and momentum matrices are ill-conditioned: on the debugmodel σ_max 1.20, σ_min 0.001–0.21 (median
  0.04), orthogonality_error 0.79–0.999 (median 0.96). A σ_max well above 1.2 or a growing error on
  well-conditioned inputs points at the coefficients or the Newton–Schulz dtype.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from ..plan import Plan


class PhaseTimer:
    """Accumulates wall time per named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


class StepStats:
    """Running sums for update RMS, bytes and FLOPs; per-matrix update norms; one σ sample on diagnostic steps.

    Nothing here waits for the device during the step; :meth:`start_nonfinite_check` sends one scalar to the
    host asynchronously, and the per-matrix norms are sent (also asynchronously) only when it is not finite.
    """

    def __init__(self, sample_orthogonality: bool = False, rule: str = "muon") -> None:
        self.sample_orthogonality = sample_orthogonality
        self.rule = rule
        """The matrix rule's name: the key of its update RMS (``muon/update_rms/<rule>``)."""
        self.orthogonality_error: float | None = None
        self.sigma_min: float | None = None
        self.sigma_max: float | None = None
        self.bytes_sent = 0
        self.optimizer_flops = 0
        self.sq_sum: dict[str, Tensor | float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self.muon_norms: Tensor | None = None
        self.muon_names: list[str] = []
        self._unit_norms: list[Tensor] = []
        self._unit_scales: list[float | Tensor] = []
        self._unit_matrix_numel: list[int] = []
        self.max_matrix_rms: Tensor | None = None
        """max over this rank's matrices of RMS(γ'·O), on the device (after :meth:`start_nonfinite_check`)."""
        self._muon_sq_sum: tuple[Tensor, torch.cuda.Event | None] | None = None
        self._bad_matrices: tuple[Tensor, torch.cuda.Event | None] | None = None
        self._nonfinite: list[str] | None = None

    def add_update(self, kind: str, update: Tensor, scale: float = 1.0) -> Tensor:
        """Add an applied update ``scale·update`` to the RMS of ``kind`` (on-device sum: no sync here);
        returns ‖update‖ (float32, on the device)."""
        norm = torch.linalg.vector_norm(update, dtype=torch.float32)
        self.sq_sum[kind] = self.sq_sum[kind] + (norm * scale) ** 2
        self.count[kind] += update.numel()
        return norm

    def add_orthogonal(self, o: Tensor, lr_adjusted: float | Tensor, names: list[str]) -> None:
        """Add the Newton–Schulz outputs of one unit (``o``: [m, n] or [B, m, n], ``names`` one per matrix), each
        scaled by γ' in the update RMS: one norm over the batch (no sync), then :meth:`add_orthogonal_norms`."""
        norms = torch.linalg.vector_norm(o, dim=(-2, -1), dtype=torch.float32)
        self.add_orthogonal_norms(norms, lr_adjusted, names, o)

    def add_orthogonal_norms(self, norms: Tensor, lr_adjusted: float | Tensor, names: list[str], o: Tensor) -> None:
        """Add one unit's outputs ``o`` (as :meth:`add_orthogonal`) by their norms, already taken: ``norms`` holds
        ‖O_b‖_F in float32 on the device, one per matrix of ``o`` in order (the apply's pass may compute them).
        Their sum waits for :meth:`start_nonfinite_check`; on diagnostic steps the first unit whose first
        matrix is finite gives σ (read from ``o``)."""
        norms = norms.reshape(-1)
        self._unit_norms.append(norms)
        self._unit_scales.append(lr_adjusted)
        self._unit_matrix_numel.append(o.numel() // norms.numel())
        self.count[self.rule] += o.numel()
        self.muon_names.extend(names)
        if self.sample_orthogonality and self.orthogonality_error is None and bool(torch.isfinite(norms[0])):
            sigma = torch.linalg.svdvals((o if o.ndim == 2 else o[0]).detach().to(torch.float64))
            self.orthogonality_error = float((sigma - 1).abs().max())
            self.sigma_min, self.sigma_max = float(sigma.min()), float(sigma.max())

    def _sum_units(self) -> None:
        """Σ over matrices of (γ'·‖O‖)² into ``sq_sum[rule]`` and the largest matrix's RMS(γ'·O) into
        ``max_matrix_rms``, from every unit's norms: a few operations per step, whatever the number of units."""
        if not self._unit_norms:
            return
        norms = torch.cat(self._unit_norms)
        device = norms.device
        sizes = [n.numel() for n in self._unit_norms]
        inverse_sqrt_numel = [k**-0.5 for k, n in zip(self._unit_matrix_numel, sizes) for _ in range(n)]
        if all(not isinstance(s, Tensor) for s in self._unit_scales):
            per_matrix = [float(s) for s, n in zip(self._unit_scales, sizes) for _ in range(n)]
            scales, inverse_sqrt_numel = _to_device_async([per_matrix, inverse_sqrt_numel], device)
        else:  # a Tensor lr: its γ' stay on the device (no sync)
            per_unit = torch.stack(
                [torch.as_tensor(s, dtype=torch.float32, device=device).reshape(()) for s in self._unit_scales]
            )
            inverse_sqrt_numel = _to_device_async([inverse_sqrt_numel], device)[0]
            # per unit → per matrix; output_size given, so no host sync on the device
            repeats = _to_device_async([sizes], device, torch.int64)[0]
            scales = per_unit.repeat_interleave(repeats, output_size=norms.numel())
        self.muon_norms = norms
        scaled = norms * scales
        self.sq_sum[self.rule] = scaled.square().sum()
        self.max_matrix_rms = (scaled * inverse_sqrt_numel).max()
        self._unit_norms, self._unit_scales, self._unit_matrix_numel = [], [], []

    def add_flops(self, flops: int) -> None:
        """Count Newton–Schulz FLOPs run on this rank."""
        self.optimizer_flops += flops

    def start_nonfinite_check(self) -> None:
        """After the step's last Newton–Schulz output: the sum of the squared update norms (computed anyway
        for the update RMS) copied to the host without waiting. It is not finite exactly when some update is
        (a finite one has ‖O‖ ≤ 1.2·√min(m, n)), so one scalar copy tells whether any was."""
        self._sum_units()
        total = self.sq_sum.get(self.rule)
        if isinstance(total, Tensor):
            self._muon_sq_sum = _to_host_async(total)

    def any_nonfinite(self, wait: bool = True) -> bool | None:
        """Whether some Newton–Schulz output of the step was not finite (after :meth:`start_nonfinite_check`);
        None when ``wait`` is False and the answer has not reached the host yet."""
        if self._muon_sq_sum is None:
            return False
        total = _host_value(self._muon_sq_sum, wait)
        return None if total is None else not math.isfinite(float(total))

    def nonfinite_names(self, wait: bool = True) -> list[str] | None:
        """Names of the matrices whose Newton–Schulz output was not finite. Their norms are read only when
        :meth:`any_nonfinite` says some was, also without waiting: None (with ``wait`` False) until they
        have reached the host."""
        if self._nonfinite is None:
            bad = self.any_nonfinite(wait)
            if bad is None:
                return None
            if not bad:
                self._nonfinite = []
            else:
                if self._bad_matrices is None:
                    assert self.muon_norms is not None
                    self._bad_matrices = _to_host_async(~torch.isfinite(self.muon_norms))
                flags = _host_value(self._bad_matrices, wait)
                if flags is None:
                    return None
                self._nonfinite = [self.muon_names[i] for i in flags.nonzero().flatten().tolist()]
        return self._nonfinite


def _to_device_async(rows: list[list[float]], device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """``rows`` (equal lengths) as one tensor on ``device``; to CUDA from pinned memory without waiting (a copy
    from pageable memory would synchronize the host with the device)."""
    host = torch.tensor(rows, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _to_host_async(t: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """``t`` copied to the host without waiting: on CUDA into pinned memory, with an event marking arrival."""
    if not t.is_cuda:
        return t.cpu(), None
    host = t.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _host_value(copy: tuple[Tensor, torch.cuda.Event | None], wait: bool) -> Tensor | None:
    """The host tensor of :func:`_to_host_async` once it has arrived (waiting for it if ``wait``), else None."""
    host, ready = copy
    if ready is not None and not ready.query():
        if not wait:
            return None
        ready.synchronize()
    return host


def summarize(timer: PhaseTimer, stats: StepStats, plans: list[Plan], skipped_steps: int) -> dict[str, float]:
    """The flat metrics dict of a step."""
    out = {f"muon/time_{name}_ms": 1e3 * s for name, s in timer.seconds.items()}
    out["muon/time_step_ms"] = 1e3 * sum(timer.seconds.values())
    out["muon/bytes_sent"] = float(stats.bytes_sent)
    out["muon/optimizer_flops"] = float(stats.optimizer_flops)
    out["muon/nonfinite_updates"] = float(len(stats.nonfinite_names()))
    out["muon/skipped_steps"] = float(skipped_steps)
    if plans:
        out["muon/plan_imbalance"] = max(p.imbalance for p in plans)
        out["muon/plan_max_gflop"] = max(max(p.rank_flops) for p in plans) / 1e9
        owner_state = max(max(p.rank_owner_state_bytes, default=0) for p in plans)
        if owner_state:
            out["muon/plan_owner_state_mb"] = owner_state / 2**20
    for kind, total in stats.sq_sum.items():
        out[f"muon/update_rms/{kind}"] = (float(total) / max(1, stats.count[kind])) ** 0.5
    if stats.max_matrix_rms is not None:
        out[f"muon/update_rms_max/{stats.rule}"] = float(stats.max_matrix_rms)
    if stats.orthogonality_error is not None:
        out["muon/orthogonality_error"] = stats.orthogonality_error
        out["muon/sigma_min"] = stats.sigma_min
        out["muon/sigma_max"] = stats.sigma_max
    return out
