"""The several-GPU run: NCCL correctness and torchtitan throughput of Muon vs AdamW, one script.

    python bench/multi_gpu.py --out bench/results/multi_gpu              # all GPUs of the machine
    python bench/multi_gpu.py --gpus 2 --skip nccl deepseek --steps 4 \
        --llama-config train_configs/llama3_tiny.toml                     # rehearsal on CPU (gloo)

1. NCCL correctness: ``bench/nccl_correctness.py`` under torchrun at each world size of ``--world-sizes``
   (owner exchange, gather_all and overlap against the single-GPU result, bf16 tolerance).
2. torchtitan Llama3-8B (FSDP over all GPUs) and DeepSeek-V3-16B (FSDP + expert parallelism over all
   GPUs), each with AdamW, Muon, Muon + overlap and Muon + gather_all, same batch and sequence length:
   tokens/s, MFU counting model FLOPs only (torchtitan's), MFU counting Newton–Schulz FLOPs too (the plan
   simulator's busiest-rank FLOPs per step over the measured step time), peak reserved memory, and the
   optimizer's phase times (``muon/time_*_ms``). Medians over the logged steps after the first two.
Writes ``runs.json`` and ``table.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

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
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode


def median_after_warmup(series: list[tuple[int, float]], skip: int = 2) -> float | None:
    values = [v for _, v in series[skip:]] or [v for _, v in series]
    return statistics.median(values) if values else None


def ns_gflop_per_step(config: str, world: int) -> float:
    """Busiest rank's Newton–Schulz GFLOP per step from the plan simulator (FSDP layout, 5 iterations)."""
    from dtensor_muon.simulate import simulate

    with open(config, "rb") as f:
        model = tomllib.load(f)["model"]
    return simulate(f"{model['name']}:{model['flavor']}", [world])[0].ns_gflop_max


def run_torchtitan(config: str, variant: str, gpus: int, steps: int, extra: list[str], out: Path) -> dict:
    from torchtitan_ext.summary import latest_events, scalars

    dump = out / f"{Path(config).stem}_{variant}"
    args = ["-m", "torchtitan_ext.train", "--job.config_file", config, "--job.dump_folder", str(dump),
            "--training.steps", str(steps), "--metrics.log_freq", "1",
            *VARIANTS[variant], *extra]
    code = torchrun(gpus, args, out / f"{dump.name}.log")
    row: dict = {"config": config, "variant": variant, "gpus": gpus, "returncode": code}
    if code != 0:
        return row
    series = scalars(latest_events(dump))
    tps = median_after_warmup(series["throughput(tps)"])
    mfu = median_after_warmup(series["mfu(%)"])
    step_s = median_after_warmup(series["time_metrics/end_to_end(s)"])
    row.update(tokens_per_s=tps, mfu_model_pct=mfu, step_s=step_s,
               peak_reserved_gib=max(v for _, v in series["memory/max_reserved(GiB)"]))
    if variant.startswith("Muon") and step_s:
        ns = ns_gflop_per_step(config, gpus)
        row["mfu_with_ns_pct"] = mfu + 100 * ns / (step_s * PEAK_BF16_TFLOPS * 1e3)
        row["phases_ms"] = {tag.split("/", 1)[1]: median_after_warmup(v) for tag, v in series.items()
                            if tag.startswith("muon/time_")}
    else:
        row["mfu_with_ns_pct"] = mfu
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2, help="processes per run")
    parser.add_argument("--world-sizes", type=int, nargs="*", default=None, help="NCCL correctness (default 2 4 8)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--llama-config", default="train_configs/llama3_8b.toml")
    parser.add_argument("--deepseek-config", default="train_configs/deepseek_v3_16b.toml")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="overrides for every torchtitan run (last on the command line)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["nccl", "llama3", "deepseek"])
    parser.add_argument("--out", type=Path, default=Path("bench/results/multi_gpu"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (gloo)"
    report: dict = {"gpus": args.gpus, "device": device, "nccl": [], "torchtitan": []}

    if "nccl" not in args.skip:
        for world in args.world_sizes or [w for w in (2, 4, 8) if w <= args.gpus] or [1]:
            path = args.out / f"nccl_ws{world}.json"
            code = torchrun(world, ["bench/nccl_correctness.py", "--json", str(path)], args.out / f"nccl_ws{world}.log")
            rows = json.loads(path.read_text()) if path.exists() else []
            report["nccl"].append({"world_size": world, "returncode": code, "rows": rows})

    runs = []
    if "llama3" not in args.skip:
        runs += [(args.llama_config, v, []) for v in VARIANTS]
    if "deepseek" not in args.skip:
        runs += [(args.deepseek_config, v, ["--parallelism.expert_parallel_degree", str(args.gpus)]) for v in VARIANTS]
    for config, variant, parallel in runs:
        row = run_torchtitan(config, variant, args.gpus, args.steps, parallel + args.extra, args.out)
        print(json.dumps(row), flush=True)
        report["torchtitan"].append(row)

    lines = ["| config | variant | GPUs | tokens/s | × AdamW | MFU model % | MFU +NS % | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["torchtitan"]:
        base = next((r for r in report["torchtitan"] if r["config"] == row["config"] and r["variant"] == "AdamW"), {})
        ratio = (row.get("tokens_per_s") or 0) / base["tokens_per_s"] if base.get("tokens_per_s") else float("nan")
        lines.append(f"| {Path(row['config']).stem} | {row['variant']} | {row['gpus']} | "
                     f"{row.get('tokens_per_s', float('nan')):.0f} | {ratio:.3f} | {row.get('mfu_model_pct', float('nan')):.2f} | "
                     f"{row.get('mfu_with_ns_pct', float('nan')):.2f} | {row.get('peak_reserved_gib', float('nan')):.1f} |")
    for entry in report["nccl"]:
        for r in entry["rows"]:
            lines.append(f"NCCL ws {r['world_size']} {r['mode']}: max rel diff {r['max_rel_update_diff']:.2e} ok={r['ok']}")
    table = "\n".join(lines)
    print(table)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "runs.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
