"""torchtitan_ext's log: metrics reduced over ranks (real gloo), the optimizer and FLOPs lines, the TOML key
error, the summary's dump folder and plot, and the Makefile's install messages."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")
from torchtitan_ext.version import LINE, VERSION

if LINE != "0.2":
    pytest.skip(f"torchtitan 0.2.x tests; the installed torchtitan is {VERSION}", allow_module_level=True)

from dist_harness import run_distributed
from torchtitan.config import ConfigManager

from torchtitan_ext import job_config, metrics, optimizer, summary

ROOT = Path(__file__).resolve().parents[1]


def test_reductions_per_key():
    ranks = [
        {"muon/update_rms/muon": 3.0, "muon/time_step_ms": 5.0, "muon/bytes_sent": 10.0, "muon/optimizer_flops": 1e9,
         "muon/sigma_min": 0.7, "muon/sigma_max": 1.1, "muon/skipped_steps": 1.0, "muon/unknown": 2.0},
        {"muon/update_rms/muon": 4.0, "muon/time_step_ms": 7.0, "muon/bytes_sent": 4.0, "muon/optimizer_flops": 2e9,
         "muon/sigma_min": 0.6, "muon/sigma_max": 1.2, "muon/skipped_steps": 1.0, "muon/nonfinite_updates": 2.0},
        {"muon/time_step_ms": 6.0, "muon/unknown": 5.0},  # owns no matrix: no update RMS
    ]  # fmt: skip
    got = metrics.combine(ranks)
    assert got["muon/update_rms/muon"] == pytest.approx((12.5) ** 0.5)  # over the two ranks that report it
    assert got["muon/time_step_ms"] == 7.0 and got["muon/bytes_sent"] == 10.0
    assert got["muon/optimizer_flops"] == 3e9 and got["muon/nonfinite_updates"] == 2.0
    assert got["muon/sigma_min"] == 0.6 and got["muon/sigma_max"] == 1.2
    assert got["muon/skipped_steps"] == 1.0 and got["muon/unknown"] == 5.0
    parts = metrics.combine(ranks[:2], over="parts")
    assert parts["muon/time_step_ms"] == 12.0 and parts["muon/bytes_sent"] == 14.0


def _gather(rank, world_size):
    local = {"muon/time_step_ms": float(rank + 1), "muon/optimizer_flops": 1e9}
    if rank != 1:
        local["muon/update_rms/muon"] = 2.0
    losses = (-1.0, -1.0) if rank < world_size - 1 else (4.5, 4.75)  # only the last stage computes a loss
    with_losses = metrics.gather_and_reduce(local, losses)
    without = metrics.gather_and_reduce(local, None)
    return with_losses, without


@pytest.mark.slow
def test_gather_and_reduce_gives_every_rank_the_global_values():
    results = run_distributed(_gather, 3)
    want = {"muon/time_step_ms": 3.0, "muon/optimizer_flops": 3e9, "muon/update_rms/muon": 2.0}
    for (reduced, losses), (reduced_again, no_losses) in results:
        assert reduced == want and losses == (4.5, 4.75)
        assert reduced_again == want and no_losses is None


def test_flops_metrics_scale_torchtitans_figures_by_the_optimizer_share():
    record = {"tflops": 100.0, "mfu(%)": 10.0, "muon/optimizer_flops": 3e12}
    got = metrics.flops_metrics(record, model_flops_per_step=100e12, world_size=2, peak_known=True)
    assert got["muon/optimizer_tflops_per_step"] == pytest.approx(1.5)
    assert got["muon/optimizer_flops_share(%)"] == pytest.approx(3.0)
    assert got["tflops_with_optimizer"] == pytest.approx(103.0)
    assert got["mfu_with_optimizer(%)"] == pytest.approx(10.3)
    on_cpu = metrics.flops_metrics(record, 100e12, 2, peak_known=False)
    assert "mfu_with_optimizer(%)" not in on_cpu and on_cpu["tflops_with_optimizer"] == pytest.approx(103.0)
    assert metrics.flops_metrics({"tflops": 1.0, "mfu(%)": 1.0}, 1e12, 2, True) == {}
    assert metrics.flops_line({**record, **got}) == (
        "flops: model 100 TFLOP/s, optimizer 1.5 TFLOP/step (+3.00% of the model's), both 103 TFLOP/s per device"
        "  mfu: 10.00% model only, 10.30% with optimizer"
    )
    assert metrics.flops_line({**record, **on_cpu}).endswith("mfu: not computed on CPU")


def test_optimizer_line_shows_sampled_and_nonzero_values_only():
    base = {"muon/update_rms/muon": 1e-3, "muon/update_rms/adamw": 2e-4, "muon/skipped_steps": 0.0,
            "muon/time_step_ms": 12.34, "muon/bytes_sent": 3.5 * 2**20, "muon/nonfinite_updates": 0.0}  # fmt: skip
    line = metrics.optimizer_line(base)
    assert line == "optimizer: update_rms muon 1.00e-03 adamw 2.00e-04  skipped 0  time 12.3ms  exchange 3.50MiB"
    sampled = {**base, "muon/sigma_min": 0.68, "muon/sigma_max": 1.15, "muon/orthogonality_error": 0.32,
               "muon/nonfinite_updates": 3.0}  # fmt: skip
    assert metrics.optimizer_line(sampled).endswith("σ [0.680, 1.150]  orth_err 0.320  nonfinite 3")
    assert metrics.optimizer_line({"loss": 1.0}) is None
    soap = {"muon/update_rms/adamw": 2e-4, "muon/update_rms/soap": 3e-3, "muon/update_rms_max/soap": 9e-3}
    assert metrics.optimizer_line(soap) == "optimizer: update_rms soap 3.00e-03 (max 9.00e-03) adamw 2.00e-04"
    assert metrics.reduction_of("muon/update_rms_max/soap") == "max"
    assert metrics.combine([{"muon/update_rms_max/soap": 1.0}, {"muon/update_rms_max/soap": 4.0}]) == {
        "muon/update_rms_max/soap": 4.0
    }


def test_container_metrics_combine_the_parts_of_a_rank():
    from torchtitan.config import Optimizer as OptimizerConfig

    torch.manual_seed(0)
    parts = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)) for _ in range(2)]
    container = optimizer.build_optimizers(parts, OptimizerConfig(name="Muon", lr=0.01), parallel_dims=None)
    for part in parts:
        part(torch.randn(3, 8)).sum().backward()
    container.step()
    each = [opt.metrics for opt in container.optimizers]
    merged = container.metrics
    assert merged["muon/time_step_ms"] == pytest.approx(sum(m["muon/time_step_ms"] for m in each))
    rms = [m["muon/update_rms/muon"] for m in each]
    assert merged["muon/update_rms/muon"] == pytest.approx((sum(r * r for r in rms) / 2) ** 0.5)


def test_unknown_toml_key_names_its_section_and_the_close_match(tmp_path):
    job_config.use_in_config_manager()
    toml = tmp_path / "x.toml"
    toml.write_text("[muon]\nns_step = 3\n")
    with pytest.raises(ValueError) as info:
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    message = str(info.value)
    assert message.startswith("[muon] has no key 'ns_step' (did you mean 'ns_steps'?); its keys: momentum, ")
    assert "python -m torchtitan_ext.train --help" in message and "run_train.sh" not in message
    toml.write_text("[moun]\nns_steps = 3\n")
    with pytest.raises(ValueError, match=r"no section \[moun\] \(did you mean \[muon\]\?\)"):
        ConfigManager().parse_args(["--job.config_file", str(toml)])
    # and the [muon] section is there without custom_config_module
    assert ConfigManager().parse_args(["--muon.ns_steps", "3"]).muon.ns_steps == 3


def _write_run(folder: Path, losses: dict[int, float]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(folder))
    for step, loss in losses.items():
        writer.add_scalar("loss_metrics/global_avg_loss", loss, step)
        writer.add_scalar("muon/update_rms/muon", 1e-3 * step, step)
        writer.add_scalar("grad_norm", 1.0 / step, step)
    writer.add_scalar("muon/orthogonality_error", 0.3, 2)
    writer.close()


def test_summary_finds_the_dump_folder_of_the_job_and_the_newest_run_of_a_minute(tmp_path, capsys):
    dump = tmp_path / "elsewhere"
    run = dump / "tensorboard" / "20261201-2100"
    _write_run(run, {1: 9.0, 2: 8.0})
    (first,) = run.glob("events.out.tfevents.*")
    os.utime(first, (first.stat().st_mtime - 60, first.stat().st_mtime - 60))  # written a minute earlier
    _write_run(run, {1: 7.0, 2: 6.0, 3: 5.0})  # a second run within the same minute
    args = ["--job.config_file", "train_configs/llama3_tiny.toml", "--job.dump_folder", str(dump),
            "--metrics.save_tb_folder", "tensorboard", "--training.steps", "3"]  # fmt: skip
    assert summary.dump_of_job(args) == (dump, "tensorboard")
    summary.main(args)
    out = capsys.readouterr().out
    assert out.startswith("summary: steps 3, loss 7.000 (step 1) -> 5.000") and str(run) in out


def test_summary_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _write_run(tmp_path / "tb" / "20261201-2100", {1: 9.0, 2: 8.0, 3: 7.5})
    summary.main([str(tmp_path), "--plot"])
    png = tmp_path / summary.PLOT_NAME
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot: {png}" in capsys.readouterr().out
    summary.main([str(tmp_path), "--plot", str(tmp_path / "other.png")])
    assert (tmp_path / "other.png").is_file()


def test_summary_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch):
    _write_run(tmp_path / "tb" / "20261201-2100", {1: 9.0})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(SystemExit) as info:
        summary.main([str(tmp_path), "--plot"])
    assert "pip install -e .[plot]" in str(info.value)


def test_make_install_says_what_it_does(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "python $*" >> {tmp_path}/calls\n[ "$1" = "-c" ] && exit 1\nexit 0\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    cmd = ["make", "-B", "install", f"PY={fake}", f"STAMP={tmp_path}/stamp"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the given python exists: no .venv is created, whether or not this checkout has one
    said = [line for line in proc.stdout.splitlines() if line.startswith("install: ")]
    assert [s.split()[1] for s in said] == ["torch", "dtensor_muon", "done"], proc.stdout
    assert "torch==2.13.0" in (tmp_path / "calls").read_text() and (tmp_path / "stamp").is_file()
