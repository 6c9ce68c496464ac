"""torchtitan's MetricsProcessor, plus the optimizer's own diagnostics in every log record.

torchtitan 0.2.2 logs one record per ``metrics.log_freq`` steps through ``MetricsProcessor.log``
(to stdout and to TensorBoard/W&B). The trainer sets ``metrics_processor.optimizers`` to its
optimizers container; when that container has a ``metrics`` mapping (the Muon container does),
its keys (``muon/...``) join the record as they are, whatever keys the optimizer reports.
"""

from typing import Any

from torchtitan.components.metrics import MetricsProcessor


class OptimizerMetricsProcessor(MetricsProcessor):
    """MetricsProcessor whose records also hold ``optimizers.metrics`` of the latest step."""

    def optimizer_metrics(self) -> dict[str, float]:
        """The container's ``metrics`` (empty for containers without one, e.g. torchtitan's AdamW)."""
        return dict(getattr(self.optimizers, "metrics", None) or {})

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        """Log as torchtitan does, with the optimizer's metrics added to ``extra_metrics``."""
        merged = {**(extra_metrics or {}), **self.optimizer_metrics()}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=merged)
