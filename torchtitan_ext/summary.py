"""One line that sums up a torchtitan run from its TensorBoard events.

    python -m torchtitan_ext.summary outputs/llama3_tiny

Reads the newest run under ``DUMP/tb`` and prints the steps, the first and last logged loss, the
mean training loss over the last logged records, the time per step, and the optimizer's update RMS.
"""

import argparse
import sys
from pathlib import Path


def latest_events(dump: Path) -> Path:
    """The newest TensorBoard run folder under ``dump/tb``."""
    runs = sorted(p for p in (dump / "tb").glob("*") if p.is_dir())
    if not runs:
        raise FileNotFoundError(f"no TensorBoard run under {dump / 'tb'}")
    return runs[-1]


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the run: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


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
    for tag in ("muon/update_rms/muon", "muon/update_rms/adamw"):
        if tag in series:
            parts.append(f"{tag.split('/', 1)[1]} {series[tag][-1][1]:.2e}")
    return "summary: " + ", ".join(parts)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_folder", type=Path)
    args = parser.parse_args(argv)
    run = latest_events(args.dump_folder)
    print(f"{summary_line(scalars(run))}; tensorboard --logdir {run}", file=sys.stdout)


if __name__ == "__main__":
    main()
