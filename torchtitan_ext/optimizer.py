"""``build_optimizers_fn`` for torchtitan 0.2.2 train specs that understands ``[optimizer] name = "Muon"``.

Adam and AdamW go to torchtitan's own builders unchanged. For Muon, each model part gets one
:class:`dtensor_muon.Muon` over its *named* parameters: matrices (2-D, and 3-D MoE experts as
batches of matrices) take the Muon update; embeddings, the output head, norms and biases (routed
by name and ndim inside Muon) take AdamW. Both read lr / betas / eps / weight_decay from
``[optimizer]``; Muon's lr is scaled to AdamW's update RMS by default
(``[muon] adjust_lr_fn = "match_rms_adamw"``), so one lr serves both.
"""

import dataclasses
from typing import Any

import torch
from torch import nn
from torchtitan.components import optimizer as titan_optimizer
from torchtitan.components.ft import FTManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.config import Optimizer as OptimizerConfig
from torchtitan.distributed import ParallelDims

from torchtitan_ext.job_config import Muon as MuonConfig
from torchtitan_ext.job_config import check_optimizer_name
from torchtitan_ext.metrics import combine

MUON_SECTION_ATTR = "muon"
"""Attribute of the ``[optimizer]`` config object under which :mod:`torchtitan_ext.spec` attaches ``[muon]``."""


def muon_kwargs(optimizer_config: OptimizerConfig, muon_config: MuonConfig) -> dict[str, Any]:
    """Keyword arguments of :class:`dtensor_muon.Muon` from the ``[optimizer]`` and ``[muon]`` sections."""
    return {
        "lr": optimizer_config.lr,
        "weight_decay": optimizer_config.weight_decay,
        "momentum": muon_config.momentum,
        "nesterov": muon_config.nesterov,
        "ns_coefficients": muon_config.ns_coefficients,
        "ns_steps": muon_config.ns_steps,
        "adjust_lr_fn": muon_config.adjust_lr_fn,
        "adamw_betas": (optimizer_config.beta1, optimizer_config.beta2),
        "adamw_eps": optimizer_config.eps,
        "ns_dtype": getattr(torch, muon_config.ns_dtype),
        "ns_algorithm": muon_config.ns_algorithm,
        "wire_dtype": getattr(torch, muon_config.wire_dtype),
        "bucket_size_mb": muon_config.bucket_size_mb,
        "exchange": muon_config.exchange,
        "skip_nonfinite": muon_config.skip_nonfinite,
        "diagnostics_interval": muon_config.diagnostics_interval,
        "overlap": muon_config.overlap,
    }


class MuonOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizers container holding one :class:`dtensor_muon.Muon` per model part.

    Stepping, zeroing, hooks and checkpointing (``get/set_optimizer_state_dict``, flattened by
    parameter name) are the base class's; only construction differs, because Muon takes named
    parameters. :attr:`metrics` exposes the optimizers' diagnostics to the metrics processor.
    """

    def __init__(self, model_parts: list[nn.Module], optimizer_kwargs: dict[str, Any]) -> None:
        from dtensor_muon import Muon

        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for model in model_parts:
            named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
            opt = Muon(named, **optimizer_kwargs)
            if optimizer_kwargs.get("overlap"):
                opt.attach(model)
            self.optimizers.append(opt)
            all_params.extend(p for _, p in named)
        self._validate_length(len(model_parts))
        self._post_init(all_params, optimizer_kwargs)

    @property
    def metrics(self) -> dict[str, float]:
        """The latest ``opt.metrics`` of every part's Muon, combined over the parts of this rank (times,
        bytes and FLOPs add up; see :data:`torchtitan_ext.metrics.REDUCTIONS`)."""
        return combine((opt.metrics for opt in self.optimizers), over="parts")


def _muon_section(optimizer_config: OptimizerConfig) -> MuonConfig:
    return getattr(optimizer_config, MUON_SECTION_ATTR, None) or MuonConfig()


def build_optimizers(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims,
    ft_manager: FTManager | None = None,
) -> OptimizersContainer:
    """torchtitan's ``build_optimizers`` plus ``name = "Muon"``."""
    check_optimizer_name(optimizer_config.name)
    if optimizer_config.name != "Muon":
        return titan_optimizer.build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if optimizer_config.early_step_in_backward:
        raise NotImplementedError("[optimizer] early_step_in_backward is not supported with Muon")
    if ft_manager is not None and ft_manager.enabled:
        raise NotImplementedError("torchft fault tolerance is not supported with Muon")
    kwargs = muon_kwargs(optimizer_config, _muon_section(optimizer_config))
    return MuonOptimizersContainer(model_parts, kwargs)


def build_optimizers_with_moe_load_balancing(
    model_parts: list[nn.Module],
    optimizer_config: OptimizerConfig,
    parallel_dims: ParallelDims,
    ft_manager: FTManager | None = None,
) -> OptimizersContainer:
    """torchtitan's MoE builder plus ``name = "Muon"``, keeping its expert-bias load-balancing hook.

    For Muon, torchtitan's own MoE builder is run once with AdamW (its optimizers hold no state
    until a step, so this is cheap) only to obtain the step pre-hook that updates the routers'
    expert biases; that hook, which reads the model and not the optimizer, moves to the Muon container.
    """
    if optimizer_config.name != "Muon":
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
    "MuonOptimizersContainer",
    "build_optimizers",
    "build_optimizers_with_moe_load_balancing",
    "muon_kwargs",
]
