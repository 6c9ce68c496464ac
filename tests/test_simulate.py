"""The plan simulator on torchtitan's llama3 debug model: its totals equal an independent FLOP count."""

import pytest

from dtensor_muon.simulate import format_table, main, model_matrix_shapes, simulate


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
