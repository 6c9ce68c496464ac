"""Convergence study: the tiny Llama3 of train_configs/llama3_tiny.toml trained by torchtitan with AdamW
(several learning rates) and with the matrix optimizers Muon, SOAP and KL-SOAP, for the same steps, seeds and
batches.

    python bench/convergence.py [--steps 300] [--seeds 0 1 2] [--optimizers Muon SOAP KLSOAP AdamW]
                                [--adamw-lrs 2e-3 4e-3 8e-3] [--muon-lr 1e-2] [--soap-lr 4e-3]
                                [--soap-update-rms 0.2] [--nproc N] [--jobs J] [--out outputs/convergence]
                                [-- overrides...]
    python bench/convergence.py --quick     # 1 seed, AdamW at 4e-3, Muon, SOAP, KL-SOAP, 4 steps: a CPU smoke run

Each run is ``torchrun -m torchtitan_ext.train`` (GPUs when present, else CPU/gloo) with ``--debug.seed``
setting the initialization; the data order is the same for every run, so the comparison is paired. Muon runs
with the ``[muon]`` settings of the config (``adjust_lr_fn = "match_rms_adamw"``). SOAP and KL-SOAP
(``--optimizer.name SOAP`` / ``KLSOAP``, optionally ``REKLS``, and ``SOAP-cholqr``: SOAP with
``--soap.basis cholqr``, the refresh on matrix products) run with their section's defaults (QR basis
refreshed every step, factors' β 0.95, Adam's β₁, β₂, ε from ``[optimizer]``) and ``match_update_rms`` set
to ``--soap-update-rms`` (``--soap.match_update_rms 0.2``, ``--klsoap.…``): every matrix's update is scaled
to that RMS, about an AdamW update's, so an AdamW learning rate and its schedule carry over; the default SOAP
lr is the middle of the AdamW grid. Every optimizer puts the embeddings, head and norms on AdamW at its lr.

The final loss of a run is its mean training loss over the last ``--tail`` steps. Per seed, the table has
each matrix optimizer's final loss, AdamW's at every lr, the best AdamW of that seed and each matrix
optimizer's gain over it (positive: lower loss than the best AdamW), and a last row of means over the seeds.
Writes ``bench/results/convergence.json`` (the table as rows, every loss curve under ``runs``), prints the
table in Markdown, and draws ``convergence.png`` next to the result file when matplotlib is installed (per
optimizer the mean over seeds of the smoothed curves, with the seeds' range shaded; AdamW at its best lr).
Each run's log and torchtitan dump folder go under ``--out``.
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

SOAP_SECTIONS = {"SOAP": "soap", "KLSOAP": "klsoap", "REKLS": "rekls"}
"""The torchtitan section (``[soap]``, …) of each SOAP front end, where ``match_update_rms`` is set."""
VARIANTS = {"SOAP-cholqr": ("SOAP", ("--soap.basis", "cholqr"))}
"""Study names that are a front end with other settings: name → (``--optimizer.name``, extra flags)."""
MATRIX_OPTIMIZERS = ("Muon", *SOAP_SECTIONS, *VARIANTS)
OPTIMIZERS = (*MATRIX_OPTIMIZERS, "AdamW")
DEFAULT_OPTIMIZERS = ("Muon", "SOAP", "KLSOAP", "AdamW")
COLORS = {
    "Muon": "tab:red",
    "SOAP": "tab:green",
    "SOAP-cholqr": "tab:olive",
    "KLSOAP": "tab:purple",
    "REKLS": "tab:orange",
    "AdamW": "tab:blue",
}


@dataclass(frozen=True)
class Run:
    """One training run of the study (``update_rms``: SOAP's ``match_update_rms``; None for the others)."""

    optimizer: str
    lr: float
    seed: int
    update_rms: float | None = None

    @property
    def name(self) -> str:
        return f"{self.optimizer}_lr{self.lr:g}_seed{self.seed}"

    def flags(self) -> list[str]:
        """The torchtitan flags that select this run's optimizer and its settings."""
        front_end, extra = VARIANTS.get(self.optimizer, (self.optimizer, ()))
        out = ["--optimizer.name", front_end, "--optimizer.lr", str(self.lr), *extra]
        if self.update_rms is not None:
            out += [f"--{SOAP_SECTIONS[front_end]}.match_update_rms", str(self.update_rms)]
        return out


def launch(run: Run, args: argparse.Namespace, port: int) -> dict:
    """Train ``run``; return its loss curve, final loss and median tokens/s (rank 0)."""
    dump = args.out / run.name
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
        "--master_port", str(port), "--local-ranks-filter", "0",
        "-m", "torchtitan_ext.train", "--job.config_file", str(CONFIG), "--job.dump_folder", str(dump),
        *run.flags(), "--debug.seed", str(run.seed),
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


LABELS = {"KLSOAP": "KL-SOAP"}


def label(name: str) -> str:
    """The display name of an optimizer (``KLSOAP``: ``KL-SOAP``)."""
    return LABELS.get(name, name)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def mean_row(rows: list[dict]) -> dict:
    """The means over the seeds of every figure of :func:`table`'s per-seed rows (``seed``: ``"mean"``)."""
    out: dict = {"seed": "mean"}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: _mean([r[key][k] for r in rows]) for k in value}
        elif isinstance(value, float):
            out[key] = _mean([r[key] for r in rows])
        elif key != "seed":
            out[key] = value
    return out


def table(results: list[dict], seeds: list[int], adamw_lrs: list[float], matrix_lrs: dict[str, float]) -> dict:
    """Per seed: the final loss of each matrix optimizer (``matrix_lrs``: name → lr) and of AdamW at every lr,
    the best AdamW (at the lr best on the mean over seeds, and the best of this seed) and each matrix
    optimizer's gain over both (best AdamW minus its loss); the means over the seeds; and per matrix optimizer
    whether it beats the best AdamW of every seed by at least :data:`MARGIN` (only when AdamW ran)."""
    final = {(r["optimizer"], r["lr"], r["seed"]): r["final"] for r in results}
    mean_by_lr = {lr: _mean([final["AdamW", lr, s] for s in seeds]) for lr in adamw_lrs}
    best_lr = min(mean_by_lr, key=mean_by_lr.get) if mean_by_lr else None
    rows = []
    for s in seeds:
        matrix = {name: final[name, lr, s] for name, lr in matrix_lrs.items()}
        adamw = {lr: final["AdamW", lr, s] for lr in adamw_lrs}
        row: dict = {"seed": s, "final": matrix, "adamw": adamw}
        if adamw:
            best_this_seed = min(adamw.values())
            row["adamw_best_lr"] = adamw[best_lr]
            row["adamw_best_this_seed"] = best_this_seed
            row["gain_vs_best_lr"] = {name: adamw[best_lr] - v for name, v in matrix.items()}
            row["gain_vs_best_this_seed"] = {name: best_this_seed - v for name, v in matrix.items()}
        rows.append(row)
    passed = {}
    if adamw_lrs:
        passed = {name: all(r["gain_vs_best_this_seed"][name] >= MARGIN for r in rows) for name in matrix_lrs}
    return {
        "adamw_best_lr": best_lr,
        "adamw_mean_by_lr": mean_by_lr,
        "rows": rows,
        "mean": mean_row(rows),
        "passed": passed,
    }


def markdown(summary: dict, adamw_lrs: list[float], matrix_lrs: dict[str, float]) -> str:
    """The table of :func:`table` in Markdown: one row per seed and one of means."""
    columns = [("seed", "seed", "{}")]
    columns += [(f"final_{name}", f"{label(name)} (lr {lr:g})", "{:.4f}") for name, lr in matrix_lrs.items()]
    columns += [(f"adamw_lr{lr:g}", f"AdamW lr {lr:g}", "{:.4f}") for lr in adamw_lrs]
    if adamw_lrs:
        columns.append(("adamw_best_this_seed", "best AdamW", "{:.4f}"))
        columns += [(f"gain_{name}", f"{label(name)} gain (nats)", "{:+.4f}") for name in matrix_lrs]
    rows = []
    for r in [*summary["rows"], summary["mean"]]:
        flat = {"seed": r["seed"], "adamw_best_this_seed": r.get("adamw_best_this_seed")}
        flat.update({f"final_{name}": v for name, v in r["final"].items()})
        flat.update({f"adamw_lr{lr:g}": v for lr, v in r["adamw"].items()})
        flat.update({f"gain_{name}": v for name, v in r.get("gain_vs_best_this_seed", {}).items()})
        rows.append(flat)
    text = markdown_table(rows, columns)
    if summary["passed"]:
        verdicts = ", ".join(f"{label(n)} {'met' if ok else 'NOT met'}" for n, ok in summary["passed"].items())
        text += (
            f"\n\nCriterion (below the best AdamW of each seed by >= {MARGIN} nats on every seed): {verdicts}."
            f"\nAdamW's best lr on the mean over seeds: {summary['adamw_best_lr']:g}."
        )
    return text


def moving_average(curve: list[float], smooth: int) -> list[float]:
    """The mean of each step's loss and the ``smooth`` − 1 before it (fewer at the start)."""
    return [_mean(curve[max(0, i - smooth + 1) : i + 1]) for i in range(len(curve))]


def plot(results: list[dict], summary: dict, matrix_lrs: dict[str, float], path: Path, smooth: int = 20) -> bool:
    """Loss curves (moving average over ``smooth`` steps), per optimizer the mean over seeds with the seeds'
    range shaded: every matrix optimizer at its lr and AdamW at its best lr."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    drawn = dict(matrix_lrs)
    if summary["adamw_best_lr"] is not None:
        drawn["AdamW"] = summary["adamw_best_lr"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, lr in drawn.items():
        curves = [moving_average(r["curve"], smooth) for r in results if (r["optimizer"], r["lr"]) == (name, lr)]
        steps = min(len(c) for c in curves)
        x = range(1, steps + 1)
        mean = [_mean([c[i] for c in curves]) for i in range(steps)]
        color = COLORS.get(name)
        best = " (best of the grid)" if name == "AdamW" and len(summary["adamw_mean_by_lr"]) > 1 else ""
        ax.plot(x, mean, color=color, label=f"{label(name)} lr {lr:g}{best}")
        if len(curves) > 1:
            low = [min(c[i] for c in curves) for i in range(steps)]
            high = [max(c[i] for c in curves) for i in range(steps)]
            ax.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (moving average, {smooth} steps)")
    seeds = len(summary["rows"])
    ax.set_title(
        f"tiny Llama3 (torchtitan debugmodel), stdlib corpus: mean of {seeds} seed(s)"
        + (", range shaded" if seeds > 1 else ""),
        fontsize=10,
    )
    low, high = ax.get_ylim()
    if low < 6.0 < high:  # the first steps' high losses would squash the rest
        ax.set_ylim(top=6.0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def keyed(values: dict[float, float]) -> dict[str, float]:
    """``values`` with its float keys (learning rates) as strings, for JSON."""
    return {f"{k:g}": v for k, v in values.items()}


def main() -> None:
    """Run the study and write its outputs."""
    parser = benchmark_parser(__doc__, "convergence")
    parser.add_argument("--steps", type=int, default=None, help="default 300 (quick: 4)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument(
        "--optimizers",
        nargs="+",
        choices=OPTIMIZERS,
        default=list(DEFAULT_OPTIMIZERS),
        help=f"which optimizers run (default: {' '.join(DEFAULT_OPTIMIZERS)})",
    )
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=None, help="default 2e-3 4e-3 8e-3 (quick: 4e-3)")
    parser.add_argument("--muon-lr", type=float, default=1e-2)
    parser.add_argument("--soap-lr", type=float, default=4e-3, help="lr of SOAP, KL-SOAP and REKLS (default 4e-3)")
    parser.add_argument(
        "--soap-update-rms",
        type=float,
        default=0.2,
        help="SOAP's match_update_rms: each matrix's update scaled to this RMS (default 0.2; 0: off)",
    )
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
    args.optimizers = [name for name in OPTIMIZERS if name in args.optimizers]  # table order, no repeats
    if "AdamW" not in args.optimizers:
        args.adamw_lrs = []
    matrix_lrs = {name: args.muon_lr if name == "Muon" else args.soap_lr for name in args.optimizers if name != "AdamW"}
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [
        Run(name, lr, s, None if name == "Muon" else args.soap_update_rms)
        for name, lr in matrix_lrs.items()
        for s in args.seeds
    ]
    runs += [Run("AdamW", lr, s) for lr in args.adamw_lrs for s in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda ir: launch(ir[1], args, 29500 + ir[0]), enumerate(runs)))
    summary = table(results, args.seeds, args.adamw_lrs, matrix_lrs)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{device}, {args.nproc} process(es) a run, {args.steps} steps; final loss = mean of the last {args.tail}")
    print(markdown(summary, args.adamw_lrs, matrix_lrs))
    rows = [{**r, "adamw": keyed(r["adamw"])} for r in [*summary["rows"], summary["mean"]]]
    path = write_result(
        args,
        rows,
        matrix_lrs=matrix_lrs,
        soap_update_rms=args.soap_update_rms,
        adamw_best_lr=summary["adamw_best_lr"],
        adamw_mean_by_lr=keyed(summary["adamw_mean_by_lr"]),
        passed=summary["passed"],
        margin=MARGIN,
        runs=results,
    )
    if path is not None and plot(results, summary, matrix_lrs, path.with_suffix(".png")):
        print(f"plot: {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
