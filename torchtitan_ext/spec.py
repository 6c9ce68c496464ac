"""Train specs for torchtitan's models with optimizers, whose builders understand Muon.

Each spec is torchtitan's own with three builders swapped:

- ``build_optimizers_fn``: :mod:`torchtitan_ext.optimizer` (Muon; Adam/AdamW unchanged; MoE models
  keep the expert-bias hook);
- ``build_metrics_processor_fn``: :class:`torchtitan_ext.metrics.OptimizerMetricsProcessor`. It is
  also where the ``[muon]`` section reaches the optimizer builder: torchtitan 0.2.2 passes only the
  ``[optimizer]`` section to ``build_optimizers_fn`` but the whole JobConfig to
  ``build_metrics_processor_fn``, which it calls first; so that hook checks ``[optimizer] name``
  and attaches ``[muon]`` to the ``[optimizer]`` object;
- ``parallelize_fn``: torchtitan's, then FSDP2 SUM reductions when the backend is gloo
  (:func:`torchtitan_ext.cpu.use_sum_reduction`).

Registered under the built-in names, these specs take priority over torchtitan's.
"""

import dataclasses
import functools
from collections.abc import Callable
from importlib import import_module

from torch import nn
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models import _supported_models
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

from torchtitan_ext.cpu import use_sum_reduction
from torchtitan_ext.job_config import Muon as MuonConfig
from torchtitan_ext.job_config import check_optimizer_name
from torchtitan_ext.metrics import OptimizerMetricsProcessor
from torchtitan_ext.optimizer import MUON_SECTION_ATTR, REPLACEMENTS

MODELS = ("llama3", "deepseek_v3", "qwen3", "llama4")
"""torchtitan models whose specs are replaced (those of them present in the installed torchtitan)."""


def build_metrics_processor(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args: object | None = None,
    tag: str | None = None,
) -> OptimizerMetricsProcessor:
    """Check ``[optimizer] name``, attach ``[muon]`` to ``[optimizer]``, and build the metrics processor."""
    check_optimizer_name(job_config.optimizer.name)
    muon = getattr(job_config, "muon", None) or MuonConfig()
    setattr(job_config.optimizer, MUON_SECTION_ATTR, muon)
    return OptimizerMetricsProcessor(job_config, parallel_dims, tag)


def _with_gloo_sum_reduction(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *args, **kwargs) -> nn.Module:
        model = parallelize_fn(model, *args, **kwargs)
        use_sum_reduction(model)
        return model

    return parallelize


def muon_train_spec(base: TrainSpec) -> TrainSpec:
    """``base`` with the builders described in the module docstring."""
    if base.build_metrics_processor_fn is not None:
        raise ValueError("the base train spec already has a metrics processor; refusing to replace it")
    return dataclasses.replace(
        base,
        build_optimizers_fn=REPLACEMENTS[base.build_optimizers_fn],
        build_metrics_processor_fn=build_metrics_processor,
        parallelize_fn=_with_gloo_sum_reduction(base.parallelize_fn),
    )


def register_all() -> list[str]:
    """Register a Muon-aware spec under each name of :data:`MODELS` that torchtitan has; return the names."""
    names = [name for name in MODELS if name in _supported_models]
    for name in names:
        base = import_module(f"torchtitan.models.{name}").get_train_spec()
        register_train_spec(name, muon_train_spec(base))
    return names
