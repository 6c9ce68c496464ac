"""Stacks: several same-size units of one shape computed in one call, each matrix as its unit alone would get it.

The engine's plumbing is checked bit for bit on CPU with a rule whose direction is exact arithmetic (O = U/2,
the same bits whatever the batch): a stacked step must hand every matrix its own O, in every strategy (local
runs of experts, owners across ranks), and take fewer, larger calls. Muon's Newton–Schulz on CPU is compared
against its unstacked run within a bound from fp32 rounding (CPU batched products may round by batch count,
which is why stacks are off on CPU by default). On the GPU, where stacks are meant to run, the same comparison
is bitwise (the dispatch decides as for one unit, and the kernels compute each matrix of a batch alike).
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import pytest
import torch
from dist_harness import full_tensor, one_thread, requires_cuda, run_distributed
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import MOP, MatrixSplit, Muon, NorMuon
from dtensor_muon.kernels import batching
from dtensor_muon.kernels.batching import MAX_STACK, stack_units, units_per_stack
from dtensor_muon.kernels.shapes import decide_as_batch, decision_count, decision_work, gram_work
from dtensor_muon.linalg.newton_schulz import newton_schulz
from dtensor_muon.linalg.ns_graphs import NewtonSchulzGraphs
from dtensor_muon.rules.mop import MOPRule
from dtensor_muon.rules.muon import MuonRule
from dtensor_muon.rules.normuon import NorMuonRule

EXPERTS = [("layers.0.moe.experts.w1", (32, 6, 8)), ("layers.0.moe.experts.w3", (32, 6, 8))]
DENSE = [("layers.0.attention.wq", (12, 8))]
OPTIONS: dict[str, Any] = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, wire_dtype=torch.float32)
STEPS = 2


class HalvingRule(MuonRule):
    """Muon's momentum with O = U/2: exact in any batch, so a stack must give each matrix exactly its unit's O.
    Records the shape of every call."""

    calls: ClassVar[list[tuple[int, ...]]] = []

    def direction(self, u: Tensor, owner_states, group, runner) -> Tensor:
        HalvingRule.calls.append(tuple(u.shape))
        return u * 0.5


class HalvingMuon(Muon):
    rule = HalvingRule()


def initial(shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(name, torch.randn(shape, generator=g)) for name, shape in shapes]


def gradient(shapes: list[tuple[str, tuple[int, ...]]], step: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return [torch.randn(shape, generator=g) for _, shape in shapes]


def one_process(front_end: type, shapes: list, units: int, device: str = "cpu") -> tuple[list[Tensor], list]:
    """Parameters after STEPS steps on one process with stacks of up to ``units`` units; the calls' shapes."""
    HalvingRule.calls = []
    params = [(n, p.to(device).requires_grad_()) for n, p in initial(shapes)]
    opt = front_end(params, **OPTIONS)
    with stack_units(units):
        for step in range(STEPS):
            for (_, p), g in zip(params, gradient(shapes, step)):
                p.grad = g.to(device)
            opt.step()
    return [p.detach().cpu() for _, p in params], HalvingRule.calls


def test_newton_schulz_rules_stack_and_on_cuda_only_on_the_gpu_backend() -> None:
    from dtensor_muon.rules.muon import gpu_backend_runs

    group = Muon([("layers.0.attention.wq", torch.nn.Parameter(torch.zeros(8, 8)))]).param_groups[0]
    cpu = torch.device("cpu")
    assert MuonRule().stacks_units(group, (768, 2048), 8, cpu)
    assert NorMuonRule().stacks_units(group, (768, 2048), 8, cpu)
    assert not MOPRule().stacks_units(group, (768, 2048), 8, cpu)
    assert not gpu_backend_runs(torch.bfloat16, (768, 2048), 8, cpu)  # the GPU backend needs CUDA


def test_units_per_stack_defaults_and_override() -> None:
    assert units_per_stack(torch.device("cpu")) == 1
    assert units_per_stack(torch.device("cuda")) == MAX_STACK
    with stack_units(16):
        assert units_per_stack(torch.device("cpu")) == 16
    with pytest.raises(ValueError, match="stack_units"), stack_units(0):
        pass


def test_a_stack_is_decided_as_its_units() -> None:
    """Every floor of the dispatch counts the decision batch: a stack of 4 units of 2 matrices of 1408×2048 takes
    the SYRK products exactly where one unit of 2 does not (2·66 lower tiles < MIN_SYRK_TILES = 264 ≤ 8·66)."""
    from dtensor_muon.kernels.triton_matmuls import syrk_pays

    unit, stack = torch.empty(2, 1408, 2048, device="meta"), torch.empty(8, 1408, 2048, device="meta")
    assert not syrk_pays(unit) and syrk_pays(stack)
    with decide_as_batch(2):
        assert decision_count(stack) == 2 and decision_work(stack) == gram_work(unit)
        assert syrk_pays(stack) is syrk_pays(unit) is False
    assert decision_count(stack) == 8
    with pytest.raises(ValueError, match="decide_as_batch"), decide_as_batch(0):
        pass


def test_local_runs_of_experts_stack_and_keep_each_units_bits() -> None:
    """32 experts per parameter form units of 4 (min(8, 32/8)); stacks of 4 units take 16 experts per call."""
    shapes = EXPERTS + DENSE
    want, alone = one_process(HalvingMuon, shapes, units=1)
    got, stacked = one_process(HalvingMuon, shapes, units=4)
    for (name, _), a, b in zip(shapes, got, want):
        assert torch.equal(a, b), name
    assert sorted(set(alone)) == [(4, 6, 8), (12, 8)]
    assert sorted(set(stacked)) == [(12, 8), (16, 6, 8)]
    assert len(stacked) == STEPS * (2 * 2 + 1)  # per step: 2 stacks per expert parameter, the dense matrix


THIRD = [("layers.0.moe.experts.w2", (32, 6, 8))]


def test_short_runs_of_several_parameters_stack_together_and_keep_each_units_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every parameter's 8 units of 4 counted as a short run (GATHER_MAX_UNITS set to 8), stacks of 3 units
    cross parameters: w1's units 6-7 and w3's unit 0 are copied into one call, and every unit's O goes back to its
    own parameter (O = U/2: bit for bit); 24 units in 8 calls a step, as 3 parameters' units in order make them."""
    monkeypatch.setattr(batching, "GATHER_MAX_UNITS", 8)
    shapes = EXPERTS + THIRD
    want, alone = one_process(HalvingMuon, shapes, units=1)
    got, stacked = one_process(HalvingMuon, shapes, units=3)
    for (name, _), a, b in zip(shapes, got, want):
        assert torch.equal(a, b), name
    assert alone == [(4, 6, 8)] * 24 * STEPS
    assert stacked == [(12, 6, 8)] * 8 * STEPS


def test_short_runs_stack_across_parameters_with_muon_within_fp32_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real Newton–Schulz (fp32) in stacks of 3 units that cross parameters, against units alone, within the bound
    of :func:`test_muon_stacked_on_cpu_is_within_fp32_rounding_of_its_units`."""
    monkeypatch.setattr(batching, "GATHER_MAX_UNITS", 8)
    shapes = EXPERTS + THIRD
    with one_thread():
        want, _ = one_process(Muon, shapes, units=1)
        got, _ = one_process(Muon, shapes, units=3)
    lr_scale = OPTIONS["lr"] * max(1.0, 6 / 8) ** 0.5
    bound = STEPS * lr_scale * 15 * 3.4445**5 * 8 * 2.0**-24
    for (name, _), a, b in zip(shapes, got, want):
        assert float((a - b).abs().max()) <= bound, name


def test_holder_stack_keys_gather_only_short_runs() -> None:
    """Parameter 0 holds 5 stackable units (more than GATHER_MAX_UNITS = 4): its key names it; parameter 1's 2 and
    parameter 2's 4 keep the shared key; a unit that computes alone stays None and is not counted."""
    params = [0] * 5 + [1, 1] + [2] * 4 + [3, 3]
    keys: list = ["k"] * 11 + [None, "k"]
    assert batching.holder_stack_keys(params, keys) == [("k", 0)] * 5 + ["k"] * 6 + [None, "k"]


def sharded_run(
    rank: int,
    world_size: int,
    front_end: type,
    shapes: list[tuple[str, tuple[int, ...]]],
    dim: int,
    device: str,
    units: int | None,
    options: dict[str, Any],
) -> dict[str, Any]:
    """STEPS steps of ``front_end(params, **options)`` on ``shapes`` split along ``dim`` over the ranks on ``device``
    (``Shard(0)``: whole experts, every unit local to its holder; ``Shard(1)``: along their rows, every expert
    travels to an owner), with stacks of up to ``units`` units (None: the device's default). Returns the
    parameters after them and the shapes of the calls the front end's rule recorded."""
    torch.set_num_threads(1)
    mesh = init_device_mesh(device, (world_size,))
    recorder = type(front_end.rule)
    recorder.calls = []
    placements = [Shard(dim)]
    params = [(n, torch.nn.Parameter(distribute_tensor(p.to(device), mesh, placements))) for n, p in initial(shapes)]
    opt = front_end(params, **options)
    with stack_units(units) if units is not None else contextlib.nullcontext():
        for step in range(STEPS):
            for (_, p), g in zip(params, gradient(shapes, step)):
                p.grad = distribute_tensor(g.to(device), mesh, placements)
            opt.step()
    return {"params": [full_tensor(p) for _, p in params], "calls": list(recorder.calls)}


def test_expert_parallel_holders_stack_across_parameters_and_equal_one_process() -> None:
    """32 experts a parameter over 2 ranks: 4 units of 4 per parameter per rank, short runs, so each rank's 12
    units of 3 parameters take 2 calls a step in stacks of up to 8 units (a stack per parameter took 3, units
    alone 12), and the parameters equal one process's bit for bit."""
    shapes = EXPERTS + THIRD
    with one_thread():
        want, _ = one_process(HalvingMuon, shapes, units=1)
    results = run_distributed(sharded_run, 2, HalvingMuon, shapes, 0, "cpu", 8, OPTIONS)
    for (name, _), got, expected in zip(shapes, results[0]["params"], want):
        assert torch.equal(got, expected), name
    for r in results:
        assert r["calls"] == [(32, 6, 8), (16, 6, 8)] * STEPS


class AskedRule(HalvingRule):
    """HalvingRule that counts how often the engine asks whether its units stack."""

    asked: ClassVar[int] = 0

    def stacks_units(self, group, shape, unit_size, device) -> bool:
        AskedRule.asked += 1
        return super().stacks_units(group, shape, unit_size, device)


class AskedMuon(Muon):
    rule = AskedRule()


def test_whether_units_stack_is_asked_once_a_step_per_shape_and_group() -> None:
    """The 16 units of 4 experts of EXPERTS (one group, one shape) stack after one question a step: on CUDA each
    answer is a dispatch decision, and a model's experts can be hundreds of units of one shape."""
    AskedRule.asked = 0
    got, stacked = one_process(AskedMuon, EXPERTS, units=4)
    want, _ = one_process(HalvingMuon, EXPERTS, units=4)
    assert AskedRule.asked == STEPS
    assert set(stacked) == {(16, 6, 8)} and len(stacked) == STEPS * 4
    for (name, _), a, b in zip(EXPERTS, got, want):
        assert torch.equal(a, b), name


def test_units_of_matrices_wider_than_the_stack_limit_compute_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacks form only for short sides up to STACK_MAX_SIDE (set here to 5, below the experts' 6): each unit of 4
    experts is then its own call, as without stacks, the same bits."""
    monkeypatch.setattr(batching, "STACK_MAX_SIDE", 5)
    want, alone = one_process(HalvingMuon, EXPERTS, units=1)
    got, stacked = one_process(HalvingMuon, EXPERTS, units=4)
    for (name, _), a, b in zip(EXPERTS, got, want):
        assert torch.equal(a, b), name
    assert stacked == alone and set(alone) == {(4, 6, 8)}


def test_rules_that_do_not_stack_keep_their_units() -> None:
    """MOP's batched SVD may round by batch count, so its units never stack: one call per unit of 4."""
    calls: list[tuple[int, ...]] = []

    class RecordingMOPRule(MOPRule):
        def direction(self, u: Tensor, owner_states, group, runner) -> Tensor:
            calls.append(tuple(u.shape))
            return super().direction(u, owner_states, group, runner)

    class RecordingMOP(MOP):
        rule = RecordingMOPRule()

    params = [(n, p.requires_grad_()) for n, p in initial(EXPERTS)]
    opt = RecordingMOP(params, lr=0.02, weight_decay=0.1)
    with stack_units(4):
        for (_, p), g in zip(params, gradient(EXPERTS, 0)):
            p.grad = g
        opt.step()
    assert calls == [(4, 6, 8)] * 16


class HalvingNewtonSchulz(MuonRule):
    """Muon's rule with O = U/2 in place of Newton–Schulz (exact in any batch)."""

    def direction(self, u: Tensor, owner_states, group, runner) -> Tensor:
        HalvingRule.calls.append(tuple(u.shape))
        return u * 0.5


class HalvingNorMuonRule(NorMuonRule, HalvingNewtonSchulz):
    """NorMuon's normalization of O = U/2: its reductions, owner state v and all, with an exact O."""


class HalvingNorMuon(NorMuon):
    rule = HalvingNorMuonRule()


def test_normuon_stacks_with_its_reductions_unit_by_unit() -> None:
    """NorMuon's Newton–Schulz takes a stack, its row and matrix reductions each unit alone: the same bits as units
    one after another, owner state v included, in fewer calls."""
    want, alone = one_process(HalvingNorMuon, EXPERTS, units=1)
    got, stacked = one_process(HalvingNorMuon, EXPERTS, units=4)
    for (name, _), a, b in zip(EXPERTS, got, want):
        assert torch.equal(a, b), name
    assert sorted(set(alone)) == [(4, 6, 8)] and sorted(set(stacked)) == [(16, 6, 8)]


def test_muon_stacked_on_cpu_is_within_fp32_rounding_of_its_units() -> None:
    """Real Newton–Schulz (fp32) in stacks of 4 units against units alone. Only the products' accumulation order
    may differ: each entry of a product of normalized matrices by at most k·2⁻²⁴ (k ≤ 8, the inner size), and
    five iterations of p(σ) = aσ + bσ³ + cσ⁵ magnify a difference at most a⁵ times (a = 3.4445, p's slope at
    0); over 15 products that bounds |ΔO| by 15·a⁵·8·2⁻²⁴, so |Δθ| ≤ γ'·that per step."""
    with one_thread():
        want, _ = one_process(Muon, EXPERTS, units=1)
        got, _ = one_process(Muon, EXPERTS, units=4)
    lr_scale = OPTIONS["lr"] * max(1.0, 6 / 8) ** 0.5  # γ' = γ·√max(1, rows/cols) (torch.optim.Muon's default)
    bound = STEPS * lr_scale * 15 * 3.4445**5 * 8 * 2.0**-24
    for (name, _), a, b in zip(EXPERTS, got, want):
        assert float((a - b).abs().max()) <= bound, name


# ---------------------------------------------------------------- owners across ranks
@pytest.mark.parametrize(
    "world_size,bucket_size_mb",
    [(2, 64.0), (3, 64.0), (2, 1e-4)],
    ids=["2 ranks", "3 ranks", "2 ranks, a bucket per unit"],
)
def test_owners_stack_units_and_equal_one_process(world_size: int, bucket_size_mb: float) -> None:
    """With one bucket per unit (104 bytes a bucket), an owner computes consecutive buckets together to stack."""
    with one_thread():
        want, _ = one_process(HalvingMuon, EXPERTS, units=1)
    options = OPTIONS | {"bucket_size_mb": bucket_size_mb}
    results = run_distributed(sharded_run, world_size, HalvingMuon, EXPERTS, 1, "cpu", 8, options)
    for (name, _), got, expected in zip(EXPERTS, results[0]["params"], want):
        assert torch.equal(got, expected), name
    calls = [shape for r in results for shape in r["calls"]]
    assert sum(shape[0] for shape in calls) == STEPS * 64  # every expert computed once per step
    assert max(shape[0] for shape in calls) > 4  # owners took several units of 4 in one call
    assert len(calls) < STEPS * 16  # fewer calls than units


# ---------------------------------------------------------------- on one GPU: Newton–Schulz, bitwise
GPU_EXPERTS = [("layers.0.moe.experts.w1", (64, 768, 2048)), ("layers.0.moe.experts.w2", (64, 2048, 768))]


class RecordingMuonRule(MuonRule):
    """Muon's rule, recording the shape of every direction call."""

    calls: ClassVar[list[tuple[int, ...]]] = []

    def direction(self, u: Tensor, owner_states, group, runner) -> Tensor:
        RecordingMuonRule.calls.append(tuple(u.shape))
        return super().direction(u, owner_states, group, runner)


class RecordingMuon(Muon):
    rule = RecordingMuonRule()


def gpu_run(units: int, front_end: type = RecordingMuon) -> tuple[list[Tensor], list[tuple[int, ...]]]:
    with stack_units(units):
        return gpu_run_of(GPU_EXPERTS, front_end)


def gpu_run_of(
    shapes: list[tuple[str, tuple[int, ...]]], front_end: type = RecordingMuon
) -> tuple[list[Tensor], list[tuple[int, ...]]]:
    """Parameters of ``shapes`` after STEPS steps on one process on the GPU; the calls' shapes."""
    RecordingMuonRule.calls = []
    params = [(n, p.cuda().requires_grad_()) for n, p in initial(shapes)]
    opt = front_end(params)  # defaults: bf16 Newton–Schulz from CUDA graphs
    for step in range(STEPS):
        for (_, p), g in zip(params, gradient(shapes, step)):
            p.grad = g.cuda()
        opt.step()
    return [p.detach().cpu() for _, p in params], RecordingMuonRule.calls


@requires_cuda
def test_stacks_on_the_gpu_equal_units_alone_bitwise() -> None:
    """Qwen3-30B-A3B-sized experts, wide and tall, 64 per parameter in units of 8 (the GPU backend's size: 8·768²·2048
    multiply-adds ≥ MIN_GPU_BACKEND_WORK): one stack of 8 units per parameter against units one after another."""
    want, alone = gpu_run(1)
    got, stacked = gpu_run(8)
    assert sorted(alone) == sorted([(8, 768, 2048), (8, 2048, 768)] * 8 * STEPS)
    assert sorted(stacked) == sorted([(64, 768, 2048), (64, 2048, 768)] * STEPS)
    for (name, _), a, b in zip(GPU_EXPERTS, got, want):
        assert torch.equal(a, b), f"{name}: max |Δ| {float((a - b).abs().max()):.3e}"


@requires_cuda
def test_normuon_stacks_on_the_gpu_equal_units_alone_bitwise() -> None:
    want, _ = gpu_run(1, NorMuon)
    got, _ = gpu_run(8, NorMuon)
    for (name, _), a, b in zip(GPU_EXPERTS, got, want):
        assert torch.equal(a, b), f"{name}: max |Δ| {float((a - b).abs().max()):.3e}"


@requires_cuda
def test_units_on_the_torch_backend_do_not_stack_on_the_gpu() -> None:
    """Units of 4 such experts stay below MIN_GPU_BACKEND_WORK: torch's batched norm and cuBLAS's batched
    products may round by batch count there, so each unit keeps its own call."""
    params = [(n, p.cuda().requires_grad_()) for n, p in initial([("layers.0.moe.experts.w1", (32, 768, 2048))])]
    RecordingMuonRule.calls = []
    opt = RecordingMuon(params)
    with stack_units(8):
        params[0][1].grad = torch.randn(32, 768, 2048, device="cuda")
        opt.step()
    assert RecordingMuonRule.calls == [(4, 768, 2048)] * 8


@requires_cuda
@pytest.mark.slow
def test_owners_sharing_one_gpu_stack_and_equal_one_process_unstacked_bitwise() -> None:
    """The experts split along their rows over 2 ranks on one GPU (bf16 wire): each owner stacks the units of a
    bucket, and the result is one process's with every unit alone."""
    want, _ = gpu_run(1)
    # one bucket for all (512 MB of bf16 matrices): each owner receives half the units of each parameter at once
    options = {"bucket_size_mb": 512}
    results = run_distributed(sharded_run, 2, RecordingMuon, GPU_EXPERTS, 1, "cuda", 8, options, device="cuda")
    calls = [shape for r in results for shape in r["calls"]]
    assert sum(shape[0] for shape in calls) == 2 * 64 * STEPS and max(shape[0] for shape in calls) > 8
    for (name, _), a, b in zip(GPU_EXPERTS, results[0]["params"], want):
        assert torch.equal(a, b), f"{name}: max |Δ| {float((a - b).abs().max()):.3e}"


GPU_EXPERT_PARALLEL = [*GPU_EXPERTS, ("layers.0.moe.experts.w3", (64, 768, 2048))]


@requires_cuda
@pytest.mark.slow
def test_expert_parallel_ranks_sharing_one_gpu_stack_across_parameters_bitwise() -> None:
    """Expert parallelism over 2 ranks on one GPU: each rank holds 4 units of 8 experts of each of 3 parameters
    (short runs), so w1's and w3's wide units stack together, copied into one call of 64 matrices, and w2's tall
    ones into one of 32; the parameters equal one process's, whose units compute alone, bit for bit."""
    with stack_units(1):
        want, _ = gpu_run_of(GPU_EXPERT_PARALLEL)
    results = run_distributed(sharded_run, 2, RecordingMuon, GPU_EXPERT_PARALLEL, 0, "cuda", None, {}, device="cuda")
    for r in results:
        assert r["calls"] == [(64, 768, 2048), (32, 2048, 768)] * STEPS
    for (name, _), a, b in zip(GPU_EXPERT_PARALLEL, results[0]["params"], want):
        assert torch.equal(a, b), f"{name}: max |Δ| {float((a - b).abs().max()):.3e}"


def column_sharded_model(
    shapes: list[tuple[str, tuple[int, ...]]], mesh: Any
) -> tuple[torch.nn.Module, list[tuple[str, torch.nn.Parameter]]]:
    """``initial(shapes)`` as parameters split along their columns over ``mesh`` (every matrix travels to an owner),
    registered on one module (``attach`` needs it under overlap); the module and the named parameters."""
    model = torch.nn.Module()
    params = []
    for name, p in initial(shapes):
        param = torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(1)]))
        model.register_parameter(name.replace(".", "_"), param)
        params.append((name, param))
    return model, params


def overlapped_owned_run(rank: int, world_size: int) -> list[Tensor]:
    """Owners stacking over one bucket per unit with ``overlap=True``: the exchanges back are held until the engine
    agrees and finished at the next step (or ``flush``)."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    model, params = column_sharded_model(EXPERTS, mesh)
    opt = HalvingMuon(params, **OPTIONS, bucket_size_mb=1e-4, overlap=True)
    opt.attach(model)
    with stack_units(8):
        for step in range(STEPS):
            for (_, p), g in zip(params, gradient(EXPERTS, step)):
                p.grad = distribute_tensor(g, mesh, [Shard(1)])
            opt.step()
        opt.flush()
    return [full_tensor(p) for _, p in params]


def test_owners_stacking_with_overlap_equal_one_process() -> None:
    with one_thread():
        want, _ = one_process(HalvingMuon, EXPERTS, units=1)
    got = run_distributed(overlapped_owned_run, 2)[0]
    for (name, _), a, b in zip(EXPERTS, got, want):
        assert torch.equal(a, b), name


STACK_CASES = [((768, 2048), 8), ((2048, 768), 8), ((1408, 2048), 8), ((2048, 1408), 8), ((2048, 7168), 2)]
"""(shape, unit size): Qwen3-30B-A3B's experts, DeepSeek-V3-16B's, Kimi K2's, in units the GPU backend runs (those
the engine stacks on CUDA)."""


@requires_cuda
@pytest.mark.parametrize("shape,unit", STACK_CASES, ids=lambda v: f"{v[0]}x{v[1]}" if isinstance(v, tuple) else v)
def test_newton_schulz_of_a_stack_equals_its_units_bitwise(shape: tuple[int, int], unit: int) -> None:
    """Newton–Schulz as the optimizer runs it (bf16, from CUDA graphs) on 4 units at once, deciding as for one unit,
    against each unit alone: the kernels must compute each matrix of a batch alike whatever the batch count."""
    from dtensor_muon.linalg.ns_graphs import NewtonSchulzGraphs
    from dtensor_muon.rules.muon import gpu_backend_runs

    assert gpu_backend_runs(torch.bfloat16, shape, unit, torch.device("cuda"))
    g = torch.randn(4 * unit, *shape, device="cuda")
    runner = NewtonSchulzGraphs()
    alone = torch.cat([runner(g[k : k + unit]) for k in range(0, 4 * unit, unit)])
    with decide_as_batch(unit):
        stacked = runner(g)
        stacked_again = runner(g)  # the replay of the stack's graph
    assert torch.equal(stacked, alone) and torch.equal(stacked_again, alone)


@requires_cuda
@pytest.mark.parametrize("shape", [(768, 2048), (2048, 768)], ids=["wide", "tall"])
def test_a_matrix_has_the_same_bits_alone_in_its_unit_and_in_the_largest_stack(shape: tuple[int, int]) -> None:
    """What stacks of any size rest on, for Qwen3-30B-A3B's experts (bf16, as the optimizer sends them): decided as
    a unit of 8, Newton–Schulz gives a matrix the same bits alone, in its unit of 8 and in a stack of MAX_STACK
    units (128 matrices: eager, G read in place, where the units replay CUDA graphs with a start of their own)."""
    from dtensor_muon.linalg.ns_graphs import NewtonSchulzGraphs

    unit = 8
    g = torch.randn(MAX_STACK * unit, *shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    g = g.bfloat16()
    runner = NewtonSchulzGraphs()
    with decide_as_batch(unit):
        stacked = runner(g)
        for first in (0, 7 * unit, (MAX_STACK - 1) * unit):
            assert torch.equal(runner(g[first : first + unit]), stacked[first : first + unit])
        for k in (0, 5 * unit + 3, MAX_STACK * unit - 1):
            assert torch.equal(runner(g[k : k + 1]), stacked[k : k + 1])


# ---------------------------------------------------------------- an owner's O borrowed from the runner
class OneBufferPerShape(NewtonSchulzGraphs):
    """The CUDA graphs' contract, on any device: a borrowed result is the one output buffer of its input's
    shape, which the next borrowed call of that shape overwrites; a result not borrowed is the caller's own.
    Records (input shape, borrowed) of every call."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: dict[tuple[int, ...], Tensor] = {}
        self.calls: list[tuple[tuple[int, ...], bool]] = []

    def __call__(self, g: Tensor, *args: Any, borrow: bool = False, **kwargs: Any) -> Tensor:
        out = newton_schulz(g, *args, **kwargs)
        self.calls.append((tuple(g.shape), borrow))
        if not borrow:
            return out
        buffer = self.buffers.setdefault(tuple(g.shape), torch.empty_like(out))
        return buffer.copy_(out)


class BorrowingMuon(Muon):
    """Muon whose engine runs Newton–Schulz through :class:`OneBufferPerShape`."""

    def _build_engine(self, *args: Any, **kwargs: Any) -> Any:
        engine = super()._build_engine(*args, **kwargs)
        engine.ns_runner = OneBufferPerShape()
        return engine


SAME_SHAPES = [(f"layers.{i}.attention.wq", (12, 8)) for i in range(6)] + [("layers.0.feed_forward.w2", (8, 12))]
GROUPED = [("layers.0.attention.qkv_linear.wqkv.weight", (30, 8))] + [
    (f"layers.{i}.attention.wo", (18, 8)) for i in range(5)
]
"""A fused QKV weight split by KV group (9 query heads over 3 groups of 2-row heads: W_q is 3 parts of 6×8 computed
as one 18×8 matrix) beside plain 18×8 matrices."""
BORROW_CASES = {
    "same shapes": (SAME_SHAPES, {}),
    "same shapes, overlap": (SAME_SHAPES, {"overlap": True}),
    "grouped split": (GROUPED, {"matrix_splits": {"*.wqkv.weight": MatrixSplit.grouped_qkv(9, 3, 2)}}),
}


def borrowing_run(
    rank: int, world_size: int, shapes: list[tuple[str, tuple[int, ...]]], options: dict[str, Any], front_end: type
) -> dict[str, Any]:
    """STEPS steps of ``front_end`` on ``shapes`` split along their columns (every matrix travels to an owner); the
    parameters after them and, per step, the calls of its engine's runner (:class:`OneBufferPerShape`)."""
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world_size,))
    model, params = column_sharded_model(shapes, mesh)
    opt = front_end(params, **options)
    if options.get("overlap"):
        opt.attach(model)
    steps = []
    for step in range(STEPS):
        for (_, p), g in zip(params, gradient(shapes, step)):
            p.grad = distribute_tensor(g, mesh, [Shard(1)])
        opt.step()
        if isinstance(opt._engine.ns_runner, OneBufferPerShape):
            steps.append(list(opt._engine.ns_runner.calls))
            opt._engine.ns_runner.calls.clear()
    opt.flush()
    return {"params": [full_tensor(p) for _, p in params], "calls": steps}


@pytest.mark.parametrize("case", list(BORROW_CASES))
def test_an_owner_borrows_the_runners_buffer_only_for_its_last_call_of_a_shape(case: str) -> None:
    """Each owner computes several matrices of one shape in one bucket: only the last call of an input shape may
    return the runner's buffer itself (the exchange back packs it before another call can overwrite it), the
    others take copies, with or without overlap (a step over several ranks packs each exchange back at once and
    launches it after the commit's agreement). A grouped split's parts count as the whole matrix they are computed
    as. Were an earlier call's O the buffer, the next call would overwrite it before it is sent: the parameters
    equal those of the same ranks with a runner that never lends its buffer, bit for bit, only if none is."""
    shapes, extra = BORROW_CASES[case]
    options = OPTIONS | extra
    want = run_distributed(borrowing_run, 2, shapes, options, Muon)[0]["params"]
    results = run_distributed(borrowing_run, 2, shapes, options, BorrowingMuon)
    for (name, _), got, expected in zip(shapes, results[0]["params"], want):
        assert torch.equal(got, expected), name
    for r in results:
        for calls in r["calls"]:
            inputs = [shape for shape, _ in calls]
            assert [borrowed for _, borrowed in calls] == [
                shape not in inputs[k + 1 :] for k, shape in enumerate(inputs)
            ], calls
    # some owner computes several matrices of one input shape in a step
    assert any(len(set(inputs := [c for c, _ in calls])) < len(inputs) for r in results for calls in r["calls"])
    if case == "grouped split":  # every owner computes two 18×8 inputs or more: W_q's owner one plain matrix too
        assert all(sum(c == (18, 8) for c, _ in calls) >= 2 for r in results for calls in r["calls"])
