"""Which of SOAP's owner state can be stored in bfloat16 without losing its training lead: each part rounded to
bfloat16 after every step, against float32 SOAP and Muon, on held-out loss.

    python bench/lr_study.py tokens          # once: the tokenized corpus (after python -m torchtitan_ext.data)
    python bench/soap_state_precision.py [--steps 300] [--seeds 0 1 2] [--workers 2] [--lr 3e-3]
    python bench/soap_state_precision.py --quick      # 1 seed, 6 steps, a tiny model: a smoke run

The model is bench/lr_study.py's dense transformer cut to a CPU's size (:data:`CPU_MODEL`: dim 128, 2 layers,
4 heads and 2 KV heads, SwiGLU 352, sequences of 128 tokens, batches of 8), with its data, schedule (warm-up
a tenth of the steps, cosine to 0.1×) and held-out loss; every run sees the same batches, the seed sets the
initialization. SOAP as the study builds it (``match_update_rms=0.2``, a refresh every 10 steps), Muon with
``adjust_lr_fn="match_rms_adamw"``, both at ``--lr``.

The storage is simulated: after each step the chosen tensors of every matrix's owner state
(``optimizer.state[p]["owner_state"]``) are rounded to bfloat16 in place, round to nearest even (what storing
them in bf16 and reading them back gives), the rest stays float32. The loss difference is what storing that
part in bf16 costs; the simulation saves no memory. Variants (:data:`PARTS`): ``float32`` (nothing rounded),
``moments`` (Adam's M and V in the eigenbasis), ``factors`` (the Kronecker factors L and R), ``bases`` (the
bases Q_L and Q_R and their eigenvalue estimates), ``all``.

Prints per variant the final held-out loss of each seed, their mean and spread, the mean difference from
float32 SOAP and from Muon (paired by seed: negative is lower loss), and writes
bench/results/soap_state_precision.json (rows and curves).
"""

from __future__ import annotations

import statistics
from functools import partial

import torch
from common import benchmark_parser, markdown_table, write_result
from lr_study import QUICK_MODELS, ModelConfig, Run, in_processes, train

CPU_MODEL = ModelConfig(dim=128, layers=2, heads=4, kv_heads=2, ffn=352, seq=128)
PARTS = {
    "float32": (),
    "moments": ("exp_avg", "exp_avg_sq"),
    "factors": ("L", "R"),
    "bases": ("Q_L", "Q_R", "eig_L", "eig_R"),
    "all": ("exp_avg", "exp_avg_sq", "L", "R", "Q_L", "Q_R", "eig_L", "eig_R"),
}
"""The owner-state keys each variant rounds to bfloat16 (:class:`dtensor_muon.rules.soap`'s names)."""


def round_owner_state(keys: tuple[str, ...], optimizer: torch.optim.Optimizer) -> None:
    """Round ``keys`` of every owner state of ``optimizer`` to bfloat16 in place (round to nearest even)."""
    for state in optimizer.state.values():
        for matrix_state in state.get("owner_state", {}).values():
            for key in keys:
                if key in matrix_state:
                    matrix_state[key].copy_(matrix_state[key].bfloat16())


def one_run(variant: str, seed: int, steps: int, lr: float, quick: bool) -> dict:
    optimizer = "Muon" if variant == "Muon" else "SOAP"
    run = Run("dense", optimizer, lr, seed, batch=8, steps=steps, phase="soap_state_precision")
    hook = partial(round_owner_state, PARTS[variant]) if PARTS.get(variant) else None
    config = QUICK_MODELS["dense"] if quick else CPU_MODEL
    record = train(run, config=config, after_step=hook)
    return {"variant": variant, "seed": seed, "final_val": record["final_val"], "val": record["val"]}


def main() -> None:
    parser = benchmark_parser(__doc__, "soap_state_precision")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.seeds = 6, [0]
    variants = [*PARTS, "Muon"]
    jobs = [(v, s) for s in args.seeds for v in variants]
    records = in_processes(one_run, [(v, s, args.steps, args.lr, args.quick) for v, s in jobs], args.workers)
    final = {(r["variant"], r["seed"]): r["final_val"] for r in records}
    rows = []
    for v in variants:
        values = [final[(v, s)] for s in args.seeds]
        rows.append(
            {
                "variant": v,
                **{f"seed {s}": round(final[(v, s)], 4) for s in args.seeds},
                "mean": round(statistics.fmean(values), 4),
                "spread": round(max(values) - min(values), 4),
                "vs float32 SOAP": round(
                    statistics.fmean(final[(v, s)] - final[("float32", s)] for s in args.seeds), 4
                ),
                "vs Muon": round(statistics.fmean(final[(v, s)] - final[("Muon", s)] for s in args.seeds), 4),
            }
        )
    columns = [(k, k, "{}") for k in rows[0]]
    print(markdown_table(rows, columns))
    write_result(args, rows, runs=records)


if __name__ == "__main__":
    main()
