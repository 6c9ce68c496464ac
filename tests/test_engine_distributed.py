"""The distributed engine on real gloo processes equals the single-process optimizer, bit for bit.

Bitwise is expected: momentum and the final update are element-wise on shards, the exchange moves values
in bf16 (the Newton–Schulz input dtype, so nothing is rounded twice), and each owner runs the same
Newton–Schulz on the same full matrix as the single process.
"""

import functools
import os
import tempfile

import pytest
import scenarios
import torch
from dist_harness import DEVICES, one_thread, requires_cuda, run_distributed, worker_device

from dtensor_muon import Muon

pytestmark = pytest.mark.slow
STEPS = 3


@functools.cache
def reference_on(device: str, steps: int = STEPS) -> list[torch.Tensor]:
    """The one-process run on ``device`` (on the CPU on one thread, as the workers run)."""
    return scenarios.reference_run(steps, device=device)


@pytest.fixture(scope="module")
def reference():
    return reference_on("cpu")


def assert_all_equal(got, want):
    for (name, _), a, b in zip(scenarios.SHAPES, got, want):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize(
    "world_size, kind, exchange",
    [
        (1, "shard0", "owner"),
        (2, "shard0", "owner"),
        (3, "shard0", "owner"),
        (4, "shard0", "owner"),
        (8, "shard0", "owner"),
        (3, "shard1", "owner"),
        (4, "hsdp", "owner"),
        (4, "2d", "owner"),
        (2, "replicate", "owner"),
        (4, "two_meshes", "owner"),
        (2, "shard0", "gather_all"),
        (3, "shard0", "gather_all"),
        (4, "shard1", "gather_all"),
        (8, "shard0", "gather_all"),
    ],
)
def test_distributed_equals_single_process(world_size, kind, exchange, reference):
    results = run_distributed(scenarios.train_steps, world_size, kind, STEPS, {"exchange": exchange})
    for result in results:
        assert all(result["layout_ok"]), "a local shard is not the box layout.py computed for it"
        assert_all_equal(result["params"], reference)
    if exchange == "owner" and world_size > 1 and kind != "replicate":
        assert sum(r["metrics"]["muon/bytes_sent"] for r in results) > 0
    if kind == "two_meshes":
        assert len(results[0]["imbalance"]) == 2  # one plan per mesh


CUDA_LAYOUTS = [(2, "shard0"), (3, "shard0"), (4, "shard0"), (3, "shard1"), (4, "hsdp"), (4, "2d"), (4, "two_meshes")]


@requires_cuda
@pytest.mark.parametrize("world_size, kind", CUDA_LAYOUTS)
def test_distributed_equals_single_process_on_one_gpu(world_size, kind):
    """Ranks sharing cuda:0 over gloo against one process on the same GPU, bit for bit (the gather_all
    exchange is left out: its full_tensor() of CUDA tensors over gloo crashes in torch 2.11)."""
    results = run_distributed(scenarios.train_steps, world_size, kind, STEPS, {}, device="cuda")
    for result in results:
        assert all(result["layout_ok"]), "a local shard is not the box layout.py computed for it"
        assert_all_equal(result["params"], reference_on("cuda"))


def test_wire_dtype_none_and_small_buckets_equal_single_process(reference):
    results = run_distributed(scenarios.train_steps, 4, "shard0", STEPS, {"wire_dtype": None, "bucket_size_mb": 1e-4})
    assert_all_equal(results[0]["params"], reference)


def test_float32_newton_schulz_refuses_bf16_wire_and_matches_with_fp32_wire():
    with pytest.raises(Exception, match="wire_dtype"):  # raised in the workers, re-raised here
        # fresh processes: a call that raises ends its pool, and the shared one is kept for the others
        run_distributed(scenarios.train_steps, 2, "shard0", 1, {"ns_dtype": torch.float32}, fresh=True)
    reference = scenarios.reference_run(STEPS, ns_dtype=torch.float32)
    results = run_distributed(
        scenarios.train_steps, 2, "shard0", STEPS, {"ns_dtype": torch.float32, "wire_dtype": None}
    )
    # float32 batched matmuls on CPU are not invariant to the batch size (the owner batches 3 of the 5
    # experts, the single process all 5), so the last bit may differ: ≤ 1e-6 relative.
    for a, b in zip(results[0]["params"], reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_fsdp2_model_equals_single_process_fed_the_same_gradients(device):
    result = run_distributed(scenarios.fsdp_training, 2, 3, device=device)[0]
    with one_thread():
        params = [(n, result["initial"][n].to(device).requires_grad_()) for n in result["names"]]
        opt = Muon(params, **scenarios.OPTIONS)
        for grads in result["grads"]:
            for n, p in params:
                p.grad = grads[n].to(device)
            opt.step()
    params = [(n, p.detach().cpu()) for n, p in params]
    for n, p in params:
        assert torch.equal(p, result["params"][n]), n


@pytest.mark.parametrize("device", DEVICES)
def test_nan_on_one_rank_skips_the_step_everywhere(device):
    results = run_distributed(scenarios.nonfinite_step, 4, device=device)
    reference = reference_on(device, 2)  # steps 0 and 1 (the skipped step's gradients are reused after)
    for r in results:
        assert r["skipped"] == 1
        assert_all_equal(r["after"], r["before"])
        for name, state in r["state_before"].items():
            for key, value in state.items():
                assert torch.equal(value, r["state_after"][name][key]), (name, key)
        assert_all_equal(r["final"], reference)


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_save_on_4_ranks_load_on_2_continues_exactly(device):
    with tempfile.TemporaryDirectory() as path:
        run_distributed(scenarios.dcp_save, 4, path, 2, device=device)
        assert os.listdir(path)
        results = run_distributed(scenarios.dcp_resume, 2, path, 2, 2, device=device)
    reference = reference_on(device, 4)
    for r in results:
        assert_all_equal(r, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_failures_raise_on_every_rank_without_hanging(device):
    results = run_distributed(scenarios.failure_cases, 2, device=device)
    for r in results:
        assert "w_partial" in r["placement"] and "Partial" in r["placement"]
        assert "built differently across ranks" in r["plan"] and "'w' differs across ranks" in r["plan"]
        assert "<missing>" in r["plan"]
        assert r["unchanged"] == "True"
    for r in results:
        assert "gradient placements differ across ranks" in r["step"]
    assert "'layers.0.attention.wq'" in results[0]["step"] and "gradients in other placements" in results[0]["step"]
    assert "placements than their parameter's: none" in results[1]["step"]


def equal_meshes_of_other_groups(rank: int, world_size: int) -> list[torch.Tensor]:
    """Two meshes equal by value (same ranks and device type) over different process groups: the first
    one's group is destroyed (as a training script's teardown or a test harness does) while that mesh is still
    alive; the optimizer built on the second mesh must use the second mesh's group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    device_type = worker_device().type
    first_group = dist.new_group(list(range(world_size)))
    first = DeviceMesh.from_group(first_group, device_type)
    first_params = [
        (n, torch.nn.Parameter(distribute_tensor(p, first, [Shard(0)]))) for n, p in scenarios.initial_params()
    ]
    Muon(first_params, **scenarios.OPTIONS)
    dist.destroy_process_group(first_group)
    second = DeviceMesh.from_group(dist.new_group(list(range(world_size))), device_type)
    assert second == first  # DeviceMesh compares by value
    params = [(n, torch.nn.Parameter(distribute_tensor(p, second, [Shard(0)]))) for n, p in scenarios.initial_params()]
    opt = Muon(params, **scenarios.OPTIONS)
    for step in range(STEPS):
        for (_, p), g in zip(params, scenarios.gradients(step).values()):
            p.grad = None if g is None else distribute_tensor(g, second, [Shard(0)])
        opt.step()
    # torch's own redistribute caches plans by mesh value too: return the Shard(0) pieces, joined by the test
    return [p.to_local() for _, p in params]


@pytest.mark.parametrize("device", DEVICES)
def test_a_mesh_equal_to_one_whose_group_was_destroyed_trains_on_its_own_group(reference, device):
    pieces = run_distributed(equal_meshes_of_other_groups, 2, device=device)
    got = [torch.cat(by_rank) for by_rank in zip(*pieces)]
    if device == "cpu":
        assert_all_equal(got, reference)
    else:  # the one-process reference on the GPU
        assert_all_equal(got, reference_on("cuda"))
