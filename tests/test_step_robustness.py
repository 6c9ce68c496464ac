"""A step that cannot run raises on every rank, naming the parameter, within seconds; non-finite updates show.

Multi-process cases run on real gloo processes under a deadline: a rank still running when it passes
fails the test (the processes are killed) instead of hanging it.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import pytest
import scenarios
import torch
import torch.distributed as dist
from dist_harness import run_distributed
from torch import nn

from dtensor_muon import Muon

PROCESS_GROUP_TIMEOUT_S = 60  # a collective that waits longer than this raises (gloo's own timeout)
DEADLINE_S = 300  # every rank must have finished by then
STEP_BOUND_S = 20  # a failing step must have raised on every rank within this


def wrong_local_piece(rank: int, world_size: int) -> dict[str, Any]:
    """On rank 1 only, one gradient is a DTensor of the right global shape and placements whose local piece
    has one row too few (``from_local(..., run_check=False)``): first a Muon matrix, then an AdamW bias."""
    from torch.distributed.tensor import DTensor

    params = scenarios.distributed_params("shard0", world_size)
    opt = Muon(params, **scenarios.OPTIONS)
    out: dict[str, Any] = {}
    for name in ("layers.0.attention.wq", "layers.0.bias"):
        scenarios.set_gradients(params, 0)
        p = dict(params)[name]
        if rank == 1:
            piece = p.grad.to_local()
            p.grad = DTensor.from_local(
                piece[1:].clone(), p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        before = [q.to_local().clone() for _, q in params]
        dist.barrier()  # every rank enters the step together: the time below is the step's alone
        start = time.monotonic()
        try:
            opt.step()
            out[name] = (False, "no error", 0.0)
        except Exception as exc:
            out[name] = (isinstance(exc, RuntimeError), str(exc), time.monotonic() - start)
        out[name + " unchanged"] = all(torch.equal(b, q.to_local()) for b, (_, q) in zip(before, params))
    return out


@pytest.mark.slow
def test_wrong_local_gradient_piece_raises_on_every_rank_naming_the_parameter():
    # fresh processes: a rank whose step failed may have left its peers' collectives out of step
    results = run_distributed(
        wrong_local_piece, 3, timeout=DEADLINE_S, fresh=True, pg_timeout_s=PROCESS_GROUP_TIMEOUT_S
    )
    for rank, r in enumerate(results):
        for name in ("layers.0.attention.wq", "layers.0.bias"):
            is_runtime_error, message, seconds = r[name]
            assert is_runtime_error and repr(name) in message, (rank, message)
            assert seconds < STEP_BOUND_S, (rank, name, seconds)
            assert r[name + " unchanged"], (rank, name)
    assert "local piece of the gradient has shape (6, 12)" in results[1]["layers.0.attention.wq"][1]
    assert "another rank (global rank 1" in results[0]["layers.0.attention.wq"][1]


# ---------------------------------------------------------------- non-finite updates and step metrics
def tiny_params(seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    return [(n, nn.Parameter(p)) for n, p in scenarios.initial_params(seed)]


def set_plain_gradients(params: list[tuple[str, nn.Parameter]], step: int) -> None:
    for (_, p), g in zip(params, scenarios.gradients(step).values()):
        p.grad = g


def expected_flops(ns_steps: int = 5) -> int:
    """ns_steps·(4m²n + 2m³) per matrix that gets a gradient (the experts parameter has 5 matrices)."""
    total = 0
    for name, shape in scenarios.SHAPES:
        if name in scenarios.NO_GRAD or len(shape) < 2 or name in ("tok_embeddings.weight", "output.weight"):
            continue
        matrices, (a, b) = (
            (shape[0], shape[1:]) if len(shape) == 3 else (1, (shape[0], int(torch.tensor(shape[1:]).prod())))
        )
        m, n = min(a, b), max(a, b)
        total += matrices * ns_steps * (4 * m * m * n + 2 * m**3)
    return total


def test_nonfinite_update_warns_once_naming_the_matrix_and_counts_it():
    params = tiny_params()
    opt = Muon(params, **scenarios.OPTIONS)
    set_plain_gradients(params, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finite step warns nothing
        opt.step()
    assert opt.metrics["muon/nonfinite_updates"] == 0
    set_plain_gradients(params, 1)
    dict(params)["layers.0.moe.experts"].grad[3, 0, 0] = float("inf")
    with pytest.warns(RuntimeWarning, match=r"'layers\.0\.moe\.experts\[3\]'.*skip_nonfinite=True") as caught:
        opt.step()
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    assert opt.metrics["muon/nonfinite_updates"] == 1  # one of the five experts
    assert torch.isnan(dict(params)["layers.0.moe.experts"][3]).all()
    set_plain_gradients(params, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only, though the momentum keeps the expert non-finite
        opt.step()
    assert opt.metrics["muon/nonfinite_updates"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nonfinite_check_never_synchronizes_cuda():
    """On CUDA the flags reach the host asynchronously: a step with torch's sync debug mode "error" runs, and
    the warning and the count come by the time the metrics are read."""
    params = [(n, nn.Parameter(p.cuda())) for n, p in scenarios.initial_params()]
    opt = Muon(params, **scenarios.OPTIONS)
    for step in range(3):  # CUDA graphs are captured in the first steps
        for (_, p), g in zip(params, scenarios.gradients(step).values()):
            p.grad = None if g is None else g.cuda()
        if step == 2:
            dict(params)["layers.0.attention.wq"].grad[0, 0] = float("nan")
            torch.cuda.set_sync_debug_mode("error")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert opt.metrics["muon/nonfinite_updates"] == (1 if step == 2 else 0)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert any("'layers.0.attention.wq'" in m for m in messages) == (step == 2)


def test_optimizer_flops_and_sigma_metrics_on_one_process():
    params = tiny_params()
    opt = Muon(params, diagnostics_interval=2, **scenarios.OPTIONS)
    set_plain_gradients(params, 0)
    opt.step()
    m = opt.metrics
    assert m["muon/optimizer_flops"] == expected_flops()
    assert "muon/sigma_min" not in m  # not a diagnostic step
    set_plain_gradients(params, 1)
    opt.step()
    m = opt.metrics
    assert 0 < m["muon/sigma_min"] <= m["muon/sigma_max"]
    assert m["muon/orthogonality_error"] == max(1 - m["muon/sigma_min"], m["muon/sigma_max"] - 1)


def nonfinite_on_one_rank(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 model (scenarios' layers); rank 1 puts a NaN into its shard of one matrix's gradient."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(37, 10),
        nn.Linear(10, 13),
        nn.GELU(),
        nn.Linear(13, 10),
        nn.LayerNorm(10),
        nn.Linear(10, 37, bias=False),
    )
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    fully_shard(model)
    opt = Muon(model.named_parameters(), **scenarios.OPTIONS)
    shapes = [tuple(p.shape) for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    out: dict[str, Any] = {"expected_flops": sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)}
    for step in range(2):
        tokens = torch.randint(0, 37, (4, 6), generator=torch.Generator().manual_seed(100 * step + rank))
        nn.functional.cross_entropy(model(tokens).reshape(-1, 37), tokens.roll(1, dims=1).reshape(-1)).backward()
        if step == 1 and rank == 1:
            model[3].weight.grad.to_local().view(-1)[0] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        opt.zero_grad()
        out[step] = {
            "nonfinite": opt.metrics["muon/nonfinite_updates"],
            "flops": opt.metrics["muon/optimizer_flops"],
            "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            "nan": bool(torch.isnan(model[3].weight.full_tensor()).all()),
        }
    return out


@pytest.mark.slow
def test_nonfinite_update_on_two_fsdp_ranks_is_counted_by_its_owner():
    results = run_distributed(nonfinite_on_one_rank, 2, timeout=DEADLINE_S)
    step0, step1 = [r[0] for r in results], [r[1] for r in results]
    assert all(s["nonfinite"] == 0 and not s["warnings"] and not s["nan"] for s in step0)
    assert sum(s["nonfinite"] for s in step1) == 1  # the matrix is orthogonalized on its owner only
    for s in step1:
        assert s["nan"]  # on every rank's shard: the owner sent NaN back
        assert bool(s["warnings"]) == (s["nonfinite"] == 1)
        assert all("'3.weight'" in w and "skip_nonfinite=True" in w for w in s["warnings"])
    # each Muon matrix once, on its owner: 5·(4m²n + 2m³) each
    assert sum(s["flops"] for s in step0) == results[0]["expected_flops"] > 0


# ---------------------------------------------------------------- nothing in flight after a step
def exchange_handles_after_step(rank: int, world_size: int) -> dict[str, int]:
    """How many of the exchange's all-to-all Work objects are still alive: after a plain step, and with
    ``overlap=True`` after the step and after ``flush()`` (Python references only: weakrefs to the Works)."""
    import gc
    import weakref

    from dtensor_muon.strategies import owned

    launched: list[weakref.ref] = []
    start = owned.start_all_to_all

    def recording_start(*args, **kwargs):
        pending = start(*args, **kwargs)
        launched.append(weakref.ref(pending.handle))
        return pending

    owned.start_all_to_all = recording_start
    out = {}
    for overlap in (False, True):
        params = scenarios.distributed_params("shard0", world_size)
        model = scenarios.ParamHolder(params)
        named = [(n, getattr(model, n.replace(".", "__"))) for n, _ in params]
        opt = Muon(named, overlap=overlap, **scenarios.OPTIONS)
        opt.attach(model)
        launched.clear()
        scenarios.set_gradients(named, 0)
        opt.step()
        gc.collect()
        out[f"launched overlap={overlap}"] = len(launched)
        out[f"alive after step overlap={overlap}"] = sum(r() is not None for r in launched)
        opt.flush()
        gc.collect()
        out[f"alive after flush overlap={overlap}"] = sum(r() is not None for r in launched)
    owned.start_all_to_all = start
    return out


@pytest.mark.slow
def test_no_exchange_work_is_kept_after_the_step_or_the_flush():
    for r in run_distributed(exchange_handles_after_step, 2, timeout=DEADLINE_S):
        assert r["launched overlap=False"] > 0 and r["alive after step overlap=False"] == 0, r
        assert r["alive after step overlap=True"] > 0, r  # the return exchanges are still in flight
        assert r["alive after flush overlap=True"] == 0, r
