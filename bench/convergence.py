"""Convergence study: the tiny Llama3 of train_configs/llama3_tiny.toml trained by torchtitan with AdamW
(several learning rates) and with Muon, for the same steps, seeds and batches.

    python bench/convergence.py [--steps 300] [--seeds 0 1 2] [--adamw-lrs 2e-3 4e-3 8e-3] [--muon-lr 1e-2]
                                [--nproc N] [--jobs J] [--out outputs/convergence] [-- overrides...]
    python bench/convergence.py --quick     # 1 seed, AdamW at 4e-3 and Muon, 4 steps: a CPU smoke run

Each run is ``torchrun -m torchtitan_ext.train`` (GPUs when present, else CPU/gloo) with ``--debug.seed``
setting the initialization; the data order is the same for every run, so the comparison is paired.
The final loss of a run is its mean training loss over the last ``--tail`` steps. Writes
``bench/results/convergence.json`` (the table as rows, every loss curve under ``runs``), prints the table in
Markdown, and draws ``convergence.png`` next to the result file when matplotlib is installed. Each run's log
and torchtitan dump folder go under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from common import benchmark_parser, markdown_table, write_result

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "train_configs" / "llama3_tiny.toml"
LOSS_LINE = re.compile(r"step:\s*(\d+)\s+loss:\s*([-+\w.]+)")
TPS = re.compile(r"tps:\s*([\d,]+)")
MARGIN = 0.02


@dataclass(frozen=True)
class Run:
    """One training run of the study."""

    optimizer: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.optimizer}_lr{self.lr:g}_seed{self.seed}"


def launch(run: Run, args: argparse.Namespace, port: int) -> dict:
    """Train ``run``; return its loss curve, final loss and median tokens/s (rank 0)."""
    dump = args.out / run.name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        "--master_port", str(port), "--local-ranks-filter", "0",
        "-m", "torchtitan_ext.train", "--job.config_file", str(CONFIG), "--job.dump_folder", str(dump),
        "--optimizer.name", run.optimizer, "--optimizer.lr", str(run.lr), "--debug.seed", str(run.seed),
        "--training.steps", str(args.steps), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        *args.overrides,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    dump.mkdir(parents=True, exist_ok=True)
    (dump / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{run.name} failed; see {dump / 'train.log'}:\n{(proc.stdout + proc.stderr)[-2000:]}")
    losses = {int(s): float(v) for s, v in LOSS_LINE.findall(proc.stdout + proc.stderr)}
    curve = [losses[s] for s in sorted(losses)]
    tps = sorted(int(t.replace(",", "")) for t in TPS.findall(proc.stdout + proc.stderr))
    tail = curve[-args.tail :]
    return {**asdict(run), "curve": curve, "final": sum(tail) / len(tail), "tps": tps[len(tps) // 2]}


def table(results: list[dict], seeds: list[int], adamw_lrs: list[float], muon_lr: float) -> dict:
    """Per seed: Muon's final loss, AdamW's at every lr, the best AdamW, and the margin."""
    final = {(r["optimizer"], r["lr"], r["seed"]): r["final"] for r in results}
    mean_by_lr = {lr: sum(final["AdamW", lr, s] for s in seeds) / len(seeds) for lr in adamw_lrs}
    best_lr = min(mean_by_lr, key=mean_by_lr.get)
    rows = []
    for s in seeds:
        adamw = {lr: final["AdamW", lr, s] for lr in adamw_lrs}
        best_this_seed = min(adamw.values())
        muon = final["Muon", muon_lr, s]
        rows.append(
            {
                "seed": s,
                "muon": muon,
                "adamw": adamw,
                "adamw_best_lr": adamw[best_lr],
                "adamw_best_this_seed": best_this_seed,
                "gain_vs_best_lr": adamw[best_lr] - muon,
                "gain_vs_best_this_seed": best_this_seed - muon,
            }
        )
    passed = all(r["gain_vs_best_this_seed"] >= MARGIN for r in rows)
    return {"adamw_best_lr": best_lr, "adamw_mean_by_lr": mean_by_lr, "rows": rows, "passed": passed}


def markdown(summary: dict, adamw_lrs: list[float], muon_lr: float) -> str:
    """The table of :func:`table` in Markdown."""
    columns = [("seed", "seed", "{}"), ("muon", f"Muon (lr {muon_lr:g})", "{:.4f}")]
    columns += [(f"adamw_lr{lr:g}", f"AdamW lr {lr:g}", "{:.4f}") for lr in adamw_lrs]
    columns += [
        ("adamw_best_this_seed", "best AdamW", "{:.4f}"),
        ("gain_vs_best_this_seed", "Muon gain (nats)", "{:+.4f}"),
    ]
    rows = [{**r, **{f"adamw_lr{lr:g}": r["adamw"][lr] for lr in adamw_lrs}} for r in summary["rows"]]
    verdict = "met" if summary["passed"] else "NOT met"
    return (
        markdown_table(rows, columns)
        + f"\n\nCriterion (Muon below the best AdamW of each seed by >= {MARGIN} nats on every seed): {verdict}."
    )


def plot(results: list[dict], summary: dict, muon_lr: float, path: Path, smooth: int = 20) -> bool:
    """Loss curves (moving average over ``smooth`` steps): Muon and the best AdamW lr, one line per seed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    def moving_average(curve: list[float]) -> list[float]:
        return [
            sum(curve[max(0, i - smooth + 1) : i + 1]) / len(curve[max(0, i - smooth + 1) : i + 1])
            for i in range(len(curve))
        ]

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        if (r["optimizer"], r["lr"]) not in {("Muon", muon_lr), ("AdamW", summary["adamw_best_lr"])}:
            continue
        color = "tab:red" if r["optimizer"] == "Muon" else "tab:blue"
        label = f"{r['optimizer']} lr {r['lr']:g}" if r["seed"] == summary["rows"][0]["seed"] else None
        ax.plot(range(1, len(r["curve"]) + 1), moving_average(r["curve"]), color=color, alpha=0.8, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average, {smooth} steps)")
    ax.set_title(
        f"tiny Llama3 (torchtitan debugmodel), stdlib corpus: Muon vs best AdamW, {len(summary['rows'])} seed(s)"
    )
    ax.set_ylim(top=min(ax.get_ylim()[1], 6.0))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    """Run the study and write its outputs."""
    parser = benchmark_parser(__doc__, "convergence")
    parser.add_argument("--steps", type=int, default=None, help="default 300 (quick: 4)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=None, help="default 2e-3 4e-3 8e-3 (quick: 4e-3)")
    parser.add_argument("--muon-lr", type=float, default=1e-2)
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument(
        "--tail", type=int, default=None, help="final loss = mean over this many last steps (default 20; quick: 2)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "convergence", help="logs and dump folders")
    parser.add_argument("overrides", nargs="*", help="extra torchtitan flags (after --)")
    args = parser.parse_args()
    quick = {"steps": 4, "seeds": [0], "adamw_lrs": [4e-3], "tail": 2}
    full = {"steps": 300, "seeds": [0, 1, 2], "adamw_lrs": [2e-3, 4e-3, 8e-3], "tail": 20}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [Run("Muon", args.muon_lr, s) for s in args.seeds]
    runs += [Run("AdamW", lr, s) for lr in args.adamw_lrs for s in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda ir: launch(ir[1], args, 29500 + ir[0]), enumerate(runs)))
    summary = table(results, args.seeds, args.adamw_lrs, args.muon_lr)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{device}, {args.nproc} process(es) a run, {args.steps} steps; final loss = mean of the last {args.tail}")
    print(markdown(summary, args.adamw_lrs, args.muon_lr))
    rows = [{**r, "adamw": {f"{lr:g}": v for lr, v in r["adamw"].items()}} for r in summary["rows"]]
    path = write_result(
        args,
        rows,
        adamw_best_lr=summary["adamw_best_lr"],
        adamw_mean_by_lr={f"{lr:g}": v for lr, v in summary["adamw_mean_by_lr"].items()},
        passed=summary["passed"],
        margin=MARGIN,
        runs=results,
    )
    if path is not None and plot(results, summary, args.muon_lr, path.with_suffix(".png")):
        print(f"plot: {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
