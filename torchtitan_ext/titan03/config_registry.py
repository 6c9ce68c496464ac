"""Ready torchtitan 0.3 configs with a matrix optimizer: ``--module torchtitan_ext.titan03 --config <name>``.

    torchrun --nproc_per_node 2 -m torchtitan_ext.titan03.train --module torchtitan_ext.titan03 \
        --config llama3_muon [--optimizer.name SOAP] [--training.steps 20] [--optimizer.muon.ns-steps 4]

torchtitan finds this module as ``<module>.config_registry``. Each function is a stock debug config of
torchtitan (its model, loss and parallelism) with:

- the optimizer :class:`~torchtitan_ext.titan03.container.MatrixOptimizersContainer` (Muon by default,
  ``--optimizer.name`` picks another entry of the registry), for every parameter (AdamW's parameters too: the
  matrices' lr is scaled to AdamW's update RMS) the lr :func:`dtensor_muon.muon_lr_from_adamw` gives for the
  stock config's AdamW lr (10×: 8e-3 for the debug models' 8e-4, 3e-3 for Qwen3 MoE's 3e-4; docs/lr_study.md),
  SOAP's and KL-SOAP's sections matching an AdamW update's RMS (``match_update_rms = 0.2``), so that
  ``--optimizer.name SOAP`` runs at SOAP's measured lr too (KL-SOAP's was a third of it: with
  ``--optimizer.name KLSOAP`` pass ``--optimizer.lr`` a third of the config's);
- the metrics of :class:`~torchtitan_ext.titan03.metrics.OptimizerMetricsProcessor`, TensorBoard on;
- the offline corpus and tokenizer of :mod:`torchtitan_ext.data` (the launcher builds them when missing);
- small CPU-friendly batches (4 × 256 tokens), 300 steps, warm-up 20 and cosine decay; no activation
  checkpointing; ``spmd_backend = "partial_dtensor"`` (FSDP2 ``Shard(0)`` and TP/EP DTensors, the layouts the
  library plans for); seed 0;
- where no GPU is present, float32 parameters (the container picks a float32 Newton–Schulz and wire by itself
  in a job on CPU: CPUs without AVX-512 BF16 run bfloat16 matrix products many times slower).

``llama3_muon`` (Llama3 debug model), ``qwen3_muon`` (Qwen3 debug), ``deepseek_v3_muon`` (DeepSeek-V3 debug:
MLA and 8 routed experts), ``qwen3_moe_muon`` (Qwen3 MoE debug: 64 experts). The MoE configs keep the model
spec's load-balancing hook (``post_optimizer_build_fn``), which the trainer registers on this container.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_debugmodel, qwen3_moe_debug
from torchtitan.trainer import Trainer

from dtensor_muon import muon_lr_from_adamw
from dtensor_muon.optim.lr_scaling import ADAMW_UPDATE_RMS
from torchtitan_ext import data
from torchtitan_ext.titan03.container import matrix_optimizer_config, shared_defaults
from torchtitan_ext.titan03.metrics import OptimizerMetricsProcessor


def with_matrix_optimizer(config: Trainer.Config, run_name: str, name: str = "Muon") -> Trainer.Config:
    """``config`` (a stock config) changed as the module docstring says; outputs under ``outputs/<run_name>``."""
    lr = muon_lr_from_adamw(shared_defaults(config.optimizer)["lr"])
    config.optimizer = matrix_optimizer_config(config.optimizer, name, {"lr": lr})
    for section in ("soap", "klsoap"):  # --optimizer.name SOAP or KLSOAP: AdamW's update RMS, as measured
        setattr(
            config.optimizer, section, replace(getattr(config.optimizer, section), match_update_rms=ADAMW_UPDATE_RMS)
        )
    if not torch.cuda.is_available():
        config.training.mixed_precision_param = "float32"
    config.metrics = OptimizerMetricsProcessor.Config(log_freq=10, enable_tensorboard=True, save_tb_folder="tb")
    config.hf_assets_path = str(data.tokenizer_dir(data.DEFAULT_OUT))
    config.dataloader.dataset_path = str(data.corpus_dir(data.DEFAULT_OUT))
    config.dump_folder = f"outputs/{run_name}"
    config.training.local_batch_size, config.training.seq_len, config.training.steps = 4, 256, 300
    config.lr_scheduler.warmup_steps, config.lr_scheduler.decay_type = 20, "cosine"
    config.lr_scheduler.decay_ratio, config.lr_scheduler.min_lr_factor = None, 0.1
    config.activation_checkpoint = None
    config.parallelism.spmd_backend = "partial_dtensor"
    config.checkpoint.interval = 100
    config.validator.enable = False
    config.debug.seed = 0
    return config


def llama3_muon() -> Trainer.Config:
    """torchtitan's Llama3 debug model (6 layers, dim 256, fused interleaved QKV) with Muon."""
    return with_matrix_optimizer(llama3_debugmodel(), "llama3_muon")


def qwen3_muon() -> Trainer.Config:
    """torchtitan's Qwen3 debug model with Muon."""
    return with_matrix_optimizer(qwen3_debugmodel(), "qwen3_muon")


def deepseek_v3_muon() -> Trainer.Config:
    """torchtitan's DeepSeek-V3 debug model (MLA, 8 routed experts and a shared expert) with Muon."""
    return with_matrix_optimizer(deepseek_v3_debugmodel(), "deepseek_v3_muon")


def qwen3_moe_muon() -> Trainer.Config:
    """torchtitan's Qwen3 MoE debug model (64 routed experts) with Muon."""
    return with_matrix_optimizer(qwen3_moe_debug(), "qwen3_moe_muon")
