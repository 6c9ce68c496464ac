"""The square-root batch rule: γ(B) = γ(B_ref)·√(B / B_ref), as a helper and as torchtitan's [batch_scaling]."""

import math

import pytest
import torch

from dtensor_muon import batch_scaled_lr


def test_batch_scaled_lr_is_the_square_root_rule():
    assert batch_scaled_lr(0.02, 4096, 1024) == 0.02 * math.sqrt(4.0) == 0.04
    assert batch_scaled_lr(0.02, 256, 1024) == 0.02 * math.sqrt(0.25)
    assert batch_scaled_lr(3e-4, 96, 32) == 3e-4 * math.sqrt(3.0)
    assert batch_scaled_lr(0.01, 512, 512) == 0.01
    for bad in (0, -4, float("nan")):
        with pytest.raises(ValueError, match="batch_size"):
            batch_scaled_lr(0.02, bad, 1024)
    with pytest.raises(ValueError, match="lr"):
        batch_scaled_lr(-1.0, 8, 8)


def test_torchtitan_batch_scaling_scales_the_optimizer_lr_once():
    """Global batch 8 (local 4 × dp_shard 2) of 64 tokens against a reference of 2 sequences of 128 tokens:
    lr·√(512/256); the optimizers are built with it (matrices and AdamW); a second call changes nothing."""
    pytest.importorskip("torchtitan")
    from torchtitan_ext.version import LINE

    if LINE != "0.2":
        pytest.skip("torchtitan 0.2.x option")
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims

    from torchtitan_ext import optimizer, registry
    from torchtitan_ext.batch_scaling import apply_batch_scaling
    from torchtitan_ext.sections import BatchScaling

    args = ["--job.custom_config_module", "torchtitan_ext.job_config", "--optimizer.name", "Muon"]
    args += ["--optimizer.lr", "0.02", "--training.local_batch_size", "4", "--training.seq_len", "64"]
    args += ["--batch_scaling.reference_batch_size", "2", "--batch_scaling.reference_seq_len", "128"]
    config = ConfigManager().parse_args(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=2)
    registry.attach_sections(config)
    line = apply_batch_scaling(config, dims)
    want = 0.02 * math.sqrt(512 / 256)
    assert config.optimizer.lr == want
    assert line is not None and "sqrt(512 / 256 tokens)" in line and "1.414" in line
    assert apply_batch_scaling(config, dims) is None and config.optimizer.lr == want
    model = torch.nn.ModuleDict({"w": torch.nn.Linear(8, 8), "output": torch.nn.Linear(8, 16)})
    (opt,) = optimizer.build_optimizers([model], config.optimizer, parallel_dims=dims).optimizers
    assert {g["lr"] for g in opt.param_groups} == {want}
    off = ConfigManager().parse_args(args[:8])
    assert apply_batch_scaling(off, dims) is None and off.optimizer.lr == 0.02
    with pytest.raises(ValueError, match=r"\[batch_scaling\] reference_batch_size = -1"):
        BatchScaling(reference_batch_size=-1)
