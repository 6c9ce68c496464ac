"""How the unit size (matrices stacked into one Newton–Schulz call) moves the plan's balance and traffic for the
MoE models, from the plan simulator alone (no GPU, no timing).

    python bench/unit_size_balance.py            # Qwen3-30B-A3B and DeepSeek-V3-16B, 8/64/256 ranks, EP 1 and 8
    python bench/unit_size_balance.py --quick    # one model, one world size

Each row plans the model (:func:`dtensor_muon.plan.simulate.simulate`, Muon, FSDP ``Shard(0)``, or FSDP over
expert parallelism) with units of at most ``max_batch`` matrices and at least ``units_per_parameter`` units per
parameter (:func:`dtensor_muon.plan.builder.unit_size`: the largest power of two within both). It prints:

- ``unit``: the expert parameters' unit size that results;
- ``imbal``: the busiest rank's Newton–Schulz FLOPs over the mean (each matrix costed at the same rate, so a
  larger unit's faster products are not credited here: this is the granularity cost of a larger unit only);
- ``local``: matrices computed where they lie (no exchange); ``MB sent max``: the busiest sender's bytes.

A unit is local only when one rank holds all its matrices whole, so under expert parallelism a unit larger
than a rank's share of a parameter's experts (128/8 = 16 for Qwen3 at EP 8) turns local experts into routed
ones: the traffic column shows where that happens.
"""

from __future__ import annotations

from common import benchmark_parser, markdown_table, write_result

from dtensor_muon.plan.builder import unit_size
from dtensor_muon.plan.simulate import simulate

SIZES = ((8, 8), (16, 4), (32, 4), (64, 2), (128, 1))
"""(max_batch, units_per_parameter): the engine's (8, 8), then units of 16 to 128 for 128 experts."""
MODELS = {"qwen3:30B-A3B": 128, "deepseek_v3:16B": 64}
"""The MoE models and their routed experts per layer."""


def main() -> None:
    parser = benchmark_parser(__doc__, "unit_size_balance")
    args = parser.parse_args()
    models = {"qwen3:30B-A3B": 128} if args.quick else MODELS
    worlds = [8] if args.quick else [8, 64, 256]
    rows = []
    for model, experts in models.items():
        for ep in (1, 8):
            seen = set()
            for max_batch, per_parameter in SIZES[:2] if args.quick else SIZES:
                unit = unit_size(experts, max_batch, per_parameter)
                if unit in seen:  # another (max_batch, units_per_parameter) giving the same units
                    continue
                seen.add(unit)
                summaries = simulate(
                    model, worlds, ep=ep, max_batch=max_batch, units_per_parameter=per_parameter, cuda_graphs=False
                )
                for s in summaries:
                    rows.append(
                        {
                            "model": model,
                            "ranks": s.world_size,
                            "ep": ep,
                            "max_batch": max_batch,
                            "units_per_parameter": per_parameter,
                            "unit": unit,
                            "imbalance": s.imbalance,
                            "local": s.local_matrices,
                            "matrices": s.matrices,
                            "mb_sent_max": s.bytes_sent_max / 1e6,
                            "ns_gflop_max": s.ns_gflop_max,
                        }
                    )
                    print(f"{model} ranks {s.world_size} ep {ep} unit {unit}: imbalance {s.imbalance:.3f}", flush=True)
    columns = [
        ("model", "model", "{}"),
        ("ranks", "ranks", "{}"),
        ("ep", "EP", "{}"),
        ("unit", "expert unit", "{}"),
        ("imbalance", "imbal", "{:.3f}"),
        ("local", "local", "{}"),
        ("matrices", "matrices", "{}"),
        ("mb_sent_max", "MB sent max", "{:.1f}"),
        ("ns_gflop_max", "GFLOP max", "{:.0f}"),
    ]
    print(markdown_table(rows, columns))
    write_result(args, rows)


if __name__ == "__main__":
    main()
