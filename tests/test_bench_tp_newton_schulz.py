"""bench/bench_tp_newton_schulz.py --quick runs on CPU and its rows say what the table says: the duplicated row, then
per split the distributed one with rank 0's block, steps + 1 all-reduces of steps·m²·2 + 4 bytes (bf16 Grams and
the float32 norm), the multiply-add counts by hand, and the emulated distributed result within the bf16
tolerance of the duplicated one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_rows(tmp_path: Path) -> None:
    out = tmp_path / "tp_newton_schulz.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_tp_newton_schulz.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| ranks | mode | block | ms per rank |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "tp_newton_schulz" and result["args"]["quick"] is True
    (m, n), steps = result["shape"], result["steps"]
    assert (m, n, steps) == (64, 256, 5)
    rows = result["rows"]
    assert [(r["ranks"], r["mode"], r["block_cols"]) for r in rows] == [
        (1, "duplicated", 256),
        (2, "distributed", 128),
        (4, "distributed", 64),
    ]
    for row in rows:
        assert len(row["ms_repeats"]) >= 10 and row["ms_min"] <= row["ms"] <= row["ms_max"]
        assert row["speedup_vs_duplicated"] > 0
        assert row["macs_per_rank"] == steps * (2 * m * m * row["block_cols"] + m**3)
        if row["mode"] == "duplicated":
            assert row["speedup_vs_duplicated"] == 1.0
            assert (row["allreduce_bytes_per_step"], row["collectives_per_step"]) == (0, 0)
        else:
            assert row["allreduce_bytes_per_step"] == steps * m * m * 2 + 4
            assert row["collectives_per_step"] == steps + 1
            assert row["within_bf16_tolerance"] and row["rel_diff_vs_duplicated"] <= result["bf16_tolerance"]
