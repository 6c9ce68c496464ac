"""What every product benchmark shares: its arguments, the machine it ran on, its table and its result file.

A benchmark ``bench/NAME.py`` does::

    from common import benchmark_parser, machine, markdown_table, write_result

    parser = benchmark_parser(__doc__, "NAME")      # --quick, --json (default bench/results/NAME.json)
    args = parser.parse_args()
    rows = [...]                                    # one dict per measured case
    print(markdown_table(rows, [("case", "case", "{}"), ("ms", "step ms", "{:.2f}")]))
    write_result(args, rows)

The result file holds ``{"benchmark", "machine", "args", "rows", ...extra}``; ``machine`` records the device,
the host, the library's commit and the versions that decide the figures, so a figure in BENCHMARKS.md can be
traced to the code and card that produced it. ``--quick`` runs (tiny shapes, CPU smoke checks) write no file
unless ``--json`` is given, so a smoke run never replaces a measured result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Column = tuple[str, str, str]
"""(row key, header, format string such as ``"{:.2f}"``)."""


def benchmark_parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark has.

    ``--quick``: tiny shapes that run anywhere (CPU included) in seconds, to check the script works.
    ``--json PATH``: where the result goes; default ``bench/results/NAME.json`` for full runs and no file
    for ``--quick`` runs. ``--json ''`` writes nothing.
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(benchmark=name)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, runs on CPU in seconds")
    parser.add_argument(
        "--json",
        default=None,
        help=f"result file (default: bench/results/{name}.json; none for --quick; '' for none)",
    )
    return parser


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    """``--backend nccl|gloo`` for a benchmark that also has ``--device cuda|cpu`` (see :func:`settle_backend`)."""
    parser.add_argument(
        "--backend",
        choices=["nccl", "gloo"],
        default=None,
        help="default: nccl on cuda, gloo on cpu; gloo on cuda runs every process on cuda:0 (one GPU shared)",
    )


def settle_backend(parser: argparse.ArgumentParser, args: argparse.Namespace, no_gpu_hint: str) -> None:
    """Default ``--backend`` (nccl on cuda, gloo on cpu); refuse nccl on the CPU and cuda without a GPU
    (``no_gpu_hint`` says what to use instead); a gloo run that is neither ``--quick`` nor given ``--json``
    writes ``bench/results/NAME_gloo.json``, never in place of the NCCL result."""
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cpu" and args.backend == "nccl":
        parser.error("--backend nccl needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"no CUDA GPU here: {no_gpu_hint}")
    if args.json is None and not args.quick and args.backend == "gloo":
        args.json = str(RESULTS_DIR / f"{args.benchmark}_gloo.json")


def require_gpus_for_nccl(parser: argparse.ArgumentParser, args: argparse.Namespace, processes: int) -> None:
    """NCCL takes one GPU per process: refuse more processes than GPUs."""
    if args.backend == "nccl" and processes > torch.cuda.device_count():
        parser.error(
            f"NCCL takes one GPU per process: {processes} processes, {torch.cuda.device_count()} GPUs"
            " (--backend gloo shares one GPU between the processes)"
        )


def result_path(args: argparse.Namespace) -> Path | None:
    """The file ``write_result`` writes for these arguments (None: write nothing)."""
    if args.json is None:
        return None if args.quick else RESULTS_DIR / f"{args.benchmark}.json"
    return Path(args.json) if args.json else None


def _git(*args: str) -> str | None:
    """The stripped output of ``git ARGS`` in this checkout, or None where git or the checkout is missing."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def git_commit() -> str | None:
    """The short commit of this checkout, with ``+changes`` when tracked files differ from it."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit is None:
        return None
    return commit + ("+changes" if _git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> dict[str, object]:
    """The device, host and software a result was measured with."""
    info: dict[str, object] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": git_commit(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["device"] = "cpu"
    return info


def markdown_table(rows: Iterable[dict], columns: Sequence[Column]) -> str:
    """A Markdown table of ``rows``: one column per (key, header, format); a missing value prints as ``–``."""
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |"]
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("–" if value is None else fmt.format(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    """The median; raises on an empty sequence, naming it as a benchmark error."""
    if not values:
        raise ValueError("no timings to take the median of")
    return statistics.median(values)


def write_result(args: argparse.Namespace, rows: list[dict], **extra: object) -> Path | None:
    """Write ``{"benchmark", "machine", "args", "rows", **extra}`` to ``result_path(args)``; return the path."""
    path = result_path(args)
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    arguments = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    payload = {"benchmark": args.benchmark, "machine": machine(), "args": arguments, "rows": rows, **extra}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {path}")
    return path
