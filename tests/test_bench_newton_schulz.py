"""bench/bench_newton_schulz.py --quick runs (on CPU) and its JSON rows say what the table says: every method
agrees with plain torch within the bf16 tolerance the script states, torch.optim.Muon and ours (on the plain-torch
backend here) match plain torch bit for bit on 2-D inputs, and the singular values land where Keller's quintic
puts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"ours", "ours, eager", "torch", "torch.optim.Muon"}
QUICK_SHAPES = {"48x96", "96x48", "3x40x64"}


def test_quick_run_writes_rows_that_agree_with_torch(tmp_path: Path) -> None:
    out = tmp_path / "newton_schulz.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "bench_newton_schulz.py"),
            "--quick",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| shape | method | ms |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "newton_schulz"
    tolerance = result["bf16_tolerance"]
    assert 0 < tolerance < 0.1
    rows = result["rows"]
    assert {r["shape"] for r in rows} == QUICK_SHAPES
    for shape in QUICK_SHAPES:
        assert {r["method"] for r in rows if r["shape"] == shape} >= METHODS
    for row in rows:
        where = f"{row['shape']} {row['method']}"
        assert row["rel_diff_vs_torch"] <= tolerance, where
        assert row["within_bf16_tolerance"], where
        assert 0.6 < row["sigma_min"] <= row["sigma_max"] < 1.25, where
        assert row["ms"] > 0 and row["ms_min"] <= row["ms"] <= row["ms_max"], where
        assert row["host_ms"] > 0 and row["pct_of_matmul"] > 0, where
        if row["method"] in METHODS and row["shape"] != "3x40x64":
            assert row["rel_diff_vs_torch"] == 0.0, where  # CPU: the plain-torch backend, torch.optim.Muon's bits
        if row["method"].startswith("ours"):
            assert row["same_bits_as_eager"], where
            assert row["ours_route"] == "torch matmuls, standard", where
    assert set(result["ceiling_tflops_rounds"]) == QUICK_SHAPES
