"""bench/plot_optimizer_step.py: the SVG of a small run parses, has one bar per optimizer row with widths in the
ratio of the step times, and the Newton–Schulz floor line at the floor's position on the same axis."""

import json
import xml.etree.ElementTree as ET

import pytest
from bench_modules import bench_module

SVG = "{http://www.w3.org/2000/svg}"


RUN = {
    "benchmark": "optimizer_step_llama3_8b",
    "machine": {
        "date": "2026-12-03 12:04 UTC",
        "torch": "2.11.0+cu130",
        "triton": "3.6.0",
        "commit": "abc1234",
        "device": "NVIDIA H200",
    },
    "args": {"model": "llama3_8b", "layers": 2, "steps": 6, "world_size": []},
    "rows": [
        {"optimizer": "dtensor_muon.Muon", "key": "dtensor_muon", "step_ms": 120.0, "vs_ns_floor": 0.8},
        {
            "optimizer": "torch.optim.Muon + AdamW (fused)",
            "key": "torch_muon_adamw",
            "step_ms": 480.0,
            "vs_ns_floor": 3.2,
        },
        {"optimizer": "AdamW (fused) on everything", "key": "adamw", "step_ms": 30.0},
    ],
    "model": "llama3:8B",
    "layers": 2,
    "experts": None,
    "ns_floor_ms": {"syrk_ms": 150.0, "plain_ms": 210.0},
    "per_rank": [],
}


def test_svg_bars_and_floor(tmp_path):
    path = tmp_path / "optimizer_step_llama3_8b.json"
    path.write_text(json.dumps(RUN))
    out = bench_module("plot_optimizer_step").plot(path)
    assert out == tmp_path / "optimizer_step_llama3_8b.svg"
    root = ET.parse(out).getroot()
    assert root.tag == f"{SVG}svg"

    bars = [r for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"]
    assert len(bars) == len(RUN["rows"])
    steps = [row["step_ms"] for row in RUN["rows"]]
    widths = [float(bar.get("width")) for bar in bars]
    origin = float(bars[0].get("x"))
    assert all(float(bar.get("x")) == origin for bar in bars)
    for width, ms in zip(widths, steps):
        assert width / widths[0] == pytest.approx(ms / steps[0], rel=1e-6)
    px_per_ms = widths[0] / steps[0]

    (floor,) = [line for line in root.iter(f"{SVG}line") if line.get("class") == "floor"]
    assert float(floor.get("x1")) == float(floor.get("x2"))
    assert float(floor.get("x1")) == pytest.approx(origin + 150.0 * px_per_ms, abs=1e-3)
    text = " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))
    assert "Newton–Schulz floor 150.0 ms" in text
    assert "Llama3-8B" in text and "abc1234" in text
    for label in ("dtensor_muon.Muon", "torch.optim.Muon + AdamW", "AdamW"):
        assert label in text


def test_runs_without_whole_step_rows_are_skipped(tmp_path):
    path = tmp_path / "optimizer_step_qwen3_30b_a3b_shares.json"
    path.write_text(json.dumps({**RUN, "rows": []}))
    assert bench_module("plot_optimizer_step").plot(path) is None
    assert not path.with_suffix(".svg").exists()
