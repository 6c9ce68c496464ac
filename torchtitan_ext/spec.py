"""Train specs for torchtitan's models whose optimizer builders understand the matrix optimizers
(Muon, MOP, NorMuon, SOAP, KLSOAP, REKLS: :data:`torchtitan_ext.registry.REGISTRY`).

Each spec is torchtitan's own with three builders swapped:

- ``build_optimizers_fn``: :mod:`torchtitan_ext.optimizer` (the registry's optimizers; Adam/AdamW
  unchanged; MoE models keep the expert-bias hook);
- ``build_metrics_processor_fn``: :class:`torchtitan_ext.metrics.OptimizerMetricsProcessor`. It is
  also where the optimizers' sections (``[muon]``, ``[mop]``, ``[normuon]``) reach the optimizer
  builder: torchtitan 0.2.2 passes only the ``[optimizer]`` section to ``build_optimizers_fn`` but the
  whole JobConfig to ``build_metrics_processor_fn``, which it calls first; so that hook checks
  ``[optimizer] name`` and attaches the sections to the ``[optimizer]`` object
  (:func:`torchtitan_ext.registry.attach_sections`);
- ``parallelize_fn``: torchtitan's, then FSDP2 SUM reductions when the backend is gloo
  (:func:`torchtitan_ext.cpu.use_sum_reduction`).

Registered under the built-in names, these specs take priority over torchtitan's. The launcher
(``python -m torchtitan_ext.train``) also puts :func:`ensure_pp_loss_visible` in place of torchtitan's warning that
rank 0 shows no pipeline-parallel loss, kept for the specs that do not log through this metrics processor.
"""

import dataclasses
import functools
from collections.abc import Callable
from importlib import import_module

from torch import nn
from torchtitan.components.metrics import ensure_pp_loss_visible as titan_ensure_pp_loss_visible
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models import _supported_models
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from torchtitan_ext.batch_scaling import apply_batch_scaling
from torchtitan_ext.cpu import use_sum_reduction
from torchtitan_ext.metrics import OptimizerMetricsProcessor
from torchtitan_ext.optimizer import REPLACEMENTS
from torchtitan_ext.registry import attach_sections, check_optimizer_name

MODELS = ("llama3", "deepseek_v3", "qwen3", "llama4")
"""torchtitan models whose specs are replaced (those of them present in the installed torchtitan)."""


def build_metrics_processor(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args: object | None = None,
    tag: str | None = None,
) -> OptimizerMetricsProcessor:
    """Check ``[optimizer] name``, attach the matrix optimizers' sections to ``[optimizer]``, scale its lr to the
    global batch (``[batch_scaling]``, :mod:`torchtitan_ext.batch_scaling`), and build the metrics processor."""
    check_optimizer_name(job_config.optimizer.name)
    attach_sections(job_config)
    apply_batch_scaling(job_config, parallel_dims)
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
    """Register a spec with these builders under each name of :data:`MODELS` that torchtitan has; return the names."""
    names = [name for name in MODELS if name in _supported_models]
    for name in names:
        base = import_module(f"torchtitan.models.{name}").get_train_spec()
        register_train_spec(name, muon_train_spec(base))
    return names


def ensure_pp_loss_visible(parallel_dims, job_config, color) -> None:
    """torchtitan's warning that rank 0 shows no loss under pipeline parallelism (naming its
    ``run_train.sh``), kept only for models whose spec does not log through
    :class:`OptimizerMetricsProcessor`, which shows the last stage's loss on every rank."""
    if get_train_spec(job_config.model.name).build_metrics_processor_fn is build_metrics_processor:
        return
    titan_ensure_pp_loss_visible(parallel_dims, job_config, color)
