"""bench/momentum_dtype.py's pieces: the runs' flags, the table's rows and the bytes of state it reports."""

import pytest
from bench_modules import bench_module

from dtensor_muon.kernels.low_precision import INT8_BLOCK


def test_runs_select_the_momentum_dtype_and_rows_pair_seeds_with_float32():
    bench = bench_module("momentum_dtype")
    run = bench.MomentumRun("Muon", 1e-2, 1, momentum_dtype="int8")
    assert run.flags()[-2:] == ["--muon.momentum_dtype", "int8"] and run.name == "int8_seed1"
    results = [
        {"momentum_dtype": d, "seed": s, "final": f}
        for d, finals in (("float32", (3.0, 3.2)), ("int8", (3.1, 3.2)))
        for s, f in zip((0, 1), finals)
    ]
    nbytes = {d: {"matrix_bytes_per_param": 1.0, "bytes_per_param": 2.0} for d in ("float32", "int8")}
    rows = bench.summarize(results, ["float32", "int8"], nbytes)
    assert rows[1]["final_mean"] == pytest.approx(3.15) and rows[1]["final_spread"] == pytest.approx(0.1)
    assert rows[1]["vs_float32"] == pytest.approx(0.05) and rows[0]["vs_float32"] == 0


def test_state_bytes_of_the_tiny_llama():
    pytest.importorskip("torchtitan")
    bench = bench_module("momentum_dtype")
    model = bench.tiny_llama()
    got = {d: bench.state_bytes(model, d) for d in ("float32", "bfloat16", "int8")}
    assert got["float32"]["matrix_bytes_per_param"] == 4 and got["bfloat16"]["matrix_bytes_per_param"] == 2
    assert got["int8"]["matrix_bytes_per_param"] == 1 + 4 / INT8_BLOCK  # every row a multiple of 128 entries
    assert got["int8"]["bytes_per_param"] < got["bfloat16"]["bytes_per_param"] < got["float32"]["bytes_per_param"]


def test_tracking_bfloat16_keeps_every_scale_and_int8_loses_the_smallest():
    """bench/momentum_tracking.py on 384 entries over 3 decades, 20 steps. bfloat16 rounds each entry to within
    2⁻⁸ of itself (stochastically), a few thousandths of its σ; int8's step per block is its largest entry / 127,
    about 1/127 of the largest σ, which is a large share of a σ three decades below: the smallest third's error
    is tens of times bfloat16's, the largest third's within int8's half step."""
    bench = bench_module("momentum_tracking")
    rows = {(r["momentum_dtype"], r["scales"]): r for r in bench.track(384, 20, 3.0, 0)}
    assert len(rows) == 6
    assert all(rows["bfloat16", third]["median_error_over_sigma"] < 0.02 for third in ("smallest", "middle", "largest"))
    smallest = rows["int8", "smallest"]["median_error_over_sigma"]
    assert smallest > 10 * rows["bfloat16", "smallest"]["median_error_over_sigma"]
    assert rows["int8", "largest"]["median_error_over_sigma"] < smallest / 5
