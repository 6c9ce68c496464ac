"""``build_optimizers_fn`` for torchtitan 0.2.2 train specs that understands the matrix optimizers of
:data:`torchtitan_ext.registry.REGISTRY`: ``[optimizer] name = "Muon"``, ``"MOP"``, ``"NorMuon"``, ``"SOAP"``,
``"KLSOAP"`` or ``"REKLS"``.

Adam and AdamW go to torchtitan's own builders unchanged. For a matrix optimizer, each model part gets
one instance of its :mod:`dtensor_muon` class (:class:`dtensor_muon.Muon`, :class:`dtensor_muon.MOP`,
:class:`dtensor_muon.NorMuon`) over its *named* parameters: matrices (2-D, and 3-D MoE experts as
batches of matrices) take the matrix update; embeddings, the output head, norms and biases (routed by
name and ndim inside the optimizer) take AdamW. Both read lr / betas / eps / weight_decay from
``[optimizer]``, the rest from the optimizer's own section (``[muon]``, ``[mop]``, ``[normuon]``); the
matrices' lr is scaled to AdamW's update RMS by default (``adjust_lr_fn = "match_rms_adamw"``; for MOP
with ``scale = "shape"``), so one lr serves both. ``[muon]``/``[normuon]`` ``ns_dtype`` and ``wire_dtype`` left
unset are float32 in a job on CPU, which is logged (:func:`torchtitan_ext.sections.device_dtypes`).
"""

import dataclasses
import functools
from typing import Any

import torch.distributed as dist
from torch import nn
from torchtitan.components import optimizer as titan_optimizer
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from torchtitan_ext.metrics import combine
from torchtitan_ext.qk_clip import build_with_qk_clip
from torchtitan_ext.registry import (
    REGISTRY,
    check_optimizer_name,
    optimizer_kwargs,
    optimizer_section_kwargs,
    runs_on_cpu,
    section_of,
)
from torchtitan_ext.sections import device_dtypes_note


class MatrixOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container holding one matrix optimizer (a registry entry's class, e.g.
    :class:`dtensor_muon.Muon`) per model part.

    Stepping, zeroing, hooks and checkpointing (``get/set_optimizer_state_dict``, flattened by
    parameter name) are the base class's; only construction differs, because the matrix optimizers
    take named parameters. :attr:`metrics` exposes the optimizers' diagnostics to the metrics processor.
    """

    def __init__(
        self, model_parts: list[nn.Module], optimizer_cls: type[Any], optimizer_kwargs: dict[str, Any]
    ) -> None:
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for model in model_parts:
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            opt = build_with_qk_clip(functools.partial(optimizer_cls, named), model, optimizer_kwargs)
            if optimizer_kwargs.get("overlap"):
                opt.attach(model)
            self.optimizers.append(opt)
            all_params.extend(p for _, p in named)
        self._validate_length(len(model_parts))
        self._post_init(all_params, optimizer_kwargs)

    @property
    def metrics(self) -> dict[str, float]:
        """The latest ``opt.metrics`` of every part's optimizer, combined over the parts of this rank (times,
        bytes and FLOPs add up; see :data:`torchtitan_ext.metrics.REDUCTIONS`)."""
        return combine((opt.metrics for opt in self.optimizers), over="parts")


def build_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims,
    ft_manager: FTManager | None = None,
) -> OptimizersContainer:
    """torchtitan's ``build_optimizers`` plus the names of :data:`~torchtitan_ext.registry.REGISTRY`."""
    name = optimizer_config.name
    check_optimizer_name(name)
    if name not in REGISTRY:
        return titan_optimizer.build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if optimizer_config.early_step_in_backward:
        raise NotImplementedError(f"[optimizer] early_step_in_backward is not supported with {name}")
    if ft_manager is not None and ft_manager.enabled:
        raise NotImplementedError(f"torchft fault tolerance is not supported with {name}")
    on_cpu = runs_on_cpu(model_parts)
    kwargs = optimizer_kwargs(optimizer_config, on_cpu=on_cpu)
    if kwargs.get("qk_clip_tau") and parallel_dims is not None and parallel_dims.cp_enabled:
        raise NotImplementedError(
            f"[{REGISTRY[name].section}] qk_clip_tau with context parallelism is not supported: each rank's "
            "attention sees a shard of the sequence, whose logit maxima the plug-in does not reproduce"
        )
    first_rank = not dist.is_initialized() or dist.get_rank() == 0
    section = section_of(optimizer_config, REGISTRY[name])
    note = device_dtypes_note(section, on_cpu, f"[{section.SECTION}]")
    if note is not None and first_rank:
        logger.info(note)
    hint = setting_hint(name, kwargs)
    if hint is not None and first_rank:
        logger.warning(hint)
    return MatrixOptimizersContainer(model_parts, REGISTRY[name].optimizer_cls, kwargs)


def setting_hint(name: str, kwargs: dict[str, Any]) -> str | None:
    """A warning about a setting whose lr does not mean what ``[optimizer] lr`` means for Muon, or None: MOP with
    ``scale = "nuclear"`` steps by lr·ΣS (the momentum's nuclear norm), not by Muon's γ'."""
    if name == "MOP" and kwargs.get("scale") == "nuclear":
        return (
            f'MOP with [mop] scale = "nuclear": each matrix moves by lr·ΣS·O (ΣS: the momentum\'s nuclear norm), so '
            f"lr = {kwargs['lr']:g} is not Muon's lr (on the tiny Llama3 demo the updates were ~80x smaller than "
            "Muon's at the same lr). For Muon's per-shape lr use --mop.scale shape; with nuclear, sweep a larger lr."
        )
    return None


def build_optimizers_with_moe_load_balancing(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims,
    ft_manager: FTManager | None = None,
) -> OptimizersContainer:
    """torchtitan's MoE builder plus the names of :data:`~torchtitan_ext.registry.REGISTRY`, keeping its
    expert-bias load-balancing hook.

    For a matrix optimizer, torchtitan's own MoE builder is run once with AdamW (its optimizers hold no
    state until a step, so this is cheap) only to obtain the step pre-hook that updates the routers'
    expert biases; that hook, which reads the model and not the optimizer, moves to the matrix
    optimizers' container.
    """
    if optimizer_config.name not in REGISTRY:
        check_optimizer_name(optimizer_config.name)
        return titan_optimizer.build_optimizers_with_moe_load_balancing(
            model_parts, optimizer_config, parallel_dims, ft_manager
        )
    optimizers = build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    donor_config = dataclasses.replace(optimizer_config, name="AdamW", implementation="for-loop")
    donor = titan_optimizer.build_optimizers_with_moe_load_balancing(model_parts, donor_config, parallel_dims)
    for hook in donor._optimizer_step_pre_hooks.values():
        optimizers.register_step_pre_hook(hook)
    return optimizers


REPLACEMENTS = {
    titan_optimizer.build_optimizers_with_moe_load_balancing: build_optimizers_with_moe_load_balancing,
    titan_optimizer.build_optimizers: build_optimizers,
}
"""torchtitan's builders and the ones of this module that replace them in a train spec."""

__all__ = [
    "MatrixOptimizersContainer",
    "build_optimizers",
    "build_optimizers_with_moe_load_balancing",
    "optimizer_kwargs",
    "optimizer_section_kwargs",
]
