"""torchtitan's MetricsProcessor, plus the optimizer's diagnostics, reduced over ranks, in every log record.

torchtitan 0.2.2 logs one record per ``metrics.log_freq`` steps through ``MetricsProcessor.log`` (to
stdout and to TensorBoard/W&B); the trainer calls it on every rank at the same steps (``should_log``
is ``step == 1 or step % log_freq == 0``, the same on every rank). On those steps only,
:class:`OptimizerMetricsProcessor`

- gathers the optimizer container's ``metrics`` (``muon/...``, for Muon, MOP and NorMuon alike) from
  every rank (one ``all_gather_object`` over the default group; steps that do not log run no
  collective) and reduces them key by key as :data:`REDUCTIONS` says, so that every rank, and the
  record written to TensorBoard, holds the same global values;
- with pipeline parallelism, replaces the loss of stages that compute none (torchtitan's -1) by the
  last stage's loss (a max over ranks in the same gather), so rank 0's console shows the real loss;
- adds the optimizer's share of the FLOPs (``muon/optimizer_tflops_per_step``,
  ``tflops_with_optimizer``, ``mfu_with_optimizer(%)``: see :func:`flops_metrics`);
- prints two lines after torchtitan's own: the optimizer line (:func:`optimizer_line`) and, where
  the optimizer reports its FLOPs, the FLOPs/MFU line (:func:`flops_line`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed as dist
from torchtitan.components.metrics import BaseLogger, MetricsProcessor
from torchtitan.tools.logging import logger

from torchtitan_ext.job_config import describe

REDUCTIONS: tuple[tuple[str, str, str], ...] = (
    # (key or key prefix, over the model parts of one rank, over ranks)
    ("muon/update_rms/", "rms", "rms"),  # root mean square of the ranks that report it (exact for equal sizes)
    ("muon/update_rms_max/", "max", "max"),  # the largest single matrix's
    ("muon/time_", "sum", "max"),  # the parts step one after another; the slowest rank sets the step
    ("muon/bytes_sent", "sum", "max"),  # the busiest rank's bytes
    ("muon/optimizer_flops", "sum", "sum"),  # all the Newton–Schulz FLOPs of the step
    ("muon/nonfinite_updates", "sum", "sum"),
    ("muon/sigma_min", "min", "min"),
    ("muon/sigma_max", "max", "max"),
    ("muon/orthogonality_error", "max", "max"),
    ("muon/skipped_steps", "max", "max"),
    ("muon/step_skipped", "max", "max"),
    ("muon/plan_", "max", "max"),
    ("muon/qk_clip/max_logit", "max", "max"),  # global already: the same on every rank
    ("muon/qk_clip/heads_clipped", "sum", "max"),  # the parts hold different layers; the ranks agree
)
"""How each optimizer metric is combined: first the key itself, then the longest matching prefix; other keys take max."""

DEFAULT_REDUCTION = "max"

_PP_LOSSES = "global_avg_loss", "global_max_loss"


def reduction_of(key: str, over: str = "ranks") -> str:
    """The reduction ("max", "min", "sum" or "rms") of ``key`` over ``"parts"`` or ``"ranks"``."""
    column = {"parts": 1, "ranks": 2}[over]
    best = max((row for row in REDUCTIONS if key.startswith(row[0])), key=lambda row: len(row[0]), default=None)
    return best[column] if best else DEFAULT_REDUCTION


def combine(dicts: Iterable[Mapping[str, float]], over: str = "ranks") -> dict[str, float]:
    """Combine metric dicts key by key (see :data:`REDUCTIONS`); a key missing from a dict is not counted."""
    values: dict[str, list[float]] = {}
    for d in dicts:
        for key, value in d.items():
            values.setdefault(key, []).append(float(value))
    out = {}
    for key, vs in values.items():
        how = reduction_of(key, over)
        if how == "sum":
            out[key] = math.fsum(vs)
        elif how == "min":
            out[key] = min(vs)
        elif how == "rms":
            out[key] = math.sqrt(math.fsum(v * v for v in vs) / len(vs))
        else:
            out[key] = max(vs)
    return out


def gather_and_reduce(
    local: Mapping[str, float], losses: tuple[float, float] | None = None
) -> tuple[dict[str, float], tuple[float, float] | None]:
    """Collective over the default group: every rank's ``local`` metrics combined over ranks, and the
    max of each of the ``losses`` pairs (``None`` stays ``None``). Every rank must call it."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(local), losses
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dict(local), losses))
    reduced = combine(metrics for metrics, _ in gathered)
    pairs = [pair for _, pair in gathered if pair is not None]
    return reduced, (max(p[0] for p in pairs), max(p[1] for p in pairs)) if pairs else None


def flops_metrics(
    metrics: Mapping[str, float], model_flops_per_step: float, world_size: int, peak_known: bool
) -> dict[str, float]:
    """The optimizer's share of the FLOPs, from a record that holds torchtitan's ``tflops`` and ``mfu(%)``
    and the reduced ``muon/optimizer_flops`` (all ranks' Newton–Schulz FLOPs of the step).

    ``model_flops_per_step`` is torchtitan's model FLOPs of one step over all ranks (FLOPs per token
    × tokens of the global batch). With r = optimizer FLOPs / model FLOPs of a step, counting both
    multiplies torchtitan's per-device ``tflops`` and ``mfu(%)`` by 1 + r (same time, same peak).
    Returns ``muon/optimizer_tflops_per_step`` (per device), ``muon/optimizer_flops_share(%)`` (100·r),
    ``tflops_with_optimizer`` and, where the peak is a real one (``peak_known``; not on CPU, where
    torchtitan divides by an A100's), ``mfu_with_optimizer(%)``. Empty without ``muon/optimizer_flops``.
    """
    optimizer_flops = metrics.get("muon/optimizer_flops")
    if optimizer_flops is None or model_flops_per_step <= 0:
        return {}
    share = optimizer_flops / model_flops_per_step
    out = {
        "muon/optimizer_tflops_per_step": optimizer_flops / world_size / 1e12,
        "muon/optimizer_flops_share(%)": 100 * share,
    }
    if "tflops" in metrics:
        out["tflops_with_optimizer"] = metrics["tflops"] * (1 + share)
    if peak_known and "mfu(%)" in metrics:
        out["mfu_with_optimizer(%)"] = metrics["mfu(%)"] * (1 + share)
    return out


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}B"


def optimizer_line(m: Mapping[str, float]) -> str | None:
    """The compact optimizer line of a log step (``None`` without any ``muon/`` metric)."""
    if not any(key.startswith("muon/") for key in m):
        return None
    parts = []
    kinds = sorted(
        (k.removeprefix("muon/update_rms/") for k in m if k.startswith("muon/update_rms/")), key="adamw".__eq__
    )
    rms = []  # the matrix rule's first (with its largest single matrix's), then AdamW's
    for kind in kinds:
        peak = m.get(f"muon/update_rms_max/{kind}")
        rms.append(f"{kind} {m[f'muon/update_rms/{kind}']:.2e}" + (f" (max {peak:.2e})" if peak is not None else ""))
    if rms:
        parts.append("update_rms " + " ".join(rms))
    if "muon/skipped_steps" in m:
        parts.append(f"skipped {m['muon/skipped_steps']:.0f}")
    if "muon/time_step_ms" in m:
        parts.append(f"time {m['muon/time_step_ms']:.1f}ms")
    if "muon/bytes_sent" in m:
        parts.append(f"exchange {_bytes(m['muon/bytes_sent'])}")
    if "muon/sigma_min" in m and "muon/sigma_max" in m:
        parts.append(f"σ [{m['muon/sigma_min']:.3f}, {m['muon/sigma_max']:.3f}]")
    if "muon/orthogonality_error" in m:
        parts.append(f"orth_err {m['muon/orthogonality_error']:.3f}")
    if "muon/qk_clip/max_logit" in m:
        parts.append(f"qk_clip max {m['muon/qk_clip/max_logit']:.4g} clipped {m['muon/qk_clip/heads_clipped']:.0f}")
    if m.get("muon/nonfinite_updates", 0) > 0:
        parts.append(f"nonfinite {m['muon/nonfinite_updates']:.0f}")
    return "optimizer: " + "  ".join(parts)


def flops_line(m: Mapping[str, float]) -> str | None:
    """The FLOPs/MFU line of a log step (``None`` where the optimizer reports no FLOPs)."""
    if "muon/optimizer_tflops_per_step" not in m:
        return None
    line = (
        f"flops: model {m['tflops']:.3g} TFLOP/s, optimizer {m['muon/optimizer_tflops_per_step']:.3g} TFLOP/step "
        f"(+{m['muon/optimizer_flops_share(%)']:.2f}% of the model's), "
        f"both {m['tflops_with_optimizer']:.3g} TFLOP/s per device"
    )
    if "mfu_with_optimizer(%)" in m:
        return f"{line}  mfu: {m['mfu(%)']:.2f}% model only, {m['mfu_with_optimizer(%)']:.2f}% with optimizer"
    return f"{line}  mfu: not computed on CPU"


class _DerivingLogger(BaseLogger):
    """Adds ``derive(record)`` to each record before handing it to ``inner``; keeps the last record."""

    def __init__(self, inner: BaseLogger, derive: Callable[[Mapping[str, float]], dict[str, float]]) -> None:
        self.inner, self.derive = inner, derive
        self.last: dict[str, Any] = {}

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.last = {**metrics, **self.derive(metrics)}
        self.inner.log(self.last, step)

    def close(self) -> None:
        self.inner.close()


JOB_TAG = "job"
"""TensorBoard text tag holding :func:`torchtitan_ext.job_config.describe` of the run (read by the summary)."""


def record_job(metric_logger: BaseLogger, line: str) -> None:
    """Write ``line`` as the text ``JOB_TAG`` into every TensorBoard writer of torchtitan's ``metric_logger``
    (a ``LoggerContainer`` or one logger; ranks that do not log have none)."""
    for inner in getattr(metric_logger, "_loggers", [metric_logger]):
        writer = getattr(inner, "writer", None)
        if writer is not None and hasattr(writer, "add_text"):
            writer.add_text(JOB_TAG, line)


class OptimizerMetricsProcessor(MetricsProcessor):
    """MetricsProcessor whose records also hold the optimizer's metrics of the latest step, reduced over
    ranks, and the FLOPs counting the optimizer; see the module docstring."""

    def __init__(self, job_config, parallel_dims, tag: str | None = None) -> None:
        super().__init__(job_config, parallel_dims, tag)
        record_job(self.logger, describe(job_config))
        self.logger = _DerivingLogger(self.logger, self._flops_metrics)

    def optimizer_metrics(self) -> dict[str, float]:
        """This rank's container ``metrics`` (empty for containers without one, e.g. torchtitan's AdamW)."""
        return dict(getattr(self.optimizers, "metrics", None) or {})

    def model_flops_per_step(self) -> float:
        """torchtitan's model FLOPs of one training step over all ranks (FLOPs per token × global batch tokens)."""
        training, dims = self.job_config.training, self.parallel_dims
        global_batch = training.global_batch_size
        if global_batch < 0:
            global_batch = training.local_batch_size * dims.dp_replicate * dims.dp_shard
        return float(self.num_flops_per_token) * global_batch * training.seq_len

    def _flops_metrics(self, record: Mapping[str, float]) -> dict[str, float]:
        peak_known = self.device_memory_monitor.device.type != "cpu"
        return flops_metrics(record, self.model_flops_per_step(), self.parallel_dims.world_size, peak_known)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        """Log as torchtitan does, with the reduced optimizer metrics (and PP's last-stage loss), then the
        optimizer line and the FLOPs line. The gather runs here, at log steps only, on every rank."""
        reports = hasattr(self.optimizers, "metrics")  # the same container type on every rank
        pp = self.parallel_dims.pp_enabled
        optimizer = self.optimizer_metrics()
        if reports or pp:
            optimizer, losses = gather_and_reduce(optimizer, (global_avg_loss, global_max_loss) if pp else None)
            if losses is not None:
                global_avg_loss, global_max_loss = losses
        merged = {**(extra_metrics or {}), **optimizer}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=merged)
        color = self.color
        for line, tint in ((optimizer_line(self.logger.last), color.blue), (flops_line(self.logger.last), color.cyan)):
            if line:
                logger.info(f"{tint}{line}{color.reset}")
