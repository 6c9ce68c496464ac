"""The several-GPU run: NCCL correctness and torchtitan throughput of Muon vs AdamW, one script.

    python bench/multi_gpu.py                       # all GPUs of the machine: bench/results/multi_gpu.json
    python bench/multi_gpu.py --quick               # rehearsal on CPU: 2 gloo processes, tiny Llama3, 4 steps

1. NCCL correctness: ``bench/nccl_correctness.py`` under torchrun at each world size of ``--world-sizes``
   (owner exchange, gather_all and overlap against the single-GPU result, bf16 tolerance; over gloo with
   ``--quick``).
2. torchtitan Llama3-8B (FSDP over all GPUs) and DeepSeek-V3-16B (FSDP + expert parallelism over all
   GPUs), each with AdamW, Muon, Muon + overlap and Muon + gather_all, same batch and sequence length:
   tokens/s, MFU counting model FLOPs only (torchtitan's), MFU counting Newton–Schulz FLOPs too (the plan
   simulator's busiest-rank FLOPs per step over the measured step time), peak reserved memory, and the
   optimizer's phase times (``muon/time_*_ms``). Medians over the logged steps after the first two.
   ``--quick`` trains train_configs/llama3_tiny.toml instead and skips DeepSeek (torchtitan's expert
   parallelism needs a GPU).
Each run's log and torchtitan dump folder go under ``--out`` (default outputs/multi_gpu).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import torch
from common import benchmark_parser, markdown_table, median, write_result

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "AdamW": ["--optimizer.name", "AdamW"],
    "Muon": ["--optimizer.name", "Muon"],
    "Muon+overlap": ["--optimizer.name", "Muon", "--muon.overlap"],
    "Muon+gather_all": ["--optimizer.name", "Muon", "--muon.exchange", "gather_all"],
}
PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, torchtitan's MFU denominator


def torchrun(nproc: int, args: list[str], log: Path) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), *args]
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode


def median_after_warmup(series: list[tuple[int, float]] | None, skip: int = 2) -> float | None:
    if not series:
        return None
    return median([v for _, v in series[skip:]] or [v for _, v in series])


def ns_gflop_per_step(config: str, world: int) -> float:
    """Busiest rank's Newton–Schulz GFLOP per step from the plan simulator (FSDP layout, 5 iterations)."""
    from dtensor_muon.simulate import simulate

    with open(ROOT / config, "rb") as f:
        model = tomllib.load(f)["model"]
    return simulate(f"{model['name']}:{model['flavor']}", [world])[0].ns_gflop_max


def run_torchtitan(config: str, variant: str, gpus: int, steps: int, extra: list[str], out: Path) -> dict:
    from torchtitan_ext.summary import latest_events, scalars

    dump = out / f"{Path(config).stem}_{variant}"
    args = [
        "-m",
        "torchtitan_ext.train",
        "--job.config_file",
        config,
        "--job.dump_folder",
        str(dump),
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        *VARIANTS[variant],
        *extra,
    ]
    code = torchrun(gpus, args, out / f"{dump.name}.log")
    row: dict = {"config": Path(config).stem, "variant": variant, "gpus": gpus, "returncode": code}
    if code != 0:
        return row
    series = scalars(latest_events(dump))
    mfu = median_after_warmup(series.get("mfu(%)"))
    step_s = median_after_warmup(series.get("time_metrics/end_to_end(s)"))
    reserved = series.get("memory/max_reserved(GiB)")
    row.update(
        tokens_per_s=median_after_warmup(series.get("throughput(tps)")),
        mfu_model_pct=mfu,
        step_s=step_s,
        peak_reserved_gib=max(v for _, v in reserved) if reserved else None,
        mfu_with_ns_pct=mfu,
    )
    if variant.startswith("Muon") and step_s:
        if mfu is not None:
            ns = ns_gflop_per_step(config, gpus)
            row["mfu_with_ns_pct"] = mfu + 100 * ns / (step_s * PEAK_BF16_TFLOPS * 1e3)
        row["phases_ms"] = {
            tag.split("/", 1)[1]: median_after_warmup(v) for tag, v in series.items() if tag.startswith("muon/time_")
        }
    return row


def nccl_check(world: int, quick: bool, out: Path) -> dict:
    path = out / f"nccl_ws{world}.json"
    path.unlink(missing_ok=True)
    flags = ["--quick"] if quick else []
    code = torchrun(world, ["bench/nccl_correctness.py", "--json", str(path), *flags], out / f"nccl_ws{world}.log")
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    return {"world_size": world, "returncode": code, "rows": rows}


def main() -> None:
    parser = benchmark_parser(__doc__, "multi_gpu")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2, help="processes per run")
    parser.add_argument(
        "--world-sizes", type=int, nargs="*", default=None, help="NCCL correctness (default 2 4 8 up to --gpus)"
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 20; quick: 4)")
    parser.add_argument(
        "--llama-config",
        default=None,
        help="default train_configs/llama3_8b.toml (quick: train_configs/llama3_tiny.toml)",
    )
    parser.add_argument("--deepseek-config", default="train_configs/deepseek_v3_16b.toml")
    parser.add_argument(
        "--extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="overrides for every torchtitan run (last on the command line)",
    )
    parser.add_argument(
        "--skip",
        nargs="*",
        default=None,
        choices=["nccl", "llama3", "deepseek"],
        help="parts to leave out (quick: deepseek)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "multi_gpu", help="logs and dump folders")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = 4 if args.quick else 20
    if args.llama_config is None:
        args.llama_config = "train_configs/llama3_tiny.toml" if args.quick else "train_configs/llama3_8b.toml"
    if args.skip is None:
        args.skip = ["deepseek"] if args.quick else []
    args.out = args.out.resolve()  # the runs start in the repository root
    args.out.mkdir(parents=True, exist_ok=True)
    nccl = []
    if "nccl" not in args.skip:
        for world in args.world_sizes or [w for w in (2, 4, 8) if w <= args.gpus] or [1]:
            nccl.append(nccl_check(world, args.quick, args.out))

    runs = []
    if "llama3" not in args.skip:
        runs += [(args.llama_config, v, []) for v in VARIANTS]
    if "deepseek" not in args.skip:
        runs += [(args.deepseek_config, v, ["--parallelism.expert_parallel_degree", str(args.gpus)]) for v in VARIANTS]
    rows = []
    for config, variant, parallel in runs:
        row = run_torchtitan(config, variant, args.gpus, args.steps, parallel + args.extra, args.out)
        print(json.dumps(row), flush=True)
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["config"] == row["config"] and r["variant"] == "AdamW"), {})
        if base.get("tokens_per_s") and row.get("tokens_per_s"):
            row["vs_adamw"] = row["tokens_per_s"] / base["tokens_per_s"]

    print(
        markdown_table(
            rows,
            [
                ("config", "config", "{}"),
                ("variant", "variant", "{}"),
                ("gpus", "GPUs", "{}"),
                ("tokens_per_s", "tokens/s", "{:.0f}"),
                ("vs_adamw", "× AdamW", "{:.3f}"),
                ("mfu_model_pct", "MFU model %", "{:.2f}"),
                ("mfu_with_ns_pct", "MFU +NS %", "{:.2f}"),
                ("peak_reserved_gib", "peak GiB", "{:.1f}"),
                ("returncode", "exit", "{}"),
            ],
        )
    )
    checks = [{**r, "returncode": entry["returncode"]} for entry in nccl for r in entry["rows"]]
    checks += [{"world_size": e["world_size"], "returncode": e["returncode"]} for e in nccl if not e["rows"]]
    if checks:
        print(
            markdown_table(
                checks,
                [
                    ("world_size", "ranks", "{}"),
                    ("mode", "mode", "{}"),
                    ("max_rel_update_diff", "max rel diff", "{:.2e}"),
                    ("ok", "ok", "{}"),
                    ("returncode", "exit", "{}"),
                ],
            )
        )
    write_result(args, rows, nccl=nccl)


if __name__ == "__main__":
    main()
