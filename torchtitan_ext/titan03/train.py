"""``python -m torchtitan_ext.titan03.train --module M --config F [overrides]`` (under torchrun), torchtitan 0.3.

Runs torchtitan's own ``torchtitan.train.main`` and its ``Trainer`` unchanged, with three preparations:

- where no GPU is present, the CPU path of :mod:`torchtitan_ext.titan03.cpu` (device globals, dense
  attention, and FSDP2 SUM reductions through the model spec's ``parallelize_fn``), and the command line
  starts with :data:`~torchtitan_ext.titan03.cpu.CPU_ARGS` (``partial_dtensor``, no CUDA graphs; later
  arguments still win);
- a config whose metrics are torchtitan's plain ``MetricsProcessor.Config`` logs through
  :class:`~torchtitan_ext.titan03.metrics.OptimizerMetricsProcessor` (the optimizer and FLOPs lines; with
  torchtitan's own optimizers it logs as torchtitan does), so ``--override.imports
  torchtitan_ext.titan03.overrides.muon`` on a stock config needs nothing else;
- the offline corpus and tokenizer of :mod:`torchtitan_ext.data` are built when missing.

Both happen when the config is parsed (``ConfigManager.parse_args``), before torchtitan builds anything.
After a successful run the process leaves through :func:`dtensor_muon.exit_without_finalization` (see
:mod:`torchtitan_ext.train` for why: a gloo worker thread can abort CPython's finalization).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

from dtensor_muon import exit_without_finalization
from torchtitan_ext import data
from torchtitan_ext.titan03 import cpu


def adapt(config: Any, on_cpu: bool) -> Any:
    """Apply the launcher's preparations (module docstring) to a parsed ``Trainer.Config``; return it."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config.override import derive

    from torchtitan_ext.titan03.metrics import OptimizerMetricsProcessor

    if type(config.metrics) is MetricsProcessor.Config:
        config.metrics = derive(config.metrics, OptimizerMetricsProcessor.Config)
    if on_cpu and config.model_spec is not None:
        config.model_spec.parallelize_fn = cpu.with_sum_reduction(config.model_spec.parallelize_fn)
    return config


def _adapting(parse_args: Callable[..., Any], on_cpu: bool) -> Callable[..., Any]:
    @functools.wraps(parse_args)
    def adapted(self: Any, args: list[str] | None = None) -> Any:
        args = sys.argv[1:] if args is None else args
        config = parse_args(self, [*cpu.CPU_ARGS, *args] if on_cpu else args)
        self.config = adapt(config, on_cpu)
        return self.config

    adapted.adapts = True
    return adapted


def main() -> None:
    """Prepare the process (module docstring), hand over to ``torchtitan.train.main``, then exit without
    finalization."""
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        cpu.use_cpu_gloo()
    data.build(data.DEFAULT_OUT)
    import torchtitan.train
    from torchtitan.config import ConfigManager

    if not getattr(ConfigManager.parse_args, "adapts", False):
        ConfigManager.parse_args = _adapting(ConfigManager.parse_args, on_cpu)
    torchtitan.train.main()
    exit_without_finalization()


if __name__ == "__main__":
    main()
