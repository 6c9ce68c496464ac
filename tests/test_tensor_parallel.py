"""Tensor and expert parallelism as torchtitan lays them out (``parallelize_module`` styles, FSDP2 over TP
giving ``_StridedShard``, experts over an ``ep`` mesh dim): the optimizer equals one process fed the same
gathered gradients, bit for bit, in the default owned mode.

The exactness tests run on CPU workers and, parametrized with ``device``, on CUDA workers (ranks sharing
``cuda:0`` over gloo) against one process on the same GPU; there the gradients are synthetic (the models'
forward passes gather CUDA DTensors with DTensor's all-gather, which crashes over gloo in torch 2.11):
``python3 -m pytest -q tests/test_tensor_parallel.py -k cuda`` on a GPU machine."""

import functools
import os
import tempfile

import pytest
import torch
import tp_scenarios
from dist_harness import DEVICES, run_distributed
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from dtensor_muon.distributed.layout import _shard_order

pytestmark = pytest.mark.slow
STEPS = 3


@functools.cache
def dense_run(kind: str, world_size: int, tp_mode: str, device: str) -> list[dict]:
    """``tp_scenarios.dense_training`` for STEPS steps without options on ``device`` workers, run once and
    shared by the tests."""
    return run_distributed(tp_scenarios.dense_training, world_size, kind, STEPS, {}, tp_mode, device=device)


def assert_bitwise(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        for step, diffs in enumerate(result["history"]):
            bad = {name: d for name, d in diffs.items() if d != 0.0}
            assert not bad, f"rank {rank}, step {step}: differs from one process: {bad}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kind, world_size, strided",
    [("tp", 2, False), ("fsdp_tp", 4, True), ("fsdp_tp", 8, True), ("hsdp_tp", 8, True)],
)
def test_dense_tensor_parallel_equals_one_process(kind, world_size, strided, device):
    results = dense_run(kind, world_size, "owned", device)
    assert_bitwise(results)
    placements = results[0]["placements"]
    # the layouts the test means to cover: TP's Replicate norms (Partial gradients), FSDP over TP's strided rows
    assert "Replicate()" in placements["norm.weight"]
    assert ("_StridedShard(dim=0" in placements["layers.0.w1.weight"]) == strided


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "expert_shard_dim, expected", [(0, "_StridedShard(dim=0, sf=2), Shard(dim=0)"), (1, "Shard(dim=1), Shard(dim=0)")]
)
def test_experts_over_ep_and_fsdp_equal_one_process(expert_shard_dim, expected, device):
    results = run_distributed(tp_scenarios.expert_training, 4, expert_shard_dim, STEPS, {}, device=device)
    assert_bitwise(results)
    assert results[0]["placements"]["layers.0.moe.experts.w"] == f"({expected})"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "world_size, tp_mode, fsdp, w1_placements",
    [
        (4, "owned", False, "(Shard(dim=0), Shard(dim=1))"),
        (4, "duplicated", False, "(Shard(dim=0), Shard(dim=1))"),
        (8, "owned", True, "(_StridedShard(dim=0, sf=2), Shard(dim=0), Shard(dim=1))"),
    ],
)
def test_experts_over_ep_and_tp_equal_one_process(world_size, tp_mode, fsdp, w1_placements, device):
    results = run_distributed(
        tp_scenarios.expert_tensor_parallel_training, world_size, STEPS, tp_mode, fsdp, device=device
    )
    assert_bitwise(results)
    assert results[0]["placements"]["layers.0.moe.experts.w1"] == w1_placements


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, world_size", [("tp", 2), ("fsdp_tp", 4)])
def test_blockwise_equals_one_process_per_tp_block(kind, world_size, device):
    results = dense_run(kind, world_size, "blockwise", device)
    assert_bitwise(results)


def test_blockwise_differs_from_the_whole_matrix_polar_factor():
    """The approximation is real: per-block updates are not the owned (whole-matrix) ones (after the first step
    of the runs the tests above check against one process)."""
    owned = dense_run("tp", 2, "owned", "cpu")[0]["first_step_params"]["layers.0.w1.weight"]
    blockwise = dense_run("tp", 2, "blockwise", "cpu")[0]["first_step_params"]["layers.0.w1.weight"]
    assert owned.ne(blockwise).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, world_size", [("tp", 2), ("fsdp_tp", 4), ("hsdp_tp", 8)])
def test_duplicated_equals_one_process(kind, world_size, device):
    results = dense_run(kind, world_size, "duplicated", device)
    assert_bitwise(results)


DISTRIBUTED_BOUND = 1e-6
"""Max |parameter − one process| after 3 steps with float32 Newton–Schulz: measured 9.3e-8 (TP 2 and FSDP 2 ×
TP 2; lr 0.02, γ' ≈ 0.018). The partial Gram matrices are summed in another order than one matmul sums them.
In bf16 the two differ by as much as bf16 Newton–Schulz differs from float64 (measured on 1024×4096 split in
2: one process 1.4e-3, distributed 1.1e-3 from float64, |O| ≤ 0.075)."""


@pytest.mark.parametrize("kind, world_size", [("tp", 2), ("fsdp_tp", 4)])
def test_distributed_equals_one_process_within_its_bound(kind, world_size):
    options = {"ns_dtype": torch.float32, "wire_dtype": torch.float32}
    results = run_distributed(tp_scenarios.dense_training, world_size, kind, STEPS, options, "distributed")
    for rank, result in enumerate(results):
        for step, diffs in enumerate(result["history"]):
            assert max(diffs.values()) <= DISTRIBUTED_BOUND, (rank, step, diffs)
        # the TP matrices really ran distributed (an owned run would be bitwise)
        assert result["history"][-1]["layers.0.w1.weight"] > 0.0


def test_auto_picks_distributed_only_for_large_matrices_at_high_tp_degree():
    from dtensor_muon.plan import distributed_pays

    assert not distributed_pays((4096, 14336), 2) and distributed_pays((4096, 14336), 8)
    assert not any(distributed_pays((1024, 4096), t) for t in (2, 4, 8))
    results = run_distributed(tp_scenarios.dense_training, 4, "fsdp_tp", 2, {}, "auto")
    assert_bitwise(results)  # the test model's small matrices stay owned: exact


def test_strided_shard_order_and_refusals():
    # FSDP over TP: the TP shard (mesh dim 1) applies first, then FSDP's strided one
    assert _shard_order("w", (_StridedShard(0, split_factor=4), Shard(0)), (2, 4), 2) == [1, 0]
    assert _shard_order("w", (Replicate(), _StridedShard(0, split_factor=2), Shard(0)), (2, 2, 2), 2) == [2, 1]
    with pytest.raises(ValueError, match=r"parameter 'w'.*split_factor equal to their mesh sizes' product"):
        _shard_order("w", (_StridedShard(0, split_factor=3), Shard(0)), (2, 4), 2)
    with pytest.raises(ValueError, match="parameter 'w'"):
        _shard_order("w", (Shard(0), _StridedShard(0, split_factor=1)), (2, 4), 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer, tp_mode", [("Muon", "owned"), ("NorMuon", "duplicated")])
def test_dcp_saved_under_fsdp_x_tp_on_4_loaded_under_fsdp_on_2_continues_exactly(optimizer, tp_mode, device):
    """NorMuon in duplicated mode: each matrix's owner state sits on every member of its TP group and is saved
    once; the load under FSDP gives it to the matrix's new owner. Against one process on the same device."""
    want = tp_scenarios.synthetic_reference(4, optimizer, device)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        run_distributed(tp_scenarios.dense_dcp_save, 4, "fsdp_tp", path, 2, optimizer, tp_mode, device=device)
        results = run_distributed(tp_scenarios.dense_dcp_resume, 2, "fsdp", path, 2, 2, optimizer, device=device)
    for got in results:
        for name, value in want.items():
            assert torch.equal(got[name], value), f"{name}: max diff {(got[name] - value).abs().max().item()}"


def test_distributed_tp_mode_is_refused_for_rules_without_a_distributed_form():
    from torch import nn

    from dtensor_muon import SOAP, Muon

    w = nn.Parameter(torch.randn(6, 4))
    with pytest.raises(ValueError, match=r"parameter 'layers.0.w'.*tp_mode='distributed'.*use 'owned' or 'duplicated'"):
        SOAP([("layers.0.w", w)], tp_mode="distributed")
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        Muon([("layers.0.w", w)], tp_mode="sharded")
    Muon([("layers.0.w", w)], tp_mode="auto")  # no TP mesh: every matrix is computed as without tp_mode
