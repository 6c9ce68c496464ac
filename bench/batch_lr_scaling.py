"""Does Muon's best lr move with √(batch) on a MoE? The best lr at one global batch, then the doubled batch at that
lr, at lr·√2 (``dtensor_muon.batch_scaled_lr``) and at lr·2 (the linear rule), on held-out loss.

    python bench/lr_study.py tokens          # once: the tokenized corpus (after python -m torchtitan_ext.data)
    python bench/batch_lr_scaling.py [--steps 300] [--seeds 0 1] [--batch 8] [--lrs 1e-3 3e-3 1e-2] [--workers 2]
    python bench/batch_lr_scaling.py --quick  # 1 seed, 6 steps, a tiny model: a smoke run

The model is bench/lr_study.py's MoE cut to a CPU's size (:data:`CPU_MOE`: dim 128, 2 layers, 8 experts of
width 48 with top-2 routing, so each expert sees about a quarter of the batch's tokens, sequences of 128), Muon
with ``adjust_lr_fn="match_rms_adamw"``, the study's schedule (warm-up a tenth of the steps, cosine to 0.1×) and
held-out loss; every run of one batch size sees the same batches, the seed sets the initialization. First the
``--lrs`` sweep at ``--batch`` (per seed), then for each seed the doubled batch at that seed's best lr, at
``batch_scaled_lr(best, 2B, B)`` and at twice the best. The doubled batch sees twice the tokens in the same
steps. Prints per run the final held-out loss and writes ``bench/results/batch_lr_scaling.json``. The 12 runs of
the defaults take more than half an hour on 2 CPU cores (a GPU runs them in minutes).
"""

from __future__ import annotations

from common import benchmark_parser, markdown_table, write_result
from lr_study import QUICK_MODELS, ModelConfig, Run, in_processes, train

import dtensor_muon

CPU_MOE = ModelConfig(dim=128, layers=2, heads=4, kv_heads=2, experts=8, expert_ffn=48, top_k=2, seq=128)


def one_run(lr: float, seed: int, batch: int, steps: int, quick: bool) -> dict:
    record = train(
        Run("moe", "Muon", lr, seed, batch=batch, steps=steps), config=QUICK_MODELS["moe"] if quick else CPU_MOE
    )
    return {"lr": lr, "seed": seed, "batch": batch, "final_val": record["final_val"], "val": record["val"]}


def run_all(jobs: list[tuple[float, int, int]], args) -> list[dict]:
    return in_processes(one_run, [(lr, seed, batch, args.steps, args.quick) for lr, seed, batch in jobs], args.workers)


def main() -> None:
    parser = benchmark_parser(__doc__, "batch_lr_scaling")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch", type=int, default=8, help="the reference batch (sequences)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds, args.lrs = 6, [0], [3e-3]
    sweep = run_all([(lr, s, args.batch) for s in args.seeds for lr in args.lrs], args)
    best = {s: min((r for r in sweep if r["seed"] == s), key=lambda r: r["final_val"])["lr"] for s in args.seeds}
    doubled = 2 * args.batch
    rules = {"same lr": 1.0, "√ rule": dtensor_muon.batch_scaled_lr(1.0, doubled, args.batch), "linear": 2.0}
    jobs = [(best[s] * factor, s, doubled) for s in args.seeds for factor in rules.values()]
    scaled = run_all(jobs, args)
    names = ["sweep"] * len(sweep) + [name for _ in args.seeds for name in rules]
    rows = [
        {"batch": r["batch"], "rule": name, "lr": r["lr"], "seed": r["seed"], "final val": r["final_val"]}
        for r, name in zip([*sweep, *scaled], names)
    ]
    columns = [("batch", "batch", "{}"), ("rule", "rule", "{}"), ("lr", "lr", "{:.3g}"), ("seed", "seed", "{}"),
               ("final val", "final held-out loss", "{:.4f}")]  # fmt: skip
    print(markdown_table(rows, columns))
    write_result(args, rows, best_lr_per_seed=best, runs=[*sweep, *scaled])


if __name__ == "__main__":
    main()
