"""How closely a low-precision momentum buffer (``momentum_dtype``) tracks the float32 one, entry by entry.

    python bench/momentum_tracking.py [--columns 4096] [--steps 300] [--decades 3] [--seed 0]
    python bench/momentum_tracking.py --quick

One row of ``--columns`` entries whose gradients g_t = m + ½·σ·ξ_t (ξ_t standard normal, m ~ σ·N(0, 1)) have
scales σ spread log-uniformly over ``--decades`` decades, as the columns of a weight's gradient can be. Each
format runs the optimizer's own step on it, B' = lerp(B, g, 1 − μ) in float32 from the decoded buffer, then
encoded (:mod:`dtensor_muon.kernels.low_precision`), next to the float32 buffer B*. Per format and per third of
the scales (smallest, middle, largest σ): the median of |B − B*| / σ, each entry's error in units of its own
gradient scale, and the correlation of B with B*. bfloat16's stochastic rounding keeps every entry to a few
thousandths of its scale; int8's 127 absmax steps per 128-entry block leave an entry far below its block's
largest with little of its own momentum. Writes bench/results/momentum_tracking.json and prints the table.
"""

from __future__ import annotations

import torch
from common import benchmark_parser, markdown_table, write_result

from dtensor_muon.kernels.low_precision import decode_int8, encode_int8, round_bf16_stochastic

MOMENTUM = 0.95
"""μ: Muon's default."""


def track(columns: int, steps: int, decades: float, seed: int) -> list[dict]:
    """The rows of the module docstring: per format and third of the scales, the median error and correlation."""
    gen = torch.Generator().manual_seed(seed)
    sigma = torch.logspace(-decades, 0, columns)[torch.randperm(columns, generator=gen)]
    mean = torch.randn(columns, generator=gen) * sigma
    exact = torch.zeros(1, columns)
    bf16 = torch.zeros(1, columns, dtype=torch.bfloat16)
    codes, scales = encode_int8(torch.zeros(1, columns))
    for _ in range(steps):
        g = (mean + 0.5 * sigma * torch.randn(columns, generator=gen)).reshape(1, columns)
        exact = torch.lerp(exact, g, 1 - MOMENTUM)
        bf16 = round_bf16_stochastic(torch.lerp(bf16.float(), g, 1 - MOMENTUM), g)
        codes, scales = encode_int8(torch.lerp(decode_int8(codes, scales), g, 1 - MOMENTUM))
    held = {"bfloat16": bf16.float()[0], "int8": decode_int8(codes, scales)[0]}
    order = sigma.argsort()
    thirds = {"smallest": order[: columns // 3], "middle": order[columns // 3 : 2 * columns // 3]}
    thirds["largest"] = order[2 * columns // 3 :]
    rows = []
    for name, buffer in held.items():
        for third, index in thirds.items():
            b, ref = buffer[index], exact[0, index]
            rows.append(
                {
                    "momentum_dtype": name,
                    "scales": third,
                    "sigma_range": [float(sigma[index].min()), float(sigma[index].max())],
                    "median_error_over_sigma": float(((b - ref).abs() / sigma[index]).median()),
                    "correlation": float(torch.corrcoef(torch.stack([b, ref]))[0, 1]),
                }
            )
    return rows


def main() -> None:
    parser = benchmark_parser(__doc__, "momentum_tracking")
    parser.add_argument("--columns", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--decades", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.columns, args.steps = 384, 20
    rows = track(args.columns, args.steps, args.decades, args.seed)
    print(
        markdown_table(
            rows,
            [
                ("momentum_dtype", "momentum_dtype", "{}"),
                ("scales", "third of the scales", "{}"),
                ("median_error_over_sigma", "median abs(B − B*) / σ", "{:.4f}"),
                ("correlation", "corr(B, B*)", "{:.4f}"),
            ],
        )
    )
    write_result(args, rows)


if __name__ == "__main__":
    main()
