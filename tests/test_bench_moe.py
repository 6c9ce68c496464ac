"""bench/optimizer_step.py on MoE models: the built-in shapes of Qwen3-30B-A3B and Kimi K2 are torchtitan's,
``--quick`` runs with ``--world-size`` write the host-overhead and per-rank fields, and the busiest rank's
share is planned as dtensor_muon plans it (checked against a plan built here, independently)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_modules import BENCH, bench_module

from dtensor_muon.plan import build_plan
from dtensor_muon.plan.routing import uses_muon
from dtensor_muon.plan.simulate import fsdp_layout
from dtensor_muon.rules.muon import MuonRule

ROOT = Path(__file__).resolve().parents[1]
MOE_MODELS = ["qwen3_30b_a3b", "kimi_k2"]


def quick_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter shapes a ``--quick --model MODEL`` run uses (2 layers)."""
    o = bench_module("optimizer_step")
    family, _ = o.MODELS[model]
    return o.builtin_shapes(family, o.QUICK_FLAVORS.get(model, o.QUICK_FLAVOR), 2, True)


def independent_max_rank_flops(shapes: list[tuple[str, tuple[int, ...]]], world_size: int) -> tuple[int, int]:
    """(max of the plan's per-rank FLOPs, the busiest rank's computed matrices' ``MuonRule.cost`` summed) for the
    Muon parameters of ``shapes`` under FSDP over ``world_size`` ranks, planned here as the engine plans."""
    muon = [(n, s) for n, s in shapes if uses_muon(n, torch.empty(s, device="meta"), None)]
    group = bench_module("optimizer_step").muon_group()
    rule = MuonRule()
    plan = build_plan(
        [fsdp_layout(n, s, world_size) for n, s in muon],
        list(range(len(muon))),
        64 * 2**20,
        2,
        cost_fn=lambda k, shape: (rule.cost(group, shape).flops, 0),
    )
    rank = max(range(world_size), key=lambda r: (plan.rank_flops[r], -r))
    computed = sum(rule.cost(group, plan.routes[i].spec.shape).flops for i in plan.computed_by(rank))
    return max(plan.rank_flops), computed


@pytest.mark.parametrize("model", MOE_MODELS)
def test_builtin_shapes_are_torchtitans(model):
    pytest.importorskip("torchtitan")
    o = bench_module("optimizer_step")
    family, flavor = o.MODELS[model]
    quick_flavor = o.QUICK_FLAVORS[model]
    cases = [
        (flavor, False, 2, None),
        (flavor, False, 3, 24),
        (quick_flavor, True, 2, None),
        (quick_flavor, True, 3, 2),
    ]
    for f, quick, layers, experts in cases:
        built = o.builtin_shapes(family, f, layers, quick, experts)
        assert built == o.torchtitan_shapes(family, f, layers, quick, experts), (f, quick, layers, experts)
    shapes = dict(o.builtin_shapes(family, flavor, 2))
    if model == "qwen3_30b_a3b":  # the figures the benchmark is quoted with
        assert shapes["layers.1.moe.experts.w1"] == (128, 768, 2048)
        assert shapes["layers.0.attention.wq.weight"] == (32 * 128, 2048)
        assert shapes["layers.0.attention.wk.weight"] == (4 * 128, 2048)
        assert shapes["output.weight"] == (151936, 2048)
    else:
        assert shapes["layers.0.feed_forward.w1.weight"] == (18432, 7168)
        assert shapes["layers.1.moe.experts.w2"] == (384, 7168, 2048)
        assert shapes["layers.1.moe.shared_experts.w1.weight"] == (2048, 7168)
        assert shapes["layers.0.attention.wq_a.weight"] == (1536, 7168)
        assert shapes["layers.0.attention.wq_b.weight"] == (64 * 192, 1536)
        assert shapes["tok_embeddings.weight"] == (163840, 7168)
        assert dict(o.builtin_shapes(family, flavor, 2, experts=48))["layers.1.moe.experts.w1"] == (48, 2048, 7168)


def test_experts_and_world_size_arguments_are_checked():
    o = bench_module("optimizer_step")
    assert o.world_sizes(["8,64", "256"]) == [8, 64, 256]
    with pytest.raises(ValueError):
        o.world_sizes(["0"])
    with pytest.raises(ValueError, match="--experts"):
        o.builtin_shapes("qwen3", "30B-A3B", 2, experts=129)


@pytest.mark.parametrize("model", MOE_MODELS)
def test_busiest_rank_share_is_the_plans_busiest_rank(model):
    o = bench_module("optimizer_step")
    shapes = quick_shapes(model)
    muon_names = {n for n, s in shapes if uses_muon(n, torch.empty(s, device="meta"), None)}
    for world in (8, 64):
        share = o.rank_share(shapes, muon_names, o.muon_group(), world)
        most, computed = independent_max_rank_flops(shapes, world)
        assert share.planned_flops == most == computed == max(share.rank_flops), world
        assert share.units and share.muon_shards


@pytest.mark.slow
@pytest.mark.parametrize("model", MOE_MODELS)
def test_quick_run_writes_overhead_and_per_rank_fields(model, tmp_path):
    out = tmp_path / "result.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    flags = ["--quick", "--json", str(out), "--model", model, "--steps", "2", "--warmup", "1", "--world-size", "8"]
    flags += ["--units-per-stack", "2"]
    proc = subprocess.run(
        [sys.executable, str(BENCH / "optimizer_step.py"), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["key"] for r in result["rows"]] == ["dtensor_muon", "dtensor_muon_stacks_2", "torch_muon_adamw", "adamw"]
    for row in result["rows"]:
        assert row["launches"] > 0 and row["launches_counted"] == "top-level aten ops (CPU proxy)"
        assert 0 < row["host_ms"] <= row["wall_ms"] and row["device_ms"] is None  # CPU: no device time
    for kind in ("matrices", "experts", "adamw"):  # two extra steps each: the Muons still agree bit for bit
        assert result[f"max_rel_update_diff_{kind}"] == 0.0, kind
    share, stacked = result["per_rank"]
    assert (share["units_per_stack"], stacked["units_per_stack"]) == (1, 2)
    assert share["calls"] == share["units"] and share["units"] / 2 <= stacked["calls"] <= share["units"]
    assert share["world_size"] == 8 and share["share_ms"] > 0 and share["adamw_share_ms"] > 0
    assert share["ns_floor_ms"] is None  # CPU: no matmul rate measured
    assert share["elementwise_ms"] > 0 and share["traffic_floor_ms"] is None  # nor a copy rate
    assert share["back_to_back_busy_ms"] is None and share["back_to_back_idle_ms"] is None  # CPU: no device
    assert share["transactional_share_ms"] > 0 and share["transactional_back_to_back_ms"] > 0
    assert share["flag_after_directions_back_to_back_ms"] > 0
    for part in ("elementwise", "share"):  # the host's part and the launches (CPU: top-level aten ops)
        assert share[f"{part}_host_ms"] > 0 and share[f"{part}_launches"] > 0 and share[f"{part}_device_ms"] is None
    assert share["elementwise_launches"] < share["share_launches"]  # the share adds the directions' work
    most, computed = independent_max_rank_flops(quick_shapes(model), 8)
    assert share["planned_flops"] == share["max_rank_flops"] == most == computed


def test_stacked_calls_keep_every_matrix_and_stack_only_like_units():
    o = bench_module("optimizer_step")
    units = [((8, 6, 4), False)] * 5 + [((8, 6, 4), True)] * 3 + [((2, 6, 4), False)] * 2 + [((6, 4), False)] * 3
    calls = o.stacked_calls(units, 4)
    assert calls == [
        ((32, 6, 4), False, 8, None),
        ((8, 6, 4), False, None, None),  # the fifth local unit of 8 alone: no stack
        ((24, 6, 4), True, 8, None),
        ((4, 6, 4), False, 2, None),
        ((6, 4), False, None, None),
        ((6, 4), False, None, None),
        ((6, 4), False, None, None),
    ]
    assert o.stacked_calls(units, 1) == [(shape, owned, None, None) for shape, owned in units]
    params = [0, 0, 1, 1, 1, 2, 3, 4, 5, 5, 6, 7, 8]  # short local runs (at most GATHER_MAX_UNITS) gather
    assert o.stacked_calls(units, 4, params)[:4] == [
        ((32, 6, 4), False, 8, [2, 2]),  # parameter 0's 2 units and 1's first 2, copied into one input
        ((8, 6, 4), False, None, None),
        ((24, 6, 4), True, 8, None),  # owned units of several parameters stack
        ((4, 6, 4), False, 2, None),
    ]
    long_run = [((8, 6, 4), False)] * 7  # parameter 0's 5 units stay in their own view, parameter 1's 2 gather
    assert o.stacked_calls(long_run, 4, [0] * 5 + [1, 1]) == [
        ((32, 6, 4), False, 8, None),
        ((8, 6, 4), False, None, None),
        ((16, 6, 4), False, 8, None),
    ]
    wide = [((8, 1408, 2048), True)] * 2 + [((8, 768, 2048), True)] * 2  # sides above STACK_MAX_SIDE stay alone
    assert o.stacked_calls(wide, 4) == [
        ((8, 1408, 2048), True, None, None),
        ((8, 1408, 2048), True, None, None),
        ((16, 768, 2048), True, 8, None),
    ]


def test_the_step_floors_bytes_are_the_state_the_optimizer_keeps():
    """The step floor's state traffic (``state_bytes``: 20 bytes a Muon value, 28 an AdamW one) equals what one
    step of dtensor_muon.Muon must read and write of the tensors it holds after that step, counted here from them:
    each gradient read once, each parameter and each state tensor of its size read and written once."""
    o = bench_module("optimizer_step")
    params = o.ParameterSet(quick_shapes("qwen3_30b_a3b"), torch.device("cpu"))
    params.reset()
    (opt,) = o.build_optimizer("dtensor_muon", params)
    opt.step()
    counted = muon_values = 0
    for name, p in params.named:
        held = [t for t in tensors_in(opt.state[p]) if t.numel() == p.numel()]
        assert held, f"{name}: no state of its size"
        counted += p.grad.nbytes + 2 * p.nbytes + 2 * sum(t.nbytes for t in held)
        muon_values += p.numel() if name in params.muon_names else 0
    total = sum(p.numel() for _, p in params.named)
    assert 0 < muon_values < total
    assert o.state_bytes(muon_values, total - muon_values) == counted


def tensors_in(state: object) -> list[torch.Tensor]:
    """Every tensor in a parameter's optimizer state, nested dictionaries (owner states) included."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in tensors_in(v)]
    return []


def test_the_transactional_share_computes_what_the_one_pass_share_does():
    """The busiest rank's share timed as a multi-rank step runs it (momentum without advancing, the advance after
    the directions) leaves every parameter and momentum buffer with the bits of the one-pass share, from the same
    start (the library's prepare, then advance, equals its prepare_and_advance)."""
    o = bench_module("optimizer_step")
    shapes = quick_shapes("qwen3_30b_a3b")
    muon_names = {n for n, s in shapes if uses_muon(n, torch.empty(s, device="meta"), None)}
    share = o.rank_share(shapes, muon_names, o.muon_group(), 2)
    one_pass, transactional, late_flag = (o.ShareWork(share, o.muon_group(), torch.device("cpu")) for _ in range(3))
    for _ in range(2):
        one_pass.step()
        transactional.step(transactional=True)
        late_flag.step(transactional=True, flag_after_directions=True)
    assert one_pass.shards
    for a, b, c in zip(one_pass.shards, transactional.shards, late_flag.shards):
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])  # parameter, momentum buffer
        assert torch.equal(a[0], c[0]) and torch.equal(a[2], c[2])
        assert not torch.equal(a[2], torch.zeros_like(a[2]))  # the buffers did advance


def test_a_share_forms_its_calls_under_the_rows_constants(monkeypatch):
    """``--units-per-stack 2:GATHER_MAX_UNITS=0`` keeps every local unit to its own parameter's stacks: the row's
    calls are those the constant gives (set here by hand), not the default's, and the constant is restored."""
    o = bench_module("optimizer_step")
    from dtensor_muon.kernels import batching

    shapes = quick_shapes("qwen3_30b_a3b")
    muon_names = {n for n, s in shapes if uses_muon(n, torch.empty(s, device="meta"), None)}
    share = o.rank_share(shapes, muon_names, o.muon_group(), 8)
    before = batching.GATHER_MAX_UNITS
    default = len(o.stacked_calls(share.units, 2, share.unit_params))
    with monkeypatch.context() as m:
        m.setattr(batching, "GATHER_MAX_UNITS", 0)
        per_parameter = len(o.stacked_calls(share.units, 2, share.unit_params))
    assert per_parameter > default
    cpu = torch.device("cpu")
    rows = [o.run_share(share, shapes, o.muon_group(), cpu, 0, 1, None, spec) for spec in ("2", "2:GATHER_MAX_UNITS=0")]
    assert [row["calls"] for row in rows] == [default, per_parameter]
    assert before == batching.GATHER_MAX_UNITS  # restored


def test_device_busy_time_counts_overlapping_activities_once_and_idle_is_the_rest_of_the_span():
    """Activities (start, end) of 0–4 and 2–5 (overlapping: two streams), 5–6 (touching), 8–9 and 8.5–8.7 (inside):
    busy = 6 + 1 = 7, span = 9; none: (0, 0)."""
    o = bench_module("optimizer_step")
    assert o.busy_and_span([(8.0, 9.0), (0.0, 4.0), (5.0, 6.0), (2.0, 5.0), (8.5, 8.7)]) == (7.0, 9.0)
    assert o.busy_and_span([(3.0, 4.5)]) == (1.5, 1.5)
    assert o.busy_and_span([]) == (0.0, 0.0)
