"""Layout arithmetic and the plan (owners, pinned local load, bytes, buckets, digest) on synthetic layouts."""

import pytest
import torch

from dtensor_muon.distributed.layout import box_numel, chunk_range, intersect
from dtensor_muon.linalg.newton_schulz import ns_iteration_flops
from dtensor_muon.plan import build_plan, matrices_of
from dtensor_muon.plan.simulate import fsdp_layout


@pytest.mark.parametrize("length, n", [(10, 3), (3, 8), (16, 4), (1, 2), (0, 3), (7, 7)])
def test_chunk_range_matches_torch_chunk(length, n):
    chunks = torch.arange(length).chunk(n) if length else ()
    for index in range(n):
        lo, hi = chunk_range(0, length, n, index)
        expected = chunks[index].tolist() if index < len(chunks) else []
        assert list(range(lo, hi)) == expected


def test_intersect_and_numel():
    assert intersect(((0, 4), (0, 5)), ((2, 6), (1, 3))) == ((2, 4), (1, 3))
    assert intersect(((0, 2),), ((2, 4),)) is None
    assert box_numel(((2, 4), (1, 3))) == 4


def test_matrices_of_2d_3d_4d():
    assert [m.shape for m in matrices_of(0, fsdp_layout("w", (6, 4), 2))] == [(6, 4)]
    experts = matrices_of(1, fsdp_layout("e", (3, 5, 7), 2))
    assert [m.name for m in experts] == ["e[0]", "e[1]", "e[2]"]
    assert experts[2].box == ((2, 3), (0, 5), (0, 7)) and experts[2].shape == (5, 7)
    assert matrices_of(2, fsdp_layout("c", (6, 2, 3, 3), 2))[0].shape == (6, 18)
    assert ns_iteration_flops((4, 8)) == 4 * 16 * 8 + 2 * 64 == ns_iteration_flops((8, 4))


def test_lpt_owners_balance_and_are_deterministic():
    world = 4
    shapes = [(64, 64)] * 4 + [(32, 64)] * 8 + [(16, 16)] * 3
    layouts = [fsdp_layout(f"w{i}", s, world) for i, s in enumerate(shapes)]
    plan = build_plan(layouts, list(range(len(layouts))), 1 << 30, 2)
    again = build_plan(layouts, list(range(len(layouts))), 1 << 30, 2)
    assert [r.owner for r in plan.routes] == [r.owner for r in again.routes]
    assert plan.digest == again.digest
    # the four big matrices go one to each rank; the rest even out: total cost is divisible by 4
    assert sorted(r.owner for r in plan.routes[:4]) == [0, 1, 2, 3]
    assert plan.imbalance < 1.05
    costs = [0] * world
    for r in plan.routes:
        costs[r.owner] += r.spec.cost
    assert costs == plan.rank_flops


def test_whole_experts_are_local_and_count_as_pinned_load():
    world = 2
    experts = fsdp_layout("experts", (4, 64, 64), world)  # each rank holds 2 whole experts
    dense = [fsdp_layout(f"w{i}", (64, 64), world) for i in range(2)]
    plan = build_plan([experts] + dense, [0, 1, 2], 1 << 30, 2)
    local = [r for r in plan.routes if r.is_local]
    assert [r.spec.name for r in local] == [f"experts[{e}]" for e in range(4)]
    assert [r.holders[0][0] for r in local] == [0, 0, 1, 1]
    assert plan.imbalance == 1.0  # 2 pinned + 1 routed on each rank
    assert plan.local_to(0) == [0, 1] and len(plan.owned_by(0)) == 1


def test_bytes_exclude_what_the_owner_holds_and_empty_shards_send_nothing():
    world = 8
    layout = fsdp_layout("tiny", (3, 10), world)  # rows on ranks 0..2, ranks 3..7 hold nothing
    plan = build_plan([layout], [0], 1 << 30, 2)
    route = plan.routes[0]
    assert [rank for rank, _ in route.holders] == [0, 1, 2]
    assert route.owner in (0, 1, 2)  # ties go to a rank that already holds part of the matrix
    assert sum(plan.rank_bytes_sent) == sum(plan.rank_bytes_received) == 2 * 2 * 10 * 2  # 2 rows out, 2 back


def test_buckets_follow_parameter_order_and_byte_budget():
    layouts = [fsdp_layout(f"w{i}", (16, 16), 2) for i in range(5)]
    plan = build_plan(layouts, list(range(5)), 2 * 16 * 16 * 2, 2)
    assert plan.buckets == [[0, 1], [2, 3], [4]]


def test_digest_changes_with_names():
    a = build_plan([fsdp_layout("a", (8, 8), 2)], [0], 1 << 20, 2)
    b = build_plan([fsdp_layout("b", (8, 8), 2)], [0], 1 << 20, 2)
    assert a.digest != b.digest


@pytest.mark.parametrize(
    "experts, options, size",
    [
        (128, {}, 8),  # the engine's sizes: min(MAX_BATCH = 8, 128 / 8)
        (32, {}, 4),  # 32 / UNITS_PER_PARAMETER = 4
        (3, {}, 1),
        (128, {"max_batch": 64}, 16),  # 128 / 8: still eight units
        (128, {"max_batch": 64, "units_per_parameter": 2}, 64),
        (128, {"max_batch": 24, "units_per_parameter": 1}, 16),  # a power of two
    ],
)
def test_unit_sizes_follow_the_largest_power_of_two_within_both_limits(experts, options, size):
    layout = fsdp_layout("experts", (experts, 8, 16), 2)
    plan = build_plan([layout], [0], 1 << 30, 2, **options)
    sizes = [len(unit.members) for unit in plan.units]
    assert sizes == [size] * (experts // size) + ([experts % size] if experts % size else [])


def test_the_same_matrices_stack_into_the_same_units_at_every_world_size():
    """Newton–Schulz does not give a matrix the same bits in every batch size (on an H200 the dispatch picks the
    backend and the form by the call's batch, and a multi-threaded CPU's BLAS differs between a stack of 1 and of
    8: docs/kernels.md), so a matrix's result is the same at every world size only because its unit is: the same
    members in the same order, whatever the ranks and shards."""

    def units(world_size: int) -> list[list[tuple[int, str, tuple]]]:
        layouts = [fsdp_layout("experts", (128, 8, 16), world_size), fsdp_layout("w", (40, 24, 16), world_size)]
        plan = build_plan(layouts, [0, 1], 1 << 12, 2)
        return [
            [(r.spec.param_index, r.spec.key, r.spec.box) for r in map(plan.routes.__getitem__, u.members)]
            for u in plan.units
        ]

    alone = units(1)
    assert sorted(len(u) for u in alone) == [4] * 10 + [8] * 16  # 40 matrices in units of 4, 128 in units of 8
    for world_size in (2, 3, 8, 64):
        assert units(world_size) == alone, world_size


@pytest.mark.parametrize("option", ["max_batch", "units_per_parameter"])
def test_a_unit_size_limit_below_one_is_refused_by_name(option):
    with pytest.raises(ValueError, match=f"{option} must be an int >= 1, got 0"):
        build_plan([fsdp_layout("experts", (8, 8, 16), 2)], [0], 1 << 30, 2, **{option: 0})


def test_a_plan_balances_the_sum_with_the_loads_of_earlier_plans():
    """Two 64×64 matrices sharded over 2 ranks, each costing c: alone one goes to each rank; after an earlier
    plan that left rank 0 with 3c, both go to rank 1 (sums 3c and 2c), and rank_flops counts this plan's own."""
    world = 2
    layouts = [fsdp_layout(f"w{i}", (64, 64), world) for i in range(2)]
    c = ns_iteration_flops((64, 64))
    assert build_plan(layouts, [0, 1], 1 << 30, 2).rank_flops == [c, c]
    after = build_plan(layouts, [0, 1], 1 << 30, 2, base_load=[3 * c, 0])
    assert after.rank_flops == [0, 2 * c]
    with pytest.raises(ValueError, match="base_load: expected 2 entries"):
        build_plan(layouts, [0, 1], 1 << 30, 2, base_load=[0])
