"""The plan simulator on torchtitan's llama3 debug model: its totals equal an independent FLOP count."""

import pytest

from dtensor_muon.plan.simulate import format_table, main, model_matrix_shapes, simulate


def test_debugmodel_totals_match_independent_count():
    shapes = model_matrix_shapes("llama3:debugmodel")
    assert shapes and all(len(s) == 2 for _, s in shapes)
    assert not any("tok_embeddings" in n or n.startswith("output") for n, _ in shapes)
    total = sum(5 * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for _, s in shapes) / 1e9
    for row in simulate("llama3:debugmodel", [1, 3, 8]):
        assert row.ns_gflop_mean * row.world_size == pytest.approx(total)
        assert row.imbalance >= 1.0 and row.ns_gflop_max == pytest.approx(row.imbalance * row.ns_gflop_mean)
        if row.world_size == 1:
            assert row.bytes_sent_max == 0 and row.local_matrices == row.matrices
    assert "llama3:debugmodel" in format_table(simulate("llama3:debugmodel", [2]))


def test_cli_prints_table_and_rejects_bad_input(capsys, tmp_path):
    main(["--model", "llama3:debugmodel", "--world-size", "2", "4", "--json", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert "imbal" in out and (tmp_path / "p.json").exists()
    with pytest.raises(ValueError, match="flavor"):
        main(["--model", "llama3:nope", "--world-size", "2"])
    with pytest.raises(SystemExit):
        main(["--model", "llama3:debugmodel", "--world-size", "0"])


def test_tensor_and_expert_parallel_layouts_follow_torchtitan():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from dtensor_muon.plan.simulate import dense_placements, expert_placements, mesh_layout

    assert dense_placements("layers.0.attention.wq.weight", (8, 4), 2) == (_StridedShard(0, split_factor=2), Shard(0))
    assert dense_placements("layers.0.feed_forward.w2.weight", (4, 8), 2) == (Shard(0), Shard(1))
    assert dense_placements("layers.0.attention.wkv_a.weight", (6, 4), 2) == (Shard(0), Replicate())
    assert dense_placements("layers.1.moe.experts.w1", (8, 6, 4), 2) == (Shard(0), Shard(1))
    assert dense_placements("layers.1.moe.experts.w2", (8, 4, 6), 2) == (Shard(0), Shard(2))
    assert expert_placements((8, 4, 4), 4, 2) == (_StridedShard(0, split_factor=2), Shard(0))
    assert expert_placements((8, 4, 4), 16, 2) == (Shard(1), Shard(0))
    # FSDP 2 over TP 2 of a column-parallel 10-row weight: mesh rank (d, t) holds chunk d of TP chunk t
    boxes = mesh_layout("w", (10, 4), (2, 2), dense_placements("x.wq.weight", (10, 4), 2)).boxes
    assert [b[0] for b in boxes] == [(0, 3), (5, 8), (3, 5), (8, 10)]


@pytest.mark.parametrize(
    "model, tp, ep", [("llama3:debugmodel", 2, 1), ("deepseek_v3:debugmodel", 2, 2), ("qwen3:debugmodel_moe", 2, 2)]
)
def test_tensor_and_expert_parallel_plans_keep_the_total_work(model, tp, ep):
    """Owned mode computes every matrix once whatever the layout: the same total as FSDP alone."""
    (plain,) = simulate(model, [8])
    (parallel,) = simulate(model, [8], tp=tp, ep=ep)
    assert (parallel.tp, parallel.ep) == (tp, ep)
    assert parallel.matrices == plain.matrices
    assert parallel.ns_gflop_mean == pytest.approx(plain.ns_gflop_mean)
    assert parallel.max_over_bound >= 1.0 - 1e-9
    with pytest.raises(ValueError, match="multiple of --tp"):
        simulate(model, [6], tp=4)


def test_tp_modes_in_the_simulator():
    """Duplicated computes each TP matrix on every member of one TP group (twice the work at TP 2);
    distributed splits it, so the busiest rank does no more than with one owner per matrix."""
    (owned,) = simulate("llama3:debugmodel", [8], tp=2)
    (duplicated,) = simulate("llama3:debugmodel", [8], tp=2, tp_mode="duplicated")
    (distributed,) = simulate("llama3:debugmodel", [8], tp=2, tp_mode="distributed")
    assert duplicated.duplicated_matrices == duplicated.matrices and duplicated.distributed_matrices == 0
    assert duplicated.ns_gflop_mean == pytest.approx(2 * owned.ns_gflop_mean)
    assert distributed.distributed_matrices > 0
    assert distributed.distributed_matrices + distributed.duplicated_matrices == distributed.matrices
    assert distributed.ns_gflop_max <= owned.ns_gflop_max * 1.01
    assert "distributed" in format_table([distributed])


def test_all_to_alls_are_one_out_and_one_back_per_bucket():
    """The debug model's matrices (bf16 on the wire) over 4 ranks, each split over the ranks, so all of them travel:
    one all-to-all out and one back per bucket; a bucket per matrix (each its own unit) when a bucket holds at most
    one, a single bucket when it holds them all."""
    shapes = model_matrix_shapes("llama3:debugmodel")
    travelling = sum(s[0] * s[1] * 2 for _, s in shapes)  # at 4 ranks every debug-model matrix is split: all travel
    (tiny,) = simulate("llama3:debugmodel", [4], bucket_mb=1e-6)
    (whole,) = simulate("llama3:debugmodel", [4], bucket_mb=travelling / 2**20)
    assert tiny.local_matrices == 0
    assert tiny.exchanges == 2 * tiny.matrices  # a bucket per unit of one matrix
    assert whole.exchanges == 2
