"""torchtitan 0.3's MetricsProcessor plus the optimizer's diagnostics, reduced over ranks, in every log record.

:class:`OptimizerMetricsProcessor` logs as torchtitan does and, at log steps (torchtitan calls ``log`` on every
rank at the same steps), also

- gathers the optimizer container's ``metrics`` (:class:`~torchtitan_ext.titan03.container.MatrixOptimizersContainer`)
  from every rank and reduces them key by key (:func:`torchtitan_ext.metrics.gather_and_reduce`; steps that do
  not log run no collective), so every rank and the TensorBoard record hold the same global values;
- adds the optimizer's share of the FLOPs (:func:`torchtitan_ext.metrics.flops_metrics`);
- prints the optimizer line and the FLOPs line after torchtitan's step line
  (:func:`torchtitan_ext.metrics.optimizer_line`, :func:`torchtitan_ext.metrics.flops_line`).

With torchtitan's own containers (AdamW) it logs exactly as torchtitan's processor. The model FLOPs of one
step over all ranks, which the optimizer's FLOPs are compared to, are torchtitan's FLOPs per token times the
tokens this rank saw since the last log, times the number of data-parallel replicas of the batch, per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from torchtitan_ext.metrics import _DerivingLogger, flops_line, flops_metrics, gather_and_reduce, optimizer_line


class OptimizerMetricsProcessor(MetricsProcessor):
    """MetricsProcessor whose records also hold the optimizer's metrics and FLOPs (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        """torchtitan's metrics options; the optimizer's metrics need none."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        MetricsProcessor.__init__(self, config, **kwargs)
        self.logger = _DerivingLogger(self.logger, self._flops_metrics)
        self._last_logged_step = 0
        self._model_flops_per_step = 0.0

    def _flops_metrics(self, record: dict[str, float]) -> dict[str, float]:
        peak_known = self.device_memory_monitor.device.type != "cpu"
        world = self.parallel_dims.world_size
        return flops_metrics(record, self._model_flops_per_step, world, peak_known)

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        """Log as torchtitan does, with the reduced optimizer metrics, then the optimizer and FLOPs lines."""
        steps = max(step - self._last_logged_step, 1)
        self._last_logged_step = step
        dims = self.parallel_dims
        replicas = dims.world_size // dims.non_data_parallel_size
        self._model_flops_per_step = self.num_flops_per_token * self.ntokens_since_last_log * replicas / steps
        optimizer: dict[str, float] = {}
        if hasattr(self.optimizers, "metrics"):  # the same container type on every rank
            optimizer, _ = gather_and_reduce(dict(self.optimizers.metrics))
        merged = {**(extra_metrics or {}), **optimizer}
        MetricsProcessor.log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=merged)
        color = self.color
        for line, tint in ((optimizer_line(self.logger.last), color.blue), (flops_line(self.logger.last), color.cyan)):
            if line:
                logger.info(f"{tint}{line}{color.reset}")
