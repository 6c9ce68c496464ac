"""Muon's momentum buffer in float32, bfloat16 and int8 (``momentum_dtype``): the tiny Llama3 of
train_configs/llama3_tiny.toml trained by torchtitan with each, for the same steps, seeds and batches
(bench/convergence.py's runs, with ``--muon.momentum_dtype``).

    python bench/momentum_dtype.py [--steps 40] [--seeds 0 1 2] [--dtypes float32 bfloat16 int8] [--nproc N]
                                   [--jobs J] [--tail 10] [--out outputs/momentum_dtype] [-- overrides...]
    python bench/momentum_dtype.py --quick     # 1 seed, 3 steps: a CPU smoke run

Without overrides the runs are shortened for a CPU (:data:`SHORT`: sequences of 128 tokens, 5 warm-up steps):
nine runs of 40 steps then take about 7 minutes on 2 cores. Any override given replaces them all (e.g. ``-- --training.seq_len 256`` for the config's own).

Per momentum_dtype the table has the final loss of each seed (the mean training loss of the last ``--tail``
steps), their mean, their spread (largest minus smallest), the mean difference from float32 momentum (paired
by seed), and the bytes of optimizer state per parameter of the model: per matrix parameter (Muon's momentum
alone) and over every parameter (AdamW's two float32 moments for the embeddings, the head and the norms),
counted from the state a ``dtensor_muon.Muon`` creates for the model. Writes bench/results/momentum_dtype.json
(the rows and every loss curve) and prints the table in Markdown.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from common import benchmark_parser, markdown_table, write_result
from convergence import ROOT, Run, launch

import dtensor_muon
from dtensor_muon.kernels.low_precision import MOMENTUM_DTYPES

LR = 1e-2
"""Muon's lr in train_configs/llama3_tiny.toml (bench/convergence.py's --muon-lr)."""
SHORT = ["--training.seq_len", "128", "--lr_scheduler.warmup_steps", "5"]
"""The default overrides: a shorter run of the config for a CPU."""


@dataclass(frozen=True)
class MomentumRun(Run):
    """A Muon run of bench/convergence.py with its momentum in ``momentum_dtype``."""

    momentum_dtype: str = "float32"

    @property
    def name(self) -> str:
        return f"{self.momentum_dtype}_seed{self.seed}"

    def flags(self) -> list[str]:
        return [*super().flags(), "--muon.momentum_dtype", self.momentum_dtype]


def tiny_llama() -> torch.nn.Module:
    """The config's model (torchtitan's Llama3 "debugmodel") on the meta device."""
    from torchtitan.models.llama3 import Transformer, llama3_args

    with torch.device("meta"):
        return Transformer(llama3_args["debugmodel"])


def state_bytes(model: torch.nn.Module, momentum_dtype: str) -> dict[str, float]:
    """Bytes of the state ``dtensor_muon.Muon(muon_param_groups(model))`` creates: per matrix-rule parameter
    entry and per parameter entry of the whole model."""
    opt = dtensor_muon.Muon(dtensor_muon.muon_param_groups(model), momentum_dtype=momentum_dtype)
    matrix = [p for g in opt.param_groups if g["use_muon"] for p in g["params"]]

    def nbytes(params: list[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for p in params for t in opt.state[p].values() if torch.is_tensor(t))

    everything = [p for g in opt.param_groups for p in g["params"]]
    return {
        "matrix_bytes_per_param": nbytes(matrix) / sum(p.numel() for p in matrix),
        "bytes_per_param": nbytes(everything) / sum(p.numel() for p in everything),
    }


def summarize(results: list[dict], dtypes: list[str], bytes_of: dict[str, dict[str, float]]) -> list[dict]:
    """One row per momentum_dtype: final loss per seed, mean, spread, paired difference from float32, bytes."""
    finals = {d: {r["seed"]: r["final"] for r in results if r["momentum_dtype"] == d} for d in dtypes}
    rows = []
    for d in dtypes:
        seeds = sorted(finals[d])
        values = [finals[d][s] for s in seeds]
        row = {
            "momentum_dtype": d,
            "final_by_seed": {str(s): finals[d][s] for s in seeds},
            "final_mean": sum(values) / len(values),
            "final_spread": max(values) - min(values),
            **bytes_of[d],
        }
        if "float32" in finals:
            diffs = [finals[d][s] - finals["float32"][s] for s in seeds]
            row["vs_float32"] = sum(diffs) / len(diffs)
        rows.append(row)
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__, "momentum_dtype")
    parser.add_argument("--steps", type=int, default=None, help="default 40 (quick: 3)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (quick: 0)")
    parser.add_argument("--dtypes", nargs="+", choices=MOMENTUM_DTYPES, default=list(MOMENTUM_DTYPES))
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count() or 2)
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time")
    parser.add_argument("--tail", type=int, default=None, help="final loss = mean of the last steps (default 10)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "momentum_dtype", help="logs and dumps")
    parser.add_argument("overrides", nargs="*", help="extra torchtitan flags (after --)")
    args = parser.parse_args()
    for key, quick, full in (("steps", 3, 40), ("seeds", [0], [0, 1, 2]), ("tail", 2, 10)):
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else full)
    args.overrides = args.overrides or SHORT
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = [MomentumRun("Muon", LR, seed, momentum_dtype=d) for d in args.dtypes for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda ir: launch(ir[1], args, 29600 + ir[0]), enumerate(runs)))
    model = tiny_llama()
    rows = summarize(results, args.dtypes, {d: state_bytes(model, d) for d in args.dtypes})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    print(f"{device}, {args.nproc} process(es) a run, {args.steps} steps, seeds {args.seeds}; final loss = mean of "
          f"the last {args.tail} steps")  # fmt: skip
    table_rows = [{**r, **{f"seed {s}": v for s, v in r["final_by_seed"].items()}} for r in rows]
    columns = [("momentum_dtype", "momentum_dtype", "{}")]
    columns += [(f"seed {s}", f"seed {s}", "{:.4f}") for s in args.seeds]
    columns += [("final_mean", "mean", "{:.4f}"), ("final_spread", "spread", "{:.4f}")]
    if "vs_float32" in rows[0]:
        columns.append(("vs_float32", "Δ vs float32", "{:+.4f}"))
    columns += [
        ("matrix_bytes_per_param", "bytes/matrix param", "{:.3f}"),
        ("bytes_per_param", "bytes/param", "{:.3f}"),
    ]
    print(markdown_table(table_rows, columns))
    write_result(args, rows, lr=LR, overrides=args.overrides, runs=results)


if __name__ == "__main__":
    main()
