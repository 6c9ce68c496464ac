"""Nothing hangs, nothing is half-applied: a failure on one rank raises on every rank, and the step changes nothing.

Each scenario runs on real gloo processes under FSDP2 (``fully_shard``, uneven shards) and compares every rank's
parameters and optimizer state (shard state, AdamW state, owner state) bit for bit with a snapshot taken before
the failing step; where training continues afterwards, the result is compared with one process.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from dist_harness import DEVICES, full_tensor, one_thread, run_distributed, worker_device
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dtensor_muon import Muon, NorMuon
from dtensor_muon.rules.normuon import NorMuonRule

SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("tok_embeddings.weight", (30, 8)),
    ("layers.0.wq.weight", (12, 8)),
    ("layers.0.wk.weight", (10, 8)),
    ("layers.0.experts", (3, 6, 8)),
    ("layers.1.wq.weight", (12, 8)),
    ("layers.1.wo.weight", (8, 12)),
    ("norm.weight", (8,)),
    ("output.weight", (30, 8)),
]
OPTIONS: dict[str, Any] = dict(lr=0.02, weight_decay=0.1)


class CholeskyCheckedRule(NorMuonRule):
    """NorMuon whose direction then factors U·Uᵀ + I by Cholesky (as a whitening preconditioner would): a
    non-finite U makes the factorization raise ``LinAlgError`` after NorMuon has written the owner state."""

    def direction(self, u: Tensor, owner_states, group, runner) -> Tensor:
        o = super().direction(u, owner_states, group, runner)
        u32 = u.to(torch.float32)
        torch.linalg.cholesky(u32 @ u32.mT + torch.eye(u.shape[-2], device=u.device))
        return o


class CholeskyCheckedNorMuon(NorMuon):
    """NorMuon with :class:`CholeskyCheckedRule`: a front end over a rule that can fail on an owner."""

    rule = CholeskyCheckedRule()


class Holder(nn.Module):
    """A module whose parameters are exactly the given (name, tensor) pairs (dots become '__')."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in shapes:
            self.register_parameter(name.replace(".", "__"), nn.Parameter(torch.randn(shape, generator=g)))

    def named(self) -> list[tuple[str, nn.Parameter]]:
        return [(name.replace("__", "."), p) for name, p in self.named_parameters()]


def gradient(name: str, shape: tuple[int, ...], step: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def set_gradients(params: list[tuple[str, nn.Parameter]], step: int, poison: str | None = None) -> None:
    """Step ``step``'s gradients (the same full tensors on every rank), NaN in ``poison``'s."""
    for name, p in params:
        g = gradient(name, tuple(p.shape), step)
        if name == poison:
            g[0, 0] = float("nan")
        p.grad = (
            g.to(p.device)
            if not isinstance(p, DTensor)
            else DTensor.from_local(
                g[_local_slices(p)].to(p.device), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        )


def _local_slices(p: DTensor) -> tuple[slice, ...]:
    from dtensor_muon.distributed.layout import read_layout

    return tuple(slice(a, b) for a, b in read_layout("p", p).local_box)


def sharded_model(shapes: list[tuple[str, tuple[int, ...]]] = SHAPES) -> Holder:
    model = Holder(shapes)
    fully_shard(model, mesh=init_device_mesh(worker_device().type, (2,)))
    return model


def reference(
    optimizer: type, steps: int, shapes: list[tuple[str, tuple[int, ...]]] = SHAPES, device: str = "cpu"
) -> dict[str, Tensor]:
    """One process, plain tensors on ``device`` (on the CPU on one thread, as the workers run): the parameters
    after ``steps`` steps, on the CPU."""
    with one_thread():
        holder = Holder(shapes).to(device)
        params = holder.named()
        opt = optimizer(params, **OPTIONS)
        for step in range(steps):
            set_gradients(params, step)
            opt.step()
    return {name: p.detach().cpu() for name, p in params}


def snapshot(params: list[tuple[str, nn.Parameter]], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every local tensor a step may change: parameters and all optimizer state (owner state included)."""

    def copy(v: Any) -> Any:
        if isinstance(v, DTensor):
            return v.to_local().clone()
        if isinstance(v, Tensor):
            return v.clone()
        if isinstance(v, dict):
            return {k: copy(x) for k, x in v.items()}
        return v

    return {
        "params": {name: p.to_local().clone() for name, p in params},
        "state": {name: copy(opt.state[p]) for name, p in params},
    }


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested snapshots (NaN equal to NaN in the same place)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, Tensor):
        return (
            isinstance(b, Tensor)
            and a.dtype == b.dtype
            and torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
        )
    return a == b


def attempt(fn) -> str | None:
    """Run ``fn``; the error it raised as ``"Type: message"``, or None."""
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def owner_failure(rank: int, world_size: int, overlap: bool, offload: str) -> dict[str, Any]:
    """Step 1 succeeds; step 2's gradient of a matrix owned by rank 1 is NaN, so its direction raises there; then
    step 2 again with finite gradients."""
    model = sharded_model()
    params = model.named()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # offload on CPU parameters: "saves nothing"
        opt = CholeskyCheckedNorMuon(params, **OPTIONS, overlap=overlap, offload=offload)
    if overlap:
        opt.attach(model)
    set_gradients(params, 0)
    opt.step()
    opt.flush()
    owned_by_1 = [r.spec.name for plan in opt.plans for r in plan.routes if r.owner == 1]
    poison = next(name for name, p in params if p.ndim == 2 and name in owned_by_1)
    set_gradients(params, 1, poison=poison)
    before = snapshot(params, opt)
    error = attempt(opt.step)
    opt.flush()
    unchanged = same(before, snapshot(params, opt))
    set_gradients(params, 1)
    opt.step()
    opt.flush()
    return {
        "poison": poison,
        "error": error,
        "unchanged": unchanged,
        "params": {name: full_tensor(p) for name, p in params},
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap, offload", [(False, "none"), (True, "none"), (False, "host"), (True, "host")])
def test_a_failing_direction_raises_on_every_rank_and_changes_nothing(overlap, offload, device):
    """With offload="host" the failed step's new momentum was written beside the state, never into it."""
    results = run_distributed(owner_failure, 2, overlap, offload, device=device)
    want = reference(CholeskyCheckedNorMuon, 2, device=device)
    for rank, r in enumerate(results):
        assert r["error"] is not None, f"rank {rank} did not raise"
        assert r["error"].startswith("StepFailedError"), r["error"]
        for part in (repr(r["poison"]), "global rank 1", "LinAlgError", "cholesky", "no rank changed anything"):
            assert part in r["error"], (rank, part, r["error"])
        assert r["unchanged"], f"rank {rank}: parameters or optimizer state changed by the failed step"
        for name, p in r["params"].items():
            assert torch.equal(p, want[name]), (rank, name, (p - want[name]).abs().max())


def bad_gradient_dtype(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 gives one matrix a bf16 gradient for its fp32 parameter (``param.grad_dtype``)."""
    model = sharded_model()
    params = model.named()
    opt = Muon(params, **OPTIONS)
    set_gradients(params, 0)
    opt.step()
    set_gradients(params, 1)
    name, p = params[1]
    if rank == 1:
        grad, p.grad = p.grad, None
        p.grad_dtype = torch.bfloat16
        p.grad = grad.to(torch.bfloat16)
    before = snapshot(params, opt)
    error = attempt(opt.step)
    return {"error": error, "unchanged": same(before, snapshot(params, opt)), "name": name}


def test_a_gradient_in_another_dtype_raises_on_every_rank_before_anything_changes():
    results = run_distributed(bad_gradient_dtype, 2)
    name = results[0]["name"]
    assert results[1]["error"].startswith("PreflightError"), results[1]["error"]
    assert "torch.bfloat16" in results[1]["error"] and "torch.float32" in results[1]["error"]
    assert "another rank (global rank 1" in results[0]["error"], results[0]["error"]
    for r in results:
        assert repr(name) in r["error"], r["error"]
        assert r["unchanged"]


def mismatched_options(rank: int, world_size: int) -> dict[str, Any]:
    """Optimizers built with one difference on rank 1, then a learning rate changed on rank 1 only."""
    errors: dict[str, str | None] = {}
    variants: dict[str, tuple[dict[str, Any], bool]] = {
        "lr": ({"lr": 0.03}, False),
        "ns_steps": ({"ns_steps": 4}, False),
        "wire_dtype": ({"wire_dtype": torch.float32}, False),
        "missing AdamW parameter": ({}, True),
    }
    for case, (different, drop_norm) in variants.items():
        model = sharded_model()
        params = model.named()
        if rank == 1 and drop_norm:
            params = [(n, p) for n, p in params if n != "norm.weight"]
        options = {**OPTIONS, **(different if rank == 1 else {})}
        errors[case] = attempt(lambda params=params, options=options: Muon(params, **options))
    model = sharded_model()
    params = model.named()
    opt = Muon(params, **OPTIONS)
    set_gradients(params, 0)
    opt.step()
    if rank == 1:
        opt.param_groups[0]["lr"] = 0.05
    set_gradients(params, 1)
    before = snapshot(params, opt)
    errors["lr changed by one rank"] = attempt(opt.step)
    return {"errors": errors, "unchanged": same(before, snapshot(params, opt))}


def test_ranks_built_or_scheduled_differently_raise_on_every_rank_naming_the_option():
    results = run_distributed(mismatched_options, 2)
    expected = {
        "lr": ("param group 0: lr", "0.02", "0.03"),
        "ns_steps": ("param group 0: ns_steps", "5", "4"),
        "wire_dtype": ("option wire_dtype", "torch.bfloat16", "torch.float32"),
        "missing AdamW parameter": ("'norm.weight'",),
        "lr changed by one rank": ("param group 0: lr", "0.02", "0.05", "at this step"),
    }
    for rank, r in enumerate(results):
        for case, parts in expected.items():
            error = r["errors"][case]
            assert error is not None and error.startswith("OptionMismatchError"), (rank, case, error)
            for part in parts:
                assert part in error, (rank, case, part, error)
        assert r["unchanged"]


EMPTY_SHAPES = [("layers.0.wq.weight", (12, 8)), ("layers.0.empty.weight", (4, 0)), ("norm.weight", (8,))]


def empty_matrix(rank: int, world_size: int) -> dict[str, Any]:
    """A 4×0 parameter (FSDP2 gives each rank an empty local piece) beside an ordinary matrix."""
    model = sharded_model(EMPTY_SHAPES)
    params = model.named()
    opt = Muon(params, **OPTIONS)
    error = None
    for step in range(2):
        set_gradients(params, step)
        error = error or attempt(opt.step)
    return {
        "error": error,
        "local": {n: tuple(p.to_local().shape) for n, p in params},
        "params": {n: p.full_tensor() for n, p in params if p.numel()},  # torch cannot gather a (0, 0) piece
    }


def test_an_n_by_0_parameter_trains_under_fsdp():
    results = run_distributed(empty_matrix, 2)
    want = reference(Muon, 2, EMPTY_SHAPES)
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["local"]["layers.0.empty.weight"] in ((0, 0), (2, 0))
        for name, p in r["params"].items():
            assert torch.equal(p, want[name]), name


def return_launches(rank: int, world_size: int) -> dict[str, Any]:
    """How many return exchanges this rank launches in a step that succeeds, then in one whose direction raises
    on rank 1 (counted where :class:`BackExchange` launches its packed exchange)."""
    from dtensor_muon.engine.pending import BackExchange

    launched: list[int] = []
    start = BackExchange.start

    def counting_start(self: BackExchange) -> None:
        if self.exchange is None and self.packed is not None:
            launched.append(len(self.param_indices))
        start(self)

    BackExchange.start = counting_start
    try:
        model = sharded_model()
        params = model.named()
        opt = CholeskyCheckedNorMuon(params, **OPTIONS)
        set_gradients(params, 0)
        opt.step()
        succeeded = len(launched)
        owned_by_1 = [r.spec.name for plan in opt.plans for r in plan.routes if r.owner == 1]
        poison = next(name for name, p in params if p.ndim == 2 and name in owned_by_1)
        set_gradients(params, 1, poison=poison)
        error = attempt(opt.step)
        failed = len(launched) - succeeded
    finally:
        BackExchange.start = start
    return {"succeeded": succeeded, "failed": failed, "error": error}


@pytest.mark.parametrize("device", DEVICES)
def test_a_failed_step_launches_no_return_exchange(device):
    """A step over several ranks packs each return exchange as its directions are computed and launches them only
    once every rank's directions succeeded: a step whose direction raised on rank 1 sends nothing back, on any
    rank."""
    for rank, r in enumerate(run_distributed(return_launches, 2, device=device)):
        assert r["succeeded"] > 0, (rank, r)
        assert r["error"] is not None and r["error"].startswith("StepFailedError"), (rank, r)
        assert r["failed"] == 0, f"rank {rank} launched {r['failed']} return exchanges in the failed step"
