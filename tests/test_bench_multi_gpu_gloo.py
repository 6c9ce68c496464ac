"""bench/nccl_correctness.py and bench/multi_gpu.py run N processes over gloo: on CPU, and sharing one GPU.

On CPU (``--device cpu --backend gloo --nproc 2``) the correctness check's three modes equal the single-process
result within the stated bound (1e-2 relative on the update; 0 observed), and multi_gpu.py's tiny Llama3 run
trains and reports tokens/s, step time and the optimizer's phases next to the correctness check. With a CUDA
GPU, two processes share ``cuda:0`` over gloo (``--backend gloo --nproc 2``, the one-GPU rehearsal of the
several-GPU run). Every result goes to a file under the test's temporary folder, never bench/results.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
TOLERANCE = 1e-2  # bench/nccl_correctness.py's bound on the relative update difference
MODES = ["owner", "gather_all", "overlap"]
SHARED_GPU_MODES = ["owner", "overlap"]  # gather_all's full_tensor() crashes over gloo on CUDA (torch 2.11)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_script(script: str, *flags: str, cpu: bool, timeout: int) -> subprocess.CompletedProcess:
    """``python bench/SCRIPT FLAGS`` from the repository root (no GPU visible when ``cpu``)."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, str(BENCH / script), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_ran(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def assert_correct(rows: list[dict], world: int, modes: list[str] = MODES) -> None:
    """One row per mode at ``world`` ranks, each a finite relative difference within the bound."""
    assert [r["mode"] for r in rows] == modes
    for row in rows:
        diff = row["max_rel_update_diff"]
        assert row["world_size"] == world
        assert isinstance(diff, float) and math.isfinite(diff) and 0.0 <= diff <= TOLERANCE, row
        assert row["ok"] is True


def assert_trained(row: dict, ranks: int, gpus: int) -> None:
    """A torchtitan run that finished and measured its steps."""
    assert row["returncode"] == 0, row.get("log_tail", row)
    assert (row["ranks"], row["gpus"], row["backend"]) == (ranks, gpus, "gloo")
    assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0
    assert math.isfinite(row["step_s"]) and row["step_s"] > 0
    if row["variant"].startswith("Muon"):
        assert row["phases_ms"]["time_step_ms"] > 0
        if row["mfu_model_pct"] is not None:
            assert row["mfu_with_ns_pct"] > row["mfu_model_pct"]


@pytest.mark.parametrize("script", ["nccl_correctness.py", "multi_gpu.py"])
def test_nccl_backend_needs_cuda(script: str) -> None:
    """NCCL on CPU is refused at the argument stage, before any process starts."""
    proc = run_script(script, "--device", "cpu", "--backend", "nccl", "--json", "", cpu=True, timeout=120)
    assert proc.returncode == 2
    assert "--backend nccl needs --device cuda" in proc.stderr


@pytest.mark.slow
def test_nccl_correctness_two_gloo_processes_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "nccl_correctness.json"
    flags = ["--quick", "--device", "cpu", "--backend", "gloo", "--nproc", "2", "--json", str(out)]
    proc = run_script("nccl_correctness.py", *flags, cpu=True, timeout=300)
    assert_ran(proc)
    assert "| mode | ranks | max rel diff | ok |" in proc.stdout
    result = json.loads(out.read_text())
    assert (result["benchmark"], result["device"], result["backend"]) == ("nccl_correctness", "cpu", "gloo")
    assert result["tolerance"] == TOLERANCE
    assert_correct(result["rows"], world=2)


@pytest.mark.slow
@pytest.mark.e2e
def test_multi_gpu_two_gloo_processes_on_cpu(tmp_path: Path) -> None:
    """The correctness check at 2 ranks, then tiny Llama3 with Muon over FSDP on 2 CPU processes."""
    out = tmp_path / "multi_gpu.json"
    flags = ["--quick", "--device", "cpu", "--backend", "gloo", "--nproc", "2", "--variants", "Muon"]
    flags += ["--steps", "3", "--skip", "deepseek", "--json", str(out), "--out", str(tmp_path / "runs")]
    proc = run_script("multi_gpu.py", *flags, cpu=True, timeout=600)
    assert_ran(proc)
    result = json.loads(out.read_text())
    assert (result["args"]["device"], result["args"]["backend"], result["args"]["gpus"]) == ("cpu", "gloo", 2)
    [check] = result["nccl"]
    assert (check["world_size"], check["backend"], check["returncode"]) == (2, "gloo", 0)
    assert_correct(check["rows"], world=2)
    [row] = result["rows"]
    assert (row["config"], row["variant"]) == ("llama3_tiny", "Muon")
    assert_trained(row, ranks=2, gpus=0)
    assert (tmp_path / "runs" / "llama3_tiny_Muon.log").exists()


@requires_cuda
@pytest.mark.slow
def test_nccl_correctness_two_processes_share_one_gpu(tmp_path: Path) -> None:
    """Full shapes, bf16 Newton–Schulz on cuda:0 for both ranks, over gloo."""
    out = tmp_path / "nccl_correctness.json"
    flags = ["--device", "cuda", "--backend", "gloo", "--nproc", "2", "--json", str(out)]
    proc = run_script("nccl_correctness.py", *flags, cpu=False, timeout=600)
    assert_ran(proc)
    result = json.loads(out.read_text())
    assert (result["device"], result["backend"]) == ("cuda", "gloo")
    assert_correct(result["rows"], world=2, modes=SHARED_GPU_MODES)


@requires_cuda
@pytest.mark.slow
@pytest.mark.e2e
def test_multi_gpu_two_processes_share_one_gpu(tmp_path: Path) -> None:
    """The one-GPU rehearsal: correctness check, tiny Llama3 (FSDP) and tiny MoE (FSDP + expert parallelism)."""
    out = tmp_path / "multi_gpu.json"
    flags = ["--quick", "--device", "cuda", "--backend", "gloo", "--nproc", "2", "--variants", "Muon"]
    flags += ["--steps", "4", "--json", str(out), "--out", str(tmp_path / "runs")]
    proc = run_script("multi_gpu.py", *flags, cpu=False, timeout=600)
    assert_ran(proc)
    result = json.loads(out.read_text())
    [check] = result["nccl"]
    assert (check["world_size"], check["backend"], check["returncode"]) == (2, "gloo", 0)
    assert_correct(check["rows"], world=2, modes=SHARED_GPU_MODES)
    assert [(r["config"], r["variant"]) for r in result["rows"]] == [("llama3_tiny", "Muon"), ("moe_tiny", "Muon")]
    for row in result["rows"]:
        assert_trained(row, ranks=2, gpus=1)
