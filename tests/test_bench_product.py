"""The product benchmarks run (``--quick``, as subprocesses) and their figures agree with independent references:
dtensor_muon.Muon's update equals torch.optim.Muon's, each exchange mode equals a single-process run, overlap
gives the losses of no overlap; the built-in model shapes are torchtitan's; Newton–Schulz FLOPs by hand."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_modules import BENCH, bench_module

ROOT = Path(__file__).resolve().parents[1]


def run_quick(script: str, tmp_path: Path, *flags: str, timeout: int = 240) -> dict:
    """Run ``bench/SCRIPT --quick --json FILE``; return the result file's contents."""
    out = tmp_path / f"{Path(script).stem}.json"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick", "--json", str(out), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["machine"]["torch"] and result["args"]["quick"] is True
    return result


def test_newton_schulz_flop_count_by_hand():
    optimizer_step = bench_module("optimizer_step")
    m, n = 4096, 14336
    assert optimizer_step.ns_flops((n, m)) == optimizer_step.ns_flops((m, n))
    assert optimizer_step.ns_flops((m, n)) == (5 * (3 * m * m * n + m**3), 5 * (4 * m * m * n + 2 * m**3))
    e, m, n = 64, 1408, 2048
    assert optimizer_step.ns_flops((e, n, m)) == (e * 5 * (3 * m * m * n + m**3), e * 5 * (4 * m * m * n + 2 * m**3))


@pytest.mark.parametrize("model", ["llama3_8b", "deepseek_v3_16b"])
def test_builtin_shapes_are_torchtitans(model):
    pytest.importorskip("torchtitan")
    optimizer_step = bench_module("optimizer_step")
    family, flavor = optimizer_step.MODELS[model]
    for f, quick in [(flavor, False), (optimizer_step.QUICK_FLAVOR, False), (optimizer_step.QUICK_FLAVOR, True)]:
        for layers in (None, 2):
            assert optimizer_step.builtin_shapes(family, f, layers, quick) == optimizer_step.torchtitan_shapes(
                family, f, layers, quick
            ), (f, quick, layers)
    if model == "llama3_8b":  # the figures the benchmark is quoted with
        shapes = dict(optimizer_step.builtin_shapes(family, flavor, 1))
        assert shapes["layers.0.feed_forward.w1.weight"] == (14336, 4096)
        assert shapes["layers.0.attention.wk.weight"] == (1024, 4096)
        assert shapes["output.weight"] == (128256, 4096)


@pytest.mark.parametrize("model", ["llama3_8b", "deepseek_v3_16b", "qwen3_30b_a3b"])
def test_qk_clip_row_takes_the_heads_the_torchtitan_plug_in_reads_from_the_model(model):
    """The benchmark's heads, from parameter names and its head counts, against torchtitan_ext.qk_clip's, read from
    the attention modules of the meta-built model (2 layers)."""
    pytest.importorskip("torchtitan")
    import copy

    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    from torchtitan_ext import qk_clip

    optimizer_step = bench_module("optimizer_step")
    family, flavor = optimizer_step.MODELS[model]
    shapes = optimizer_step.torchtitan_shapes(family, flavor, 2)
    spec = get_train_spec(family)
    args = copy.deepcopy(spec.model_args[flavor])
    args.n_layers = 2
    if family == "deepseek_v3":
        args.moe_impl = "standard"
    with torch.device("meta"):
        model_heads = {layer: heads for layer, (_, heads) in qk_clip.attention_heads(spec.model_cls(args)).items()}
    assert optimizer_step.qk_clip_heads(shapes, family, flavor, False) == model_heads
    assert len(model_heads) == 2


@pytest.mark.slow
def test_optimizer_step_quick_matches_torch_optim_muon(tmp_path):
    pytest.importorskip("torchtitan")
    result = run_quick("optimizer_step.py", tmp_path, "--model", "deepseek_v3_16b", "--steps", "2", "--warmup", "1")
    assert [r["key"] for r in result["rows"]] == ["dtensor_muon", "torch_muon_adamw", "adamw"]
    assert all(r["step_ms"] > 0 and r["min_ms"] <= r["step_ms"] for r in result["rows"])
    assert result["shapes_from"] == "torchtitan meta model"
    # On CPU with the same arguments the two Muons (and the two AdamWs) give the same bits, experts included.
    for kind in ("matrices", "experts", "adamw"):
        assert result[f"max_rel_update_diff_{kind}"] == 0.0, kind
    assert result["matmul_ceiling"] is None and result["ns_floor_ms"] is None  # CPU: no ceiling measured


@pytest.mark.slow
def test_optimizer_step_without_references_times_dtensor_muon_alone(tmp_path):
    """--skip-references: the dtensor_muon row only, its update against no reference, no ratio to AdamW."""
    pytest.importorskip("torchtitan")
    result = run_quick(
        "optimizer_step.py", tmp_path, "--skip-references", "--units-per-stack", "2", "--steps", "1", "--warmup", "0"
    )
    assert [r["key"] for r in result["rows"]] == ["dtensor_muon", "dtensor_muon_stacks_2"]
    assert all(r["step_ms"] > 0 and r["vs_adamw"] is None for r in result["rows"])
    assert not [k for k in result if k.startswith("max_rel_update_diff_") or k == "checked_parameters"]
    assert result["benchmark"] == "optimizer_step_stacks_llama3_8b_muon_only"


@pytest.mark.slow
def test_exchange_quick_modes_equal_single_process(tmp_path):
    result = run_quick("bench_exchange.py", tmp_path)
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"owner", "gather_all"}
    for row in rows.values():
        assert row["max_rel_update_diff_vs_single"] == 0.0
        assert row["step_ms_median"] > 0
    assert rows["gather_all"]["bytes_sent_rank0"] > rows["owner"]["bytes_sent_rank0"]


@pytest.mark.slow
def test_overlap_quick_gives_the_same_losses(tmp_path):
    result = run_quick("bench_overlap.py", tmp_path)
    rows = {r["mode"]: r for r in result["rows"]}
    off, on = rows["no_overlap"]["losses"], rows["overlap"]["losses"]
    args = result["args"]
    assert len(off) == args["warmup"] + args["steps"] >= 3
    assert on == off and result["losses_equal"] is True


def test_engine_host_times_every_phase_of_a_multi_rank_step_on_every_parameter(tmp_path):
    """bench/engine_host.py steps the model's every parameter (the count optimizer_step.py's shapes give) on 2 gloo
    ranks, and each phase of the slowest rank fits in that step: per step a phase's maximum over ranks is at most
    the step's, so the medians keep that order."""
    engine_host = bench_module("engine_host")
    optimizer_step = bench_module("optimizer_step")
    result = run_quick("engine_host.py", tmp_path)
    (row,) = result["rows"]
    family, _ = optimizer_step.MODELS["qwen3_30b_a3b"]
    shapes, _ = optimizer_step.parameter_shapes(family, optimizer_step.QUICK_FLAVORS["qwen3_30b_a3b"], 2, True, None)
    assert row["parameters"] == len(shapes) and row["world_size"] == 2
    assert row["step_ms"] > 0 and row["local_compute_ms"] + row["owner_compute_ms"] > 0
    for phase in engine_host.PHASES:
        assert 0 <= row[f"{phase}_ms"] <= row["step_ms"], phase
