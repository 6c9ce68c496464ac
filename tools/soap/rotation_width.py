"""How far SOAP's per-step power iteration turns each basis in real training: whether the refresh could be a
small rotation instead of a QR factorization. BENCHMARKS.md ("The refresh on matrix products") cites its run for
why the refresh keeps its factorizations.

    PYTHONPATH=src:. python tools/soap/rotation_width.py                       # tiny Llama3, 60 steps, CPU
    PYTHONPATH=src:. python tools/soap/rotation_width.py --steps 30 --json out.json

It trains torchtitan's tiny Llama3 (``train_configs/llama3_tiny.toml``, one process) with
``dtensor_muon.SOAP`` and ``basis="cholqr"`` (a refresh every step) and, at each refresh of each factor K
with old basis Q, computes in float64 what a rotation would have to do. With the sorted old basis Q_s and
A = Q_sᵀ·K·Q_s, the power step is Q_s·qr(A + σI) (σ = 10⁻⁵·2ᵉ, 2ᵉ⁻¹ ≤ max diag A < 2ᵉ), whose orthogonal
factor is I + S + O(‖S‖²) with S = T − Tᵀ, T_ij = A_ij/(A_jj + σ) for i > j. A refresh made of matrix
products (for example exp(S) to a few orders) is the QR step only while ‖S‖₂ is small. Per factor side, for
the first and the last third of the refreshes: the median and 90th percentile of ‖S‖₂, the share of refreshes
with ‖S‖₂ ≤ 1/8 and ≤ 1/2, and the mean over pairs i ≠ j of the coherence |A_ij|/√(A_ii·A_jj).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

import dtensor_muon.rules.soap as soap_rule
from dtensor_muon.linalg import eigenbasis

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "train_configs" / "llama3_tiny.toml"


def rotation_width(k: Tensor, q_old: Tensor) -> tuple[float, float]:
    """(‖S‖₂, mean pairwise coherence) of one factor's power step from ``q_old`` (module docstring), float64."""
    k64, q64 = k.to(torch.float64), q_old.to(torch.float64)
    a = q64.T @ k64 @ q64
    order = torch.argsort(a.diagonal(), descending=True)
    a = a[order][:, order]
    d = a.diagonal()
    top = d[0].item()
    shift = 1e-5 * 2.0 ** torch.frexp(torch.tensor(top)).exponent.item() if top > 0 else 0.0
    lower = torch.tril(a, -1) / (d + shift)[None, :]
    width = torch.linalg.matrix_norm(lower - lower.T, ord=2).item()
    coherence = a.abs() / torch.sqrt(d.clamp_min(1e-300)[:, None] * d.clamp_min(1e-300)[None, :])
    side = len(d)
    mean_coherence = ((coherence.sum() - coherence.diagonal().sum()) / (side * (side - 1))).item()
    return width, mean_coherence


def summarize(records: dict[int, list[tuple[float, float]]]) -> list[dict[str, float]]:
    """Per factor side and third of the run (first, last): the module docstring's statistics."""
    rows = []
    for side, values in sorted(records.items()):
        third = max(1, len(values) // 3)
        for part, chunk in (("first third", values[:third]), ("last third", values[-third:])):
            widths = sorted(w for w, _ in chunk)
            rows.append(
                {
                    "side": side,
                    "refreshes": part,
                    "count": len(widths),
                    "median_width": statistics.median(widths),
                    "p90_width": widths[int(0.9 * (len(widths) - 1))],
                    "share_le_1_8": sum(w <= 1 / 8 for w in widths) / len(widths),
                    "share_le_1_2": sum(w <= 1 / 2 for w in widths) / len(widths),
                    "mean_coherence": statistics.mean(c for _, c in chunk),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--dump-folder", default="outputs/rotation_width")
    args = parser.parse_args()

    records: dict[int, list[tuple[float, float]]] = defaultdict(list)
    refresh = eigenbasis.power_cholqr

    def recording_refresh(k: Tensor, q_old: Tensor, eigh: Callable) -> tuple[Tensor, ...]:
        for k_i, q_i in zip(k, q_old):
            records[k_i.shape[-1]].append(rotation_width(k_i, q_i))
        return refresh(k, q_old, eigh)

    soap_rule.power_cholqr = recording_refresh
    sys.argv = [
        "torchtitan_ext.train",
        "--job.config_file", str(CONFIG),
        "--job.dump_folder", args.dump_folder,
        "--optimizer.name", "SOAP",
        "--soap.basis", "cholqr",
        "--training.steps", str(args.steps),
    ]  # fmt: skip
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    atexit.register(report, records, args.steps, args.json)  # the trainer leaves through the exit handlers
    runpy.run_module("torchtitan_ext.train", run_name="__main__")


def report(records: dict[int, list[tuple[float, float]]], steps: int, path: Path | None) -> None:
    """Print the table (Markdown) and write the rows to ``path`` when given."""
    rows = summarize(records)
    print("| side | refreshes | count | median ‖S‖₂ | p90 ‖S‖₂ | ≤ 1/8 | ≤ 1/2 | mean coherence |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['side']} | {r['refreshes']} | {r['count']} | {r['median_width']:.3f} | {r['p90_width']:.3f} | "
            f"{r['share_le_1_8']:.0%} | {r['share_le_1_2']:.0%} | {r['mean_coherence']:.4f} |",
            flush=True,
        )
    if path is not None:
        path.write_text(json.dumps({"steps": steps, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
