"""A step that cannot run raises on every rank, naming the parameter, within seconds; non-finite updates show.

Multi-process cases run on real gloo processes under a deadline: a rank still running when it passes
fails the test (the processes are killed) instead of hanging it.
"""

from __future__ import annotations

import itertools
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
from dtensor_muon.engine.context import StepContext
from dtensor_muon.engine.metrics import StepStats
from dtensor_muon.kernels import elementwise

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


def test_one_process_metrics_off_the_gpu_take_each_unit_s_norms_from_torch(monkeypatch):
    """Units applied at once (:meth:`StepContext.compute_and_apply`) take their metrics' norms from the apply's
    pass only where that pass computes them (CUDA, large regions). On CPU every unit's norms are torch's
    vector_norm of its O, bit for bit, so the update RMS, the largest matrix's RMS and the non-finite names
    (a NaN in one expert's gradient) are exactly those of :class:`StepStats` fed each O."""
    recorded: list[tuple[torch.Tensor, Any, list[str], torch.Tensor]] = []
    add_orthogonal_norms = StepStats.add_orthogonal_norms

    def record(self, norms, lr_adjusted, names, o):  # type: ignore[no-untyped-def]
        recorded.append((norms.clone(), lr_adjusted, list(names), o.clone()))
        add_orthogonal_norms(self, norms, lr_adjusted, names, o)

    applied_at_once: list[str] = []
    compute_and_apply = StepContext.compute_and_apply

    def count(self, e, specs, stacked, target, decide_as=None):  # type: ignore[no-untyped-def]
        applied_at_once.append(e.name)
        compute_and_apply(self, e, specs, stacked, target, decide_as)

    monkeypatch.setattr(StepStats, "add_orthogonal_norms", record)
    monkeypatch.setattr(StepContext, "compute_and_apply", count)
    params = tiny_params()
    opt = Muon(params, **scenarios.OPTIONS)
    for step in range(2):
        recorded.clear()
        applied_at_once.clear()
        set_plain_gradients(params, step)
        if step == 1:
            dict(params)["layers.0.moe.experts"].grad[3, 0, 0] = float("nan")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        m = opt.metrics
        assert "layers.0.moe.experts" in applied_at_once and "layers.0.attention.wq" in applied_at_once
        reference = StepStats(rule="muon")
        for norms, lr_adjusted, names, o in list(recorded):
            torch_norms = torch.linalg.vector_norm(o, dim=(-2, -1), dtype=torch.float32).reshape(-1)
            torch.testing.assert_close(norms.reshape(-1), torch_norms, rtol=0, atol=0, equal_nan=True)
            reference.add_orthogonal(o, lr_adjusted, names)
        reference.start_nonfinite_check()
        assert reference.max_matrix_rms is not None
        expected_rms = (float(reference.sq_sum["muon"]) / reference.count["muon"]) ** 0.5
        got = [m["muon/update_rms/muon"], m["muon/update_rms_max/muon"]]
        assert got == pytest.approx([expected_rms, float(reference.max_matrix_rms)], rel=0, abs=0, nan_ok=True)
        expected_names = ["layers.0.moe.experts[3]"] if step == 1 else []
        assert reference.nonfinite_names() == expected_names
        assert m["muon/nonfinite_updates"] == len(expected_names)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert any("'layers.0.moe.experts[3]'" in message for message in messages) == (step == 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_units_applied_at_once_take_their_norms_from_the_apply(monkeypatch):
    """One process on CUDA, units of at least MIN_KERNEL_NUMEL entries (eight stacked 768×1024 experts, one
    2048² matrix): no unit takes a separate norm (the apply's pass gives them), and against the separate norm
    and apply (``MAX_NORM_MATRICES = 0``) the parameters are bit for bit the same, the update RMS agrees within
    1e-6 and a NaN in one expert's gradient is counted and named as before. Three steps: CUDA graphs are
    captured in the first ones."""
    separate_norms: list[str] = []
    add_orthogonal = StepStats.add_orthogonal

    def count(self, o, lr_adjusted, names):  # type: ignore[no-untyped-def]
        separate_norms.extend(names)
        add_orthogonal(self, o, lr_adjusted, names)

    monkeypatch.setattr(StepStats, "add_orthogonal", count)

    def run() -> tuple[list[torch.Tensor], list[tuple[float, float, bool]]]:
        gen = torch.Generator(device="cuda").manual_seed(0)
        shapes = (("experts", (64, 768, 1024)), ("wq", (2048, 2048)))
        params = [(n, nn.Parameter(0.02 * torch.randn(s, generator=gen, device="cuda"))) for n, s in shapes]
        opt = Muon(params, **scenarios.OPTIONS)
        out = []
        for step in range(3):
            for _, p in params:
                p.grad = torch.randn(p.shape, generator=gen, device="cuda")
            if step == 2:
                dict(params)["experts"].grad[3, 0, 0] = float("nan")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
                m = opt.metrics  # the warning comes from the step, or here once the flags reach the host
            messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            warned = any("'experts[3]'" in message for message in messages)
            out.append((m["muon/update_rms/muon"], m["muon/nonfinite_updates"], warned))
        return [p.detach() for _, p in params], out

    fused_params, fused = run()
    assert separate_norms == []
    monkeypatch.setattr(elementwise, "MAX_NORM_MATRICES", 0)
    separate_params, separate = run()
    assert len(separate_norms) == 3 * (64 + 1)
    for a, b in zip(fused_params, separate_params):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert [rms for rms, _, _ in fused] == pytest.approx([rms for rms, _, _ in separate], rel=1e-6, nan_ok=True)
    assert [(bad, warned) for _, bad, warned in fused] == [(0, False), (0, False), (1, True)]
    assert [(bad, warned) for _, bad, warned in separate] == [(0, False), (0, False), (1, True)]


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
    mesh = scenarios.make_mesh("shard0", world_size)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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
    ``overlap=True`` after the step and after ``flush()`` (Python references only: weakrefs to the Works of
    every exchange launched, out and back)."""
    import gc
    import weakref

    from dtensor_muon.distributed.exchange import PackedExchange

    launched: list[weakref.ref] = []
    start = PackedExchange.start

    def recording_start(self, *args, **kwargs):
        pending = start(self, *args, **kwargs)
        launched.append(weakref.ref(pending.handle))
        return pending

    PackedExchange.start = recording_start
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
    PackedExchange.start = start
    return out


@pytest.mark.slow
def test_no_exchange_work_is_kept_after_the_step_or_the_flush():
    for r in run_distributed(exchange_handles_after_step, 2, timeout=DEADLINE_S):
        assert r["launched overlap=False"] > 0 and r["alive after step overlap=False"] == 0, r
        assert r["alive after step overlap=True"] > 0, r  # the return exchanges are still in flight
        assert r["alive after flush overlap=True"] == 0, r


def buffers_alive_after_step(rank: int, world_size: int) -> dict[str, int]:
    """With ``overlap=True``, how many of a step's buffers are still alive (weakrefs, after a garbage
    collection) once ``step()`` has returned, while the return exchanges are in flight into the next forward:
    the prepared inputs U, the owners' direction outputs O, the pieces the exchanges out received, and the
    pieces the return exchanges received; then after ``flush()``."""
    import gc
    import weakref

    from dtensor_muon.engine.context import StepContext
    from dtensor_muon.engine.pending import BackExchange
    from dtensor_muon.engine.strategies import owned

    refs: dict[str, list[weakref.ref]] = {"inputs": [], "outputs": [], "received out": [], "received back": []}
    prepare_many, compute_unit = StepContext.prepare_many, StepContext.compute_unit
    launch_out, start_back = owned._launch_out, BackExchange.start

    def recorded(key: str, fn, pick=lambda result: [result]):
        def wrapper(*args, **kwargs):
            result = fn(*args, **kwargs)
            refs[key].extend(weakref.ref(t) for t in pick(result))
            return result

        return wrapper

    StepContext.prepare_many = recorded("inputs", prepare_many, pick=list)
    StepContext.compute_unit = recorded("outputs", compute_unit)
    owned._launch_out = recorded("received out", launch_out, pick=lambda pending: [pending.received])

    def recording_start_back(self: BackExchange) -> None:
        launching = self.exchange is None
        start_back(self)
        if launching:
            refs["received back"].append(weakref.ref(self.exchange.received))

    BackExchange.start = recording_start_back
    try:
        params = scenarios.distributed_params("shard0", world_size)
        model = scenarios.ParamHolder(params)
        named = [(n, getattr(model, n.replace(".", "__"))) for n, _ in params]
        opt = Muon(named, overlap=True, **scenarios.OPTIONS)
        opt.attach(model)
        scenarios.set_gradients(named, 0)
        opt.step()
        gc.collect()
        out = {f"{key} made": len(r) for key, r in refs.items()}
        out.update({f"{key} alive after step": sum(w() is not None for w in r) for key, r in refs.items()})
        opt.flush()
        gc.collect()
        out.update({f"{key} alive after flush": sum(w() is not None for w in r) for key, r in refs.items()})
    finally:
        StepContext.prepare_many, StepContext.compute_unit = prepare_many, compute_unit
        owned._launch_out, BackExchange.start = launch_out, start_back
    return out


@pytest.mark.slow
def test_a_step_lets_go_of_its_buffers_before_the_next_forward():
    """Only what the next forward's hooks still need outlives step(): the return exchanges' received pieces;
    U, the directions' outputs and the pieces received by the exchanges out are freed inside the step."""
    for r in run_distributed(buffers_alive_after_step, 2, timeout=DEADLINE_S):
        assert all(r[f"{key} made"] > 0 for key in ("inputs", "outputs", "received out", "received back")), r
        for key in ("inputs", "outputs", "received out"):
            assert r[f"{key} alive after step"] == 0, (key, r)
        assert r["received back alive after step"] > 0, r  # in flight until the next forward
        assert r["received back alive after flush"] == 0, r


def inputs_alive_at_each_launch(rank: int, world_size: int) -> list[int]:
    """How many prepared inputs U are alive when each exchange out is launched, with one matrix per bucket."""
    import gc
    import weakref

    from dtensor_muon.engine.context import StepContext
    from dtensor_muon.engine.strategies import owned

    inputs: list[weakref.ref] = []
    alive: list[int] = []
    prepare_many, launch_out = StepContext.prepare_many, owned._launch_out

    def recording_prepare(*args, **kwargs):
        result = prepare_many(*args, **kwargs)
        inputs.extend(weakref.ref(u) for u in result)
        return result

    def counting_launch(*args, **kwargs):
        gc.collect()
        alive.append(sum(r() is not None for r in inputs))
        return launch_out(*args, **kwargs)

    StepContext.prepare_many, owned._launch_out = recording_prepare, counting_launch
    try:
        params = scenarios.distributed_params("shard0", world_size)
        opt = Muon(params, bucket_size_mb=1e-6, **scenarios.OPTIONS)  # a bucket per matrix
        scenarios.set_gradients(params, 0)
        opt.step()
    finally:
        StepContext.prepare_many, owned._launch_out = prepare_many, launch_out
    return alive


@pytest.mark.slow
def test_each_input_is_let_go_once_its_last_piece_is_packed():
    """U of a parameter is freed as soon as the last bucket with a piece of it is launched, not after every
    bucket: the count of live inputs falls from launch to launch."""
    for alive in run_distributed(inputs_alive_at_each_launch, 2, timeout=DEADLINE_S):
        assert len(alive) > 2, alive
        assert all(a >= b for a, b in itertools.pairwise(alive)), alive
        assert alive[-1] < alive[0], alive
