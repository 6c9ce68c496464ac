"""The SOAP benchmarks: bench/soap_step.py's rank sets are what the plan gives each rank (every matrix computed
once, each set's planned cost the sum of its matrices'), the plan's SOAP cost weighs each operation by its rate,
its quick run writes the expected rows (each optimizer's slowest rank); bench/convergence.py's table of several matrix optimizers against the best AdamW, and the SOAP flags."""

from __future__ import annotations

import pytest
import torch
from test_bench_product import bench_module, run_quick

from dtensor_muon.rules.soap import SOAPRule

RULE = SOAPRule()


def check_rank_sets(sets: list, shapes: dict[str, tuple[int, int]], names: list[list[str]], group: dict) -> None:
    """Every matrix is computed by exactly one rank (each set counted once per rank that has its shapes), and
    each set's planned cost is the sum of its matrices' planned costs (each its own unit: its batch cost
    included)."""
    count = sum(len(s.ranks) * len(n) for s, n in zip(sets, names))
    assert count == len(shapes)
    for s, n in zip(sets, names):
        assert n and set(n) <= set(shapes) and len(set(n)) == len(n)
        assert s.planned == sum(
            RULE.cost(group, shapes[m]).planned + RULE.cost(group, shapes[m]).batch_flops for m in n
        )


@pytest.mark.parametrize("variant", ["SOAP", "SOAP-cholqr", "REKLS"])
def test_rank_sets_of_llama3_8b_cover_every_matrix_once(variant):
    soap_step = bench_module("soap_step")
    matrices, _ = soap_step.llama3_matrices(16, quick=False)
    shapes = dict(matrices)
    assert len(matrices) == 112 and shapes["layers.15.feed_forward.w2.weight"] == (4096, 14336)
    cls = soap_step.VARIANTS[variant]
    group = soap_step.optimizer_group(cls, **soap_step.VARIANT_OPTIONS.get(variant, {}))
    assert group["kl"] == (variant == "REKLS") and group["max_preconditioner_dim"] == 8192
    assert group["basis"] == {"SOAP": "qr", "SOAP-cholqr": "cholqr", "REKLS": "eigh"}[variant]
    (full,) = soap_step.rank_sets(variant, cls, matrices, group, 1)
    assert full.indices == tuple(range(112)) and full.ranks == (0,)
    for world_size in (8, 64):
        sets = soap_step.rank_sets(variant, cls, matrices, group, world_size)
        check_rank_sets(sets, shapes, [[matrices[i][0] for i in s.indices] for s in sets], group)
        assert sets[0].planned == max(s.planned for s in sets) >= full.planned / world_size


def test_soap_plan_balances_time_not_nominal_flops():
    """SOAPRule.cost's planned cost (TF32-product FLOP equivalents): for a 4096² matrix with basis="cholqr"
    at torch's default precision, each operation's nominal FLOPs times 380 over its rate and the refresh
    batch's fixed 2.4 ms as 380 TFLOP/s, written out here from the formula. With TF32 products a 4096² matrix (two 4096 factors to refresh) and a 14336×4096 one
    (one) have about the same FLOPs (ratio 1.08) but the plan weighs the square one 1.49× as much: measured on
    an H200 its SOAP-cholqr step took 29.7–30.4 ms against 21.0–22.1 for the other (1.4×)."""
    soap_step = bench_module("soap_step")
    group = soap_step.optimizer_group(soap_step.VARIANTS["SOAP-cholqr"], basis="cholqr")
    k = 4096
    products = 2 * k**3 * 2 + 4 * k**3 * 2 + 4 * k**3  # factors, projections G' and O, rotation of M
    accurate, cholesky, solve, tf32 = 8 * k**3 * 2, k**3 / 3 * 2, k**3 * 2, 6 * k**3 * 2
    fixed = 2.4e-3 * 380e12  # one refresh batch (both sides have length 4096)
    want = products * 380 / 49 + accurate * 380 / 99 + cholesky * 380 / 12.7 + solve * 380 / 24 + tf32 + fixed
    square = RULE.cost(group, (k, k))
    assert square.planned + square.batch_flops == pytest.approx(want, rel=1e-9)
    assert square.batch_flops == pytest.approx(fixed, rel=1e-9)
    assert square.flops == pytest.approx(products + accurate + cholesky + solve + tf32, rel=1e-9)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        square, long = RULE.cost(group, (k, k)), RULE.cost(group, (14336, k))
    finally:
        torch.set_float32_matmul_precision(previous)
    assert square.flops / long.flops < 1.1
    assert (square.planned + square.batch_flops) / (long.planned + long.batch_flops) > 1.4


@pytest.mark.slow
def test_soap_step_quick_rows_and_sets(tmp_path):
    result = run_quick("soap_step.py", tmp_path, timeout=300)
    soap_step = bench_module("soap_step")
    shapes = {name: tuple(shape) for name, shape in result["shapes"].items()}
    assert len(shapes) == 14  # 2 layers × 7 matrices
    variants = result["args"]["variants"]
    assert variants == ["SOAP", "SOAP-cholqr", "REKLS"]
    rows = [r for r in result["rows"] if r["optimizer"] != soap_step.HEAVYBALL]
    assert {(r["world_size"], r["optimizer"]) for r in rows} == {
        (w, o) for w in (1, 8, 64) for o in ("SOAP", "SOAP-cholqr", "REKLS", "Muon")
    }
    # heavyball's SOAP (where importable) runs on the one-rank set only
    assert all(r["world_size"] == 1 for r in result["rows"] if r["optimizer"] == soap_step.HEAVYBALL)
    for row in rows:
        assert row["step_ms"] > 0 and 0 < row["min_ms"] <= row["step_ms"] and row["gflop"] > 0, row
        if row["optimizer"] != "Muon":
            assert all(row[f"{p}_ms"] > 0 for p in ("factors", "refresh", "adam", "phases")), row
            assert row["vs_muon"] > 0
    assert all(r["matrices"] == 14 for r in rows if r["world_size"] == 1)
    for row in rows:  # each row is its optimizer's slowest timed set at that world size
        key = (row["optimizer"], row["world_size"], row["plan"])
        timed = [s for s in result["sets"] if (s["optimizer"], s["world_size"], s["plan"]) == key]
        assert sum(len(s["ranks"]) * len(s["matrices"]) for s in timed) == 14
        assert row["step_ms"] == max(s["step_ms"] for s in timed)
        assert row["planned_gflop"] == pytest.approx(
            next(s for s in timed if s["step_ms"] == row["step_ms"])["planned"] / 1e9
        )


def test_convergence_table_gains_over_the_best_adamw_and_soap_flags():
    convergence = bench_module("convergence")
    lrs = {"Muon": 1e-2, "SOAP": 4e-3, "KLSOAP": 4e-3}
    finals = {("Muon", 0): 3.70, ("SOAP", 0): 3.80, ("KLSOAP", 0): 3.95, ("Muon", 1): 3.60, ("SOAP", 1): 3.66}
    finals |= {("KLSOAP", 1): 3.75}
    # lr 4e-3 is best on the mean over seeds (3.795 against 3.80), 2e-3 on seed 1
    adamw = {(2e-3, 0): 3.90, (4e-3, 0): 3.85, (2e-3, 1): 3.70, (4e-3, 1): 3.74}
    results = [{"optimizer": o, "lr": lrs[o], "seed": s, "final": v} for (o, s), v in finals.items()]
    results += [{"optimizer": "AdamW", "lr": lr, "seed": s, "final": v} for (lr, s), v in adamw.items()]
    summary = convergence.table(results, [0, 1], [2e-3, 4e-3], lrs)
    assert summary["adamw_best_lr"] == 4e-3
    first, second = summary["rows"]
    assert first["adamw_best_this_seed"] == 3.85 and second["adamw_best_this_seed"] == 3.70
    assert first["gain_vs_best_this_seed"] == pytest.approx({"Muon": 0.15, "SOAP": 0.05, "KLSOAP": -0.10})
    assert second["gain_vs_best_this_seed"] == pytest.approx({"Muon": 0.10, "SOAP": 0.04, "KLSOAP": -0.05})
    assert second["gain_vs_best_lr"] == pytest.approx({"Muon": 0.14, "SOAP": 0.08, "KLSOAP": -0.01})
    assert summary["mean"]["final"] == pytest.approx({"Muon": 3.65, "SOAP": 3.73, "KLSOAP": 3.85})
    assert summary["mean"]["gain_vs_best_this_seed"]["SOAP"] == pytest.approx(0.045)
    assert summary["passed"] == {"Muon": True, "SOAP": True, "KLSOAP": False}
    text = convergence.markdown(summary, [2e-3, 4e-3], lrs)
    assert "KL-SOAP gain (nats)" in text and "| mean |" in text and "KL-SOAP NOT met" in text
    no_adamw = convergence.table([r for r in results if r["optimizer"] != "AdamW"], [0, 1], [], lrs)
    assert no_adamw["passed"] == {} and "gain_vs_best_this_seed" not in no_adamw["rows"][0]
    assert "best AdamW" not in convergence.markdown(no_adamw, [], lrs)

    run = convergence.Run("KLSOAP", 4e-3, 1, update_rms=0.2)
    assert run.flags() == ["--optimizer.name", "KLSOAP", "--optimizer.lr", "0.004", "--klsoap.match_update_rms", "0.2"]
    assert convergence.Run("Muon", 1e-2, 0).flags() == ["--optimizer.name", "Muon", "--optimizer.lr", "0.01"]
