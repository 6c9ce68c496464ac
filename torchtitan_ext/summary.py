"""One line that sums up a torchtitan run from its TensorBoard events, and optionally a plot of it.

    python -m torchtitan_ext.summary DUMP [--plot [PNG]]
    python -m torchtitan_ext.summary RUN [--plot [PNG]]        (a run folder DUMP/tb/<date-time>, or an event file)
    python -m torchtitan_ext.summary [--plot [PNG]] --job.config_file X.toml [torchtitan overrides ...]

The last form finds the dump folder (and the TensorBoard folder in it) the way torchtitan does,
from the config and the same overrides as the run (``make train`` passes its ``ARGS``). Given a dump
folder, the newest event file of the newest run under ``DUMP/<save_tb_folder>`` is read (a run folder is
named by the minute, so two runs within a minute share one: the newest file is the latest run); when
the folder holds several runs the output says so, and a run folder (or an event file) picks one. The line
gives the steps, the first and last logged loss, the mean of the last logged losses, the time per step
and the optimizer's update RMS. ``--plot`` also draws the loss curve and the optimizer's metrics into a PNG
(default ``DUMP/loss_curve.png``, or ``RUN/loss_curve.png`` for a run folder), titled with what the run
trained (model, optimizer, lr, steps: the text the launcher's metrics processor records in the run's events,
:data:`torchtitan_ext.metrics.JOB_TAG`); it needs matplotlib (``pip install -e .[plot]``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PLOT_NAME = "loss_curve.png"
EVENTS_GLOB = "events.out.tfevents.*"
JOB_TEXT_TAG = "job/text_summary"
"""Where TensorBoard keeps the text :data:`torchtitan_ext.metrics.JOB_TAG`."""
MISSING_MATPLOTLIB = "--plot needs matplotlib: pip install -e .[plot] (or pip install matplotlib)"


def runs_under(dump: Path, tb_folder: str = "tb") -> list[Path]:
    """The run folders under ``dump/tb_folder``, oldest first (named by date and minute)."""
    return sorted(p for p in (dump / tb_folder).glob("*") if p.is_dir())


def newest_events_in(folder: Path) -> Path:
    """The newest event file in ``folder`` or below it."""
    files = sorted(folder.rglob(EVENTS_GLOB), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no TensorBoard event file under {folder}")
    return files[-1]


def latest_events(dump: Path, tb_folder: str = "tb") -> Path:
    """The newest TensorBoard event file of the newest run folder under ``dump/tb_folder``."""
    runs = runs_under(dump, tb_folder)
    if not runs:
        raise FileNotFoundError(f"no TensorBoard run under {dump / tb_folder}")
    return newest_events_in(runs[-1])


def resolve_events(path: Path, tb_folder: str = "tb") -> Path:
    """The event file ``path`` names: itself; the newest in it when it is a run folder (event files in it or
    below it, but no ``tb_folder``); else the newest of the newest run of the dump folder ``path``."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither a dump folder, a run folder nor an event file")
    if not (path / tb_folder).is_dir() and any(path.rglob(EVENTS_GLOB)):
        return newest_events_in(path)
    return latest_events(path, tb_folder)


def job_text(events: Path) -> str | None:
    """The run's description recorded by the launcher (model, optimizer, lr, steps), or None."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(events), size_guidance={"tensors": 0})
    accumulator.Reload()
    if JOB_TEXT_TAG not in accumulator.Tags()["tensors"]:
        return None
    value = tensor_util.make_ndarray(accumulator.Tensors(JOB_TEXT_TAG)[-1].tensor_proto)
    text = value.reshape(-1)[0] if value.ndim else value.item()
    return text.decode() if isinstance(text, bytes) else str(text)


def title_of(series: dict[str, list[tuple[int, float]]], events: Path, text: str | None) -> str:
    """The plot's title: what the run trained (its recorded description without the dump folder, else the
    matrix rule read from the metric names, or AdamW), the steps logged, and the run folder."""
    loss = series.get("loss_metrics/global_avg_loss", [])
    steps = f"{loss[-1][0]} steps logged" if loss else "no loss logged"
    if text:
        what = text.split(", dump folder")[0]
    else:
        rules = [t.rsplit("/", 1)[1] for t in update_rms_tags(series) if not t.endswith("/adamw")]
        what = f"{', '.join(rules)} rule" if rules else "Adam/AdamW (no matrix optimizer metrics)"
    return f"{what}; {steps}; run {events.parent.name}"


def dump_of_job(args: list[str]) -> tuple[Path, str]:
    """``(dump_folder, save_tb_folder)`` of the job that torchtitan's command line ``args`` describe."""
    from torchtitan.config import ConfigManager

    from torchtitan_ext.job_config import use_in_config_manager

    use_in_config_manager()
    config = ConfigManager().parse_args(args)
    return Path(config.job.dump_folder), config.metrics.save_tb_folder


def scalars(events: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of an event file (or run folder): tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def summary_line(series: dict[str, list[tuple[int, float]]], tail: int = 5) -> str:
    """The summary of one run's scalars."""
    loss = series["loss_metrics/global_avg_loss"]
    last = [v for _, v in loss[-tail:]]
    step_time = [v for _, v in series.get("time_metrics/end_to_end(s)", [])[1:]]
    parts = [
        f"steps {loss[-1][0]}",
        f"loss {loss[0][1]:.3f} (step {loss[0][0]}) -> {loss[-1][1]:.3f}",
        f"mean of last {len(last)} logs {sum(last) / len(last):.3f}",
    ]
    if step_time:
        parts.append(f"{sum(step_time) / len(step_time):.2f} s/step")
    for tag in update_rms_tags(series):
        parts.append(f"{tag.split('/', 1)[1]} {series[tag][-1][1]:.2e}")
    return "summary: " + ", ".join(parts)


def update_rms_tags(series: dict[str, list[tuple[int, float]]]) -> list[str]:
    """The update-RMS tags logged: the matrix rule's (``muon/update_rms/muon``, ``…/soap``, …), then AdamW's."""
    return sorted((t for t in series if t.startswith("muon/update_rms/")), key=lambda t: (t.endswith("/adamw"), t))


def _xy(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [s for s, _ in points], [v for _, v in points]


def plot(series: dict[str, list[tuple[int, float]]], png: Path, title: str = "") -> Path:
    """Draw the loss (with the max over ranks), the update RMS of the matrix (Muon, MOP or NorMuon) and AdamW
    parameters, and, where logged, the Newton–Schulz σ range / orthogonality error and the gradient norm,
    one panel each; save as ``png``."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MISSING_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    loss_tags = [t for t in ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss") if t in series]
    panels.append(("loss", loss_tags, False))
    rms = update_rms_tags(series)
    if rms:
        panels.append(("update RMS", rms, True))
    sigma = [t for t in ("muon/sigma_min", "muon/sigma_max", "muon/orthogonality_error") if t in series]
    if sigma:
        panels.append(("Newton–Schulz output (sampled)", sigma, False))
    if "grad_norm" in series:
        panels.append(("gradient norm", ["grad_norm"], True))
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (name, tags, log_y) in zip(axes[:, 0], panels, strict=True):
        for tag in tags:
            ax.plot(*_xy(series[tag]), marker="." if len(series[tag]) < 40 else None, label=tag.split("/")[-1])
        ax.set_ylabel(name)
        if log_y:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title, fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s DUMP [--plot [PNG]] | %(prog)s [--plot [PNG]] --job.config_file X.toml [overrides ...]",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--plot", nargs="?", const="", metavar="PNG", help=f"also write a PNG (default DUMP/{PLOT_NAME})"
    )
    args, rest = parser.parse_known_args(argv)
    if rest and rest[0].startswith("-"):
        dump, tb_folder = dump_of_job(rest)
    elif len(rest) == 1:
        dump, tb_folder = Path(rest[0]), "tb"
    else:
        parser.error("give the dump folder, or torchtitan's --job.config_file X.toml and the run's overrides")
    try:
        events = resolve_events(dump, tb_folder)
    except FileNotFoundError as exc:
        raise SystemExit(f"summary: {exc}") from None
    series = scalars(events)
    if "loss_metrics/global_avg_loss" not in series:
        raise SystemExit(f"summary: {events} holds no loss (a run that logged no step?)")
    text = job_text(events)
    runs = runs_under(dump, tb_folder) if (dump / tb_folder).is_dir() else []
    print(f"{summary_line(series)}; tensorboard --logdir {events.parent}", file=sys.stdout)
    print(f"run: {events.parent}" + (f" ({text})" if text else ""), file=sys.stdout)
    if len(runs) > 1:
        print(
            f"note: {len(runs)} runs under {dump / tb_folder}; this is the newest. Give a run folder "
            f"(e.g. {runs[0]}) to read another, or a --job.dump_folder of its own to each run.",
            file=sys.stdout,
        )
    if args.plot is not None:
        default = (dump if (dump / tb_folder).is_dir() else events.parent) / PLOT_NAME
        png = plot(series, Path(args.plot) if args.plot else default, title=title_of(series, events, text))
        print(f"plot: {png}", file=sys.stdout)


if __name__ == "__main__":
    main()
