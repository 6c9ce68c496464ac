"""``--override.imports`` factories: any torchtitan 0.3 config, stock or not, trains with a matrix optimizer.

    -m torchtitan_ext.titan03.train --module llama3 --config llama3_debugmodel \
        --override.imports 'torchtitan_ext.titan03.overrides.muon={"ns_steps": 4}'

Each factory (:func:`muon`, :func:`mop`, :func:`normuon`, :func:`soap`, :func:`klsoap`, :func:`rekls`) claims
the config's ``OptimizersContainer.Config`` and returns a
:class:`~torchtitan_ext.titan03.container.MatrixOptimizersContainer.Config` for its registry entry
(:func:`~torchtitan_ext.titan03.container.matrix_optimizer_config`): lr, weight decay, betas and eps come
from the stock config's AdamW group, the JSON keyword arguments override them and set the entry's options
(``ns_steps``, ``precondition_frequency``, …). A key the entry does not take, or a bad value, stops the run
before any model is built, naming the valid keys or choices. Routing is the library's: embeddings,
``lm_head``, norms and biases take AdamW.

:func:`metrics` swaps torchtitan's ``MetricsProcessor.Config`` for
:class:`~torchtitan_ext.titan03.metrics.OptimizerMetricsProcessor`'s (the optimizer and FLOPs lines, the
optimizer's TensorBoard scalars). The launcher ``python -m torchtitan_ext.titan03.train`` does that by itself;
with plain ``-m torchtitan.train`` list it too: ``--override.imports torchtitan_ext.titan03.overrides.metrics``.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config.override import derive, override

from torchtitan_ext.titan03.container import MatrixOptimizersContainer, matrix_optimizer_config
from torchtitan_ext.titan03.metrics import OptimizerMetricsProcessor


@override(target=OptimizersContainer.Config, description="dtensor_muon.Muon (embeddings, lm_head, norms: AdamW)")
def muon(config: OptimizersContainer.Config, **options: Any) -> MatrixOptimizersContainer.Config:
    """The optimizer becomes :class:`dtensor_muon.Muon` with ``options`` (see the module docstring)."""
    return matrix_optimizer_config(config, "Muon", options)


@override(target=OptimizersContainer.Config, description="dtensor_muon.MOP (embeddings, lm_head, norms: AdamW)")
def mop(config: OptimizersContainer.Config, **options: Any) -> MatrixOptimizersContainer.Config:
    """The optimizer becomes :class:`dtensor_muon.MOP` with ``options`` (see the module docstring)."""
    return matrix_optimizer_config(config, "MOP", options)


@override(target=OptimizersContainer.Config, description="dtensor_muon.NorMuon (embeddings, lm_head, norms: AdamW)")
def normuon(config: OptimizersContainer.Config, **options: Any) -> MatrixOptimizersContainer.Config:
    """The optimizer becomes :class:`dtensor_muon.NorMuon` with ``options`` (see the module docstring)."""
    return matrix_optimizer_config(config, "NorMuon", options)


@override(target=OptimizersContainer.Config, description="dtensor_muon.SOAP (embeddings, lm_head, norms: AdamW)")
def soap(config: OptimizersContainer.Config, **options: Any) -> MatrixOptimizersContainer.Config:
    """The optimizer becomes :class:`dtensor_muon.SOAP` with ``options`` (see the module docstring)."""
    return matrix_optimizer_config(config, "SOAP", options)


@override(target=OptimizersContainer.Config, description="dtensor_muon.KLSOAP (embeddings, lm_head, norms: AdamW)")
def klsoap(config: OptimizersContainer.Config, **options: Any) -> MatrixOptimizersContainer.Config:
    """The optimizer becomes :class:`dtensor_muon.KLSOAP` with ``options`` (see the module docstring)."""
    return matrix_optimizer_config(config, "KLSOAP", options)


@override(target=OptimizersContainer.Config, description="dtensor_muon.REKLS (embeddings, lm_head, norms: AdamW)")
def rekls(config: OptimizersContainer.Config, **options: Any) -> MatrixOptimizersContainer.Config:
    """The optimizer becomes :class:`dtensor_muon.REKLS` with ``options`` (see the module docstring)."""
    return matrix_optimizer_config(config, "REKLS", options)


@override(target=MetricsProcessor.Config, exact=True, description="optimizer and FLOPs lines, optimizer scalars")
def metrics(config: MetricsProcessor.Config) -> OptimizerMetricsProcessor.Config:
    """torchtitan's metrics options, logged by :class:`OptimizerMetricsProcessor`."""
    return derive(config, OptimizerMetricsProcessor.Config)
