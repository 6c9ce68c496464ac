"""Which run the summary reads and how its plot is titled: a dump folder with several runs (make train's and
a later one), a run folder given as the argument, the description the launcher records in the run's events."""

import pytest
from torch.utils.tensorboard import SummaryWriter

from torchtitan_ext import summary

JOB = "llama3 debugmodel + NorMuon (lr 0.01), 300 steps, dump folder outputs/llama3_tiny"


def write_run(folder, losses: dict[int, float], job: str | None = None, rule: str = "normuon") -> None:
    writer = SummaryWriter(str(folder))
    if job is not None:
        writer.add_text("job", job)
    for step, loss in losses.items():
        writer.add_scalar("loss_metrics/global_avg_loss", loss, step)
        writer.add_scalar(f"muon/update_rms/{rule}", 1e-3, step)
    writer.close()


def test_a_run_folder_picks_that_run_and_the_plot_title_names_it(tmp_path, capsys):
    old, new = tmp_path / "tb" / "20261203-0100", tmp_path / "tb" / "20261203-0130"
    write_run(old, {1: 8.0, 300: 4.3}, JOB)
    write_run(new, {1: 8.0, 20: 6.1}, "llama3 debugmodel + Muon (lr 0.01), 20 steps, dump folder outputs/llama3_tiny")
    summary.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "steps 20," in out and "note: 2 runs under" in out and str(new) in out
    summary.main([str(old)])
    out = capsys.readouterr().out
    assert out.startswith("summary: steps 300,") and f"run: {old} ({JOB})" in out and "note:" not in out
    events = summary.resolve_events(old)
    assert summary.title_of(summary.scalars(events), events, summary.job_text(events)) == (
        "llama3 debugmodel + NorMuon (lr 0.01), 300 steps; 300 steps logged; run 20261203-0100"
    )


def test_a_run_without_a_description_is_titled_by_its_metrics(tmp_path):
    write_run(tmp_path / "tb" / "20261203-0100", {1: 8.0, 5: 7.0}, rule="soap")
    events = summary.resolve_events(tmp_path)
    assert summary.job_text(events) is None
    assert summary.title_of(summary.scalars(events), events, None) == "soap rule; 5 steps logged; run 20261203-0100"


def test_a_path_without_runs_ends_in_one_line(tmp_path):
    (tmp_path / "tb").mkdir()
    for path in (tmp_path, tmp_path / "missing"):
        with pytest.raises(SystemExit) as info:
            summary.main([str(path)])
        assert str(info.value).startswith("summary: ")


def test_the_launchers_metrics_processor_records_the_job_in_tensorboard(tmp_path):
    pytest.importorskip("torchtitan")
    from torchtitan_ext.version import LINE

    if LINE != "0.2":
        pytest.skip("torchtitan 0.2.x metrics processor")
    from torchtitan.components.metrics import LoggerContainer, TensorBoardLogger

    from torchtitan_ext.metrics import record_job

    container = LoggerContainer()
    container.add_logger(TensorBoardLogger(str(tmp_path / "tb" / "20261203-0100")))
    record_job(container, JOB)
    container.log({"loss_metrics/global_avg_loss": 5.0}, 1)
    container.close()
    assert summary.job_text(summary.resolve_events(tmp_path)) == JOB
