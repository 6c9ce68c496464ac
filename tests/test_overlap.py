"""Overlap mode on real gloo processes: bitwise equal to no overlap, ordered per module, flushed when read."""

import functools
import tempfile

import pytest
import scenarios
import torch
from dist_harness import DEVICES, one_thread, run_distributed

from dtensor_muon import Muon

pytestmark = pytest.mark.slow
STEPS = 5
SAVE_STEP = 2  # the scenario saves a DCP checkpoint after this step (which flushes)
SKIPPED = 2  # block 2 is skipped by the forward of odd steps


def got_update(block: int, step: int) -> bool:
    return not (block == SKIPPED and step % 2 == 1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlap_equals_no_overlap_and_applies_each_block_before_its_forward(world_size):
    with tempfile.TemporaryDirectory() as path:
        with_overlap = run_distributed(scenarios.overlap_training, world_size, True, STEPS, path + "/a")
        without = run_distributed(scenarios.overlap_training, world_size, False, STEPS, path + "/b")
    for a, b in zip(with_overlap, without):
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name
        for name in a["saved"]:  # the checkpoint taken with updates pending holds the updated values
            assert torch.equal(a["saved"][name], b["saved"][name]), name
    checked = 0
    for obs in with_overlap[0]["observations"]:
        previous = obs["step"] - 1
        if previous == SAVE_STEP:
            continue
        if got_update(obs["block"], previous):
            assert obs["this_applied"], obs  # block k-1 was updated by its own pre-forward hook...
        if got_update(obs["block"] + 1, previous):
            assert obs["next_pending"], obs  # ...while block k's update was still pending
            checked += 1
    assert checked >= 6
    assert not any(o["this_applied"] for o in without[0]["observations"])  # without overlap: applied in step()


def test_block_prefetched_by_fsdp_is_finished_by_the_hook_of_the_block_before():
    with tempfile.TemporaryDirectory() as path:
        results = run_distributed(scenarios.overlap_training, 2, True, 4, path, True)
    checked = 0
    for obs in results[0]["observations"]:
        previous = obs["step"] - 1
        if previous != SAVE_STEP and got_update(obs["block"] + 1, previous):
            assert not obs["next_pending"], obs  # FSDP prefetches block k+1 from block k: already applied
            checked += 1
    assert checked >= 4


RESIDUAL_STEPS = 6


@functools.cache
def residual_reference(device: str) -> dict:
    """The one-process run both prefetch cases compare with, computed once per device on one thread, as the
    workers run (CPU products may round otherwise with other thread counts)."""
    with one_thread():
        return scenarios.residual_mlp_one_process(RESIDUAL_STEPS, torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [False, True], ids=["implicit-prefetch", "explicit-prefetch"])
def test_fsdp2_residual_model_with_overlap_equals_no_overlap_and_one_process(device, prefetch):
    """On CUDA, FSDP2 all-gathers a module's shards on its own stream, which waits for the default stream only
    at the root's forward: an update applied by a later module's pre-forward hook must be ordered before that
    all-gather, or the forward reads half-written weights."""
    reference = residual_reference(device)
    runs = {
        overlap: run_distributed(scenarios.residual_mlp_fsdp, 2, RESIDUAL_STEPS, overlap, prefetch, device=device)
        for overlap in (False, True)
    }
    for overlap, results in runs.items():
        for rank, result in enumerate(results):
            assert result["losses"] == reference["losses"], (overlap, rank, result["losses"], reference["losses"])
        for name, want in reference["params"].items():
            got = torch.cat([result["pieces"][name] for result in results])
            assert torch.equal(got, want), f"{name} overlap={overlap}: max |Δ| {(got - want).abs().max():.3e}"


def test_overlap_needs_attach_single_process_and_local_matrices_apply_in_step():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4))
    opt = Muon(model.named_parameters(), overlap=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with pytest.raises(RuntimeError, match="attach"):
        opt.step()
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4))
    reference.load_state_dict(model.state_dict())
    ref_opt = Muon(reference.named_parameters())
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()
    opt.attach(model)
    opt.step()
    ref_opt.step()
    # one process: every matrix is local, so there is nothing in flight and step() applies it at once
    for (name, value), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, ref), name
    opt.detach()
