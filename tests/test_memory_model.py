"""The optimizer's memory model (dtensor_muon.plan.memory) against the bytes the optimizer holds and by hand.

The measured case: the scenarios' awkward model (uneven and empty shards, whole experts, a 4-D weight,
AdamW parameters) on 4 real gloo ranks, one step of each optimizer; the state each rank then holds (sum of
``nbytes`` of its local tensors) equals the model's shard-state, AdamW-state and owner-state terms exactly,
the model's plans built by the simulator's layouts, not by the optimizer. The hand-computed cases write every
term of two matrices down.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest
import scenarios
import torch
from dist_harness import run_distributed
from torch.distributed.tensor import DTensor

from dtensor_muon.plan import build_plan
from dtensor_muon.plan.memory import (
    MeshPlan,
    OptimizerMemory,
    memory_per_rank,
    momentum_bytes,
    peak,
    staging_bytes,
)
from dtensor_muon.plan.placement import Owned
from dtensor_muon.plan.routing import uses_muon
from dtensor_muon.plan.simulate import (
    FRONT_ENDS,
    fsdp_layout,
    main,
    optimizer_rule,
    plan_model,
    simulate,
)

WORLD = 4
CASES = {  # name: (optimizer, momentum_dtype, offload)
    "muon": ("muon", "float32", "none"),
    "muon_bfloat16": ("muon", "bfloat16", "none"),
    "normuon_int8": ("normuon", "int8", "none"),
    "mop": ("mop", "float32", "none"),
    "soap": ("soap", "float32", "none"),
    "muon_int8_host": ("muon", "int8", "host"),
    "soap_host": ("soap", "float32", "host"),
}
OFFLOADED = ("momentum_buffer", "momentum_codes", "momentum_scale", "exp_avg", "exp_avg_sq")


def nbytes(t: torch.Tensor) -> int:
    return (t.to_local() if isinstance(t, DTensor) else t).nbytes


def held_state(rank: int, world_size: int, optimizer: str, momentum_dtype: str, offload: str) -> dict[str, int]:
    """One step of ``optimizer`` on the scenarios' Shard(0) parameters; the bytes of its state on this rank (with
    offload, the offloaded tensors and the spares the step wrote beside them are its host state)."""
    params = scenarios.distributed_params("shard0", world_size)
    front = FRONT_ENDS[optimizer][0]
    options = {"offload": offload} | ({} if optimizer == "soap" else {"momentum_dtype": momentum_dtype})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # offload on CPU parameters: "saves nothing"
        opt = front(params, lr=0.01, **options)
    scenarios.set_gradients(params, 0)
    opt.step()
    held = {"shard_state": 0, "adamw_state": 0, "owner_state": 0, "host_state": 0}
    if offload == "host":
        held["host_state"] = sum(t.nbytes for t in opt._engine.offload._spares.values())
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                if key == "owner_state":
                    held["owner_state"] += sum(nbytes(t) for matrix in value.values() for t in matrix.values())
                elif offload == "host" and key in OFFLOADED:
                    held["host_state"] += nbytes(value)
                elif group["use_muon"]:
                    held["shard_state"] += nbytes(value)
                else:
                    held["adamw_state"] += nbytes(value)
    return held


def modelled_state(optimizer: str, momentum_dtype: str, offload: str, world_size: int) -> list[dict[str, int]]:
    """The model's state terms per rank for the same parameters, planned as the simulator plans."""
    rule, group, wire = optimizer_rule(optimizer)
    params = [
        (name, shape, uses_muon(name, torch.empty(shape, device="meta"), None)) for name, shape in scenarios.SHAPES
    ]
    meshes, adamw = plan_model(
        params,
        world_size,
        bucket_bytes=64 * 2**20,
        wire_itemsize=wire,
        cost_fn=lambda k, shape: rule.cost(group, shape).plan_entry(),
        batchable=rule.can_batch(group),
    )
    spec = OptimizerMemory.from_rule(rule, group, wire, momentum_dtype=momentum_dtype, offload=offload == "host")
    ranks = memory_per_rank(meshes, adamw, spec, world_size)
    terms = ("shard_state", "adamw_state", "owner_state", "host_state")
    return [{term: getattr(r, term) for term in terms} for r in ranks]


def measure_every_case(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    return {name: held_state(rank, world_size, *case) for name, case in CASES.items()}


OFFLOAD_CASES = {  # on one process
    "muon_int8_host": CASES["muon_int8_host"],
    "soap_host": CASES["soap_host"],
    "muon_host": ("muon", "float32", "host"),
}


def measure_offload_cases(rank: int, world_size: int) -> dict[str, dict[str, int]]:
    return {name: held_state(rank, world_size, *case) for name, case in OFFLOAD_CASES.items()}


def test_offloaded_state_on_one_process_equals_the_bytes_it_holds():
    """On one process a step keeps no spare beside the offloaded momentum: the host term counts it once."""
    measured = run_distributed(measure_offload_cases, 1)[0]
    for name in ("muon_int8_host", "soap_host", "muon_host"):
        assert modelled_state(*OFFLOAD_CASES[name], 1) == [measured[name]], name
    assert measured["muon_host"]["host_state"] > 0


def test_state_terms_equal_the_bytes_the_optimizers_hold():
    measured = run_distributed(measure_every_case, WORLD)
    for name, case in CASES.items():
        got = [measured[rank][name] for rank in range(WORLD)]
        assert modelled_state(*case, WORLD) == got, name
    assert any(m["soap"]["owner_state"] > 0 for m in measured)  # the owner terms are not vacuous
    assert any(m["normuon_int8"]["owner_state"] > 0 for m in measured)
    assert all(m["muon_int8_host"]["shard_state"] == 0 < m["muon_int8_host"]["host_state"] for m in measured)


# ---------------------------------------------------------------- by hand
# Two matrices on 2 ranks, Shard(0): A 4×8 (16 elements per rank), B 6×4 (12 per rank); a vector of 10 for AdamW.
A, B = (4, 8), (6, 4)
MUON = OptimizerMemory(
    momentum=True, shard_scalar_bytes=0, input_itemsize=4, output_itemsize=2, wire_itemsize=2, ns_itemsize=2
)


def two_matrices(owner_bytes: dict[tuple[int, int], int] | None = None) -> tuple[list[MeshPlan], list]:
    layouts = [fsdp_layout("a", A, 2), fsdp_layout("b", B, 2)]
    cost = None if owner_bytes is None else (lambda k, shape: (shape[0] * shape[1], owner_bytes[shape]))
    plan = build_plan(layouts, [0, 1], 2**20, 2, cost_fn=cost)
    return [MeshPlan(plan, {0: layouts[0], 1: layouts[1]})], [fsdp_layout("v", (10,), 2)]


def owners(meshes: list[MeshPlan]) -> tuple[int, int]:
    placements = [u.placement for u in meshes[0].plan.units]
    assert all(isinstance(p, Owned) for p in placements)
    return placements[0].rank, placements[1].rank  # type: ignore[union-attr]


def test_every_term_by_hand():
    meshes, adamw = two_matrices({A: 100, B: 10})
    owner_a, owner_b = owners(meshes)
    ranks = memory_per_rank(meshes, adamw, MUON, 2)
    for r, got in enumerate(ranks):
        a, b = owner_a == r, owner_b == r
        assert got.params_grads == 2 * 4 * (16 + 12 + 5)
        assert got.shard_state == 4 * (16 + 12)
        assert got.adamw_state == 2 * 4 * 5 + 4
        assert got.owner_state == 100 * a + 10 * b
        u_and_updates = (4 + 2) * (16 + 12)
        # own pieces out and O's pieces back, and on the owner every piece in and every piece of O out
        wire = 2 * (2 * 16 + 2 * 12 + a * 2 * 32 + b * 2 * 24)
        outputs = 2 * (32 * a + 24 * b)
        assembled = 2 * (32 * a + 24 * b)  # one bucket holds both matrices
        assert got.exchange == u_and_updates + wire + outputs + assembled
        # 4×8: 2·(2·4·8 + 4·4²) = 256; 6×4 works as 4×6: 2·(2·4·6 + 4·4²) = 224
        assert got.ns_workspace == max(256 * a, 224 * b)
        # 2·(3·4·8 + 4·4²) = 320; 2·(3·4·6 + 4·4²) = 272
        assert got.cuda_graphs == 320 * a + 272 * b
        assert got.optimizer == sum(
            (got.shard_state, got.adamw_state, got.owner_state, got.exchange, got.ns_workspace, got.cuda_graphs)
        )
    top = peak(ranks)
    assert top.optimizer == max(r.optimizer for r in ranks)
    assert top.with_params_grads == max(r.optimizer + r.params_grads for r in ranks)


def test_offloaded_terms_by_hand():
    """offload: the momentum (16 + 12 float32 entries a rank) and AdamW's moments (2 × 5) leave the device;
    the host holds the momentum twice (its spare) and the moments once; the device holds the streamed copies,
    all of them here (152 bytes, below three buckets)."""
    meshes, adamw = two_matrices()
    on_device = memory_per_rank(meshes, adamw, MUON, 2)
    spec = OptimizerMemory(True, 0, 4, 2, 2, 2, offload=True, bucket_bytes=100)
    for before, got in zip(on_device, memory_per_rank(meshes, adamw, spec, 2)):
        assert (got.shard_state, got.adamw_state) == (0, 4)
        assert got.host_state == 2 * 4 * (16 + 12) + 2 * 4 * 5
        assert got.offload_staging == 4 * (16 + 12) + 2 * 4 * 5
        assert got.optimizer == before.optimizer - before.shard_state - before.adamw_state + 4 + got.offload_staging
    assert staging_bytes([64, 48], [40, 100, 100], 50) == 192  # three buckets of the largest momentum
    assert staging_bytes([20], [40, 1000], 50) == 150  # AdamW's moments go in pieces of a bucket
    assert staging_bytes([64, 48], [], 1000) == 112  # all of it


@pytest.mark.parametrize("dtype, expected", [("float32", 4 * 28), ("bfloat16", 2 * 28), ("int8", 28 + 4 * (2 + 3))])
def test_momentum_dtypes_by_hand(dtype, expected):
    """int8: one byte per element and a float32 scale per row's block of 128 columns (A's 2 rows of 8
    columns: 2 scales, B's 3 rows of 4: 3)."""
    meshes, adamw = two_matrices()
    spec = OptimizerMemory(True, 0, 4, 2, 2, 2, momentum_dtype=dtype)
    assert [r.shard_state for r in memory_per_rank(meshes, adamw, spec, 2)] == [expected, expected]


def test_int8_blocks_count_from_global_column_zero():
    """A shard of 2 rows × columns [128, 400): blocks 1, 2 and 3 (the last partial) of each row; columns
    [100, 372) touch blocks 0 to 2; a 3-D box's rows are its leading dims; an empty shard holds nothing."""
    assert momentum_bytes(((0, 2), (128, 400)), "int8") == 2 * 272 + 4 * 2 * 3
    assert momentum_bytes(((0, 1), (100, 372)), "int8") == 272 + 4 * 3
    assert momentum_bytes(((0, 1), (3, 4), (0, 10)), "int8") == 10 + 4
    assert momentum_bytes(((2, 2), (0, 400)), "int8") == 0


def test_whole_experts_are_local_and_their_input_is_the_exchange_term():
    """Experts [4, 3, 5] over 2 ranks: two whole experts each, computed where they lie, one by one (4 experts
    make units of one): nothing travels; the exchange term is the parameter's U (4·30 bytes), the workspace
    one 3×5 matrix's, and one graph serves both experts."""
    layout = fsdp_layout("experts", (4, 3, 5), 2)
    plan = build_plan([layout], [0], 2**20, 2)
    ranks = memory_per_rank([MeshPlan(plan, {0: layout})], [], MUON, 2)
    for got in ranks:
        assert got.exchange == 4 * 30
        assert got.ns_workspace == 2 * (2 * 3 * 5 + 4 * 3 * 3)
        assert got.cuda_graphs == 2 * (3 * 3 * 5 + 4 * 3 * 3)
        assert got.owner_state == 0 and got.adamw_state == 0


def test_what_each_rule_declares():
    muon = OptimizerMemory.from_rule(*optimizer_rule("muon")[:2], 2)
    assert (muon.momentum, muon.shard_scalar_bytes, muon.input_itemsize, muon.output_itemsize, muon.ns_itemsize) == (
        True, 0, 4, 2, 2,
    )  # fmt: skip
    soap = OptimizerMemory.from_rule(*optimizer_rule("soap")[:2], 4)
    assert (soap.momentum, soap.shard_scalar_bytes, soap.input_itemsize, soap.output_itemsize, soap.ns_itemsize) == (
        False, 4, 0, 4, 0,
    )  # fmt: skip
    mop = OptimizerMemory.from_rule(*optimizer_rule("mop")[:2], 4)
    assert (mop.momentum, mop.input_itemsize, mop.output_itemsize, mop.ns_itemsize) == (True, 4, 4, 0)


def test_bad_settings_raise():
    with pytest.raises(ValueError, match="momentum_dtype"):
        momentum_bytes(((0, 4),), "float8")
    with pytest.raises(ValueError, match="momentum_dtype"):
        OptimizerMemory(True, 0, 4, 2, 2, 2, momentum_dtype="fp8")
    meshes, adamw = two_matrices()
    with pytest.raises(ValueError, match="ranks"):
        memory_per_rank(meshes, adamw, MUON, 3)
    layout = fsdp_layout("a", A, 2)
    gathered = build_plan([layout], [0], 2**20, 2, gather_all=True)
    with pytest.raises(ValueError, match="gather_all"):
        memory_per_rank([MeshPlan(gathered, {0: layout})], [], MUON, 2)
    with pytest.raises(ValueError, match="--optimizer"):
        optimizer_rule("adam")


def test_simulator_memory_table_and_json(capsys, tmp_path):
    out = tmp_path / "m.json"
    main(["--model", "llama3:debugmodel", "--world-size", "4", "--optimizer", "soap", "--json", str(out)])
    assert "optimizer memory per rank" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())
    assert row["optimizer"] == "soap" and row["memory"]["owner_state"] > 0
    (f32,) = simulate("llama3:debugmodel", [4])
    (bf16,) = simulate("llama3:debugmodel", [4], momentum_dtype="bfloat16")
    (int8,) = simulate("llama3:debugmodel", [4], momentum_dtype="int8")
    assert f32.memory.owner_state == 0
    assert bf16.memory.shard_state * 2 == f32.memory.shard_state
    assert f32.memory.shard_state / 4 < int8.memory.shard_state < f32.memory.shard_state / 3.8
    (small,) = simulate("llama3:debugmodel", [4], bucket_mb=0.5)  # buckets below a tenth of the state
    (host,) = simulate("llama3:debugmodel", [4], offload="host", bucket_mb=0.5)
    assert host.memory.shard_state == 0 and host.memory.host_state > 2 * f32.memory.shard_state
    assert host.memory.offload_staging < (small.memory.shard_state + small.memory.adamw_state) / 2
    assert host.memory.optimizer < small.memory.optimizer


def test_stacks_count_the_workspace_and_graphs_of_their_calls():
    """Experts [16, 3, 5] on one rank form 8 units of 2 (min(8, 16 / 8)); in stacks of up to 3 units the rank makes
    calls of 6, 6 and 4 matrices: the workspace is a call of 6 matrices', and the graphs are those of the two
    distinct calls (6 and 4 matrices)."""
    layout = fsdp_layout("experts", (16, 3, 5), 1)
    plan = build_plan([layout], [0], 2**20, 2)
    assert [len(u.members) for u in plan.units] == [2] * 8
    alone = memory_per_rank([MeshPlan(plan, {0: layout})], [], MUON, 1)[0]
    stacks = memory_per_rank([MeshPlan(plan, {0: layout})], [], replace(MUON, units_per_stack=3), 1)[0]
    per_matrix_workspace, per_matrix_graph = 2 * (2 * 3 * 5 + 4 * 3 * 3), 2 * (3 * 3 * 5 + 4 * 3 * 3)
    assert alone.ns_workspace == 2 * per_matrix_workspace and alone.cuda_graphs == 2 * per_matrix_graph
    assert stacks.ns_workspace == 6 * per_matrix_workspace
    assert stacks.cuda_graphs == (6 + 4) * per_matrix_graph
    assert stacks.exchange == alone.exchange
    assert OptimizerMemory.from_rule(*optimizer_rule("muon")[:2], 2, units_per_stack=4).units_per_stack == 4
    assert OptimizerMemory.from_rule(*optimizer_rule("mop")[:2], 4, units_per_stack=4).units_per_stack == 1


def test_a_stack_of_short_runs_keeps_every_parameters_input_it_spans():
    """Three expert parameters [16, 3, 5] over 2 ranks: each rank holds 8 experts of each, 4 units of 2, short runs
    (at most GATHER_MAX_UNITS) that stack across parameters. In stacks of 3 units the calls span p0 | p0 p1 | p1 p2
    | p2, so two parameters' U (8·15 elements each, 4 bytes) are alive at once; in stacks of 4 each call is one
    parameter's, and without stacks one parameter's U at a time."""
    layouts = [fsdp_layout(f"layers.{k}.experts", (16, 3, 5), 2) for k in range(3)]
    plan = build_plan(layouts, [0, 1, 2], 2**20, 2)
    meshes = [MeshPlan(plan, dict(enumerate(layouts)))]
    one_shard = 4 * 8 * 15

    def exchange(units_per_stack: int) -> list[int]:
        return [r.exchange for r in memory_per_rank(meshes, [], replace(MUON, units_per_stack=units_per_stack), 2)]

    assert exchange(1) == [one_shard] * 2
    assert exchange(3) == [2 * one_shard] * 2
    assert exchange(4) == [one_shard] * 2
