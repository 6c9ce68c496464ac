"""The several-GPU run: NCCL correctness and torchtitan throughput of Muon vs AdamW, one script.

    python bench/multi_gpu.py                       # all GPUs of the machine: bench/results/multi_gpu.json
    python bench/multi_gpu.py --quick --backend gloo --nproc 2 --json outputs/multi_gpu/one_gpu.json
                                                    # rehearsal on one GPU: 2 processes share cuda:0 over gloo
    python bench/multi_gpu.py --quick               # without a GPU: 2 gloo processes on CPU, tiny Llama3, 4 steps

1. NCCL correctness: ``bench/nccl_correctness.py`` under torchrun at each world size of ``--world-sizes``
   (owner exchange, gather_all and overlap against the single-GPU result, bf16 tolerance).
2. torchtitan Llama3-8B (FSDP over all GPUs) and DeepSeek-V3-16B (FSDP + expert parallelism over all
   GPUs), each with AdamW, Muon, Muon + overlap and Muon + gather_all (``--variants``), same batch and
   sequence length: tokens/s, MFU counting model FLOPs only (torchtitan's), MFU counting Newton–Schulz FLOPs
   too (the plan simulator's busiest-rank FLOPs per step over the measured step time), peak reserved memory,
   and the optimizer's phase times (``muon/time_*_ms``). Medians over the logged steps after the first two.
   ``--quick`` trains train_configs/llama3_tiny.toml and train_configs/moe_tiny.toml instead, 4 steps; on
   CPU it leaves the MoE out unless ``--skip`` says otherwise (about 8 s a step there).
Each run's log and torchtitan dump folder go under ``--out`` (default outputs/multi_gpu).

Processes, device and backend: ``--nproc`` (alias ``--gpus``) processes per run, ``--device`` cuda (default
where a GPU is visible) or cpu, ``--backend`` nccl (default on cuda: one GPU per process) or gloo (default
on cpu). ``--backend gloo`` on cuda puts every process on ``cuda:0`` (NCCL refuses two ranks on one GPU):
the model, optimizer and collectives' tensors stay on the GPU and gloo copies them through the host, so the
launch, the sharding, expert parallelism and the correctness check are exercised on one GPU before a
several-GPU machine is at hand. Its tokens/s and MFU are those of N processes sharing one GPU over a
host-memory transport, not a throughput figure, and the full-size models do not fit one GPU however many
processes share it: use ``--quick`` (or smaller ``--llama-config``/``--deepseek-config``). A run that is neither ``--quick`` nor
given ``--json`` writes bench/results/multi_gpu_gloo.json over gloo, never multi_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import torch
from common import (
    add_backend_argument,
    benchmark_parser,
    markdown_table,
    median,
    require_gpus_for_nccl,
    settle_backend,
    write_result,
)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "AdamW": ["--optimizer.name", "AdamW"],
    "Muon": ["--optimizer.name", "Muon"],
    "Muon+overlap": ["--optimizer.name", "Muon", "--muon.overlap"],
    "Muon+gather_all": ["--optimizer.name", "Muon", "--muon.exchange", "gather_all"],
}
PEAK_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16, torchtitan's MFU denominator
SHARED_GPU_TRAIN = "--train-on-shared-gpu"
"""``bench/multi_gpu.py --train-on-shared-gpu [torchtitan_ext.train's arguments]``: one process of a torchtitan
run over gloo on ``cuda:0`` (:func:`train_on_shared_gpu`); the script starts these itself under torchrun."""


@dataclass(frozen=True)
class Launch:
    """How every run starts: ``nproc`` processes on ``device`` ("cuda" or "cpu") talking through ``backend``."""

    nproc: int
    device: str
    backend: str

    @property
    def shared_gpu(self) -> bool:
        """Every process on ``cuda:0``, over gloo."""
        return self.device == "cuda" and self.backend == "gloo"

    @property
    def gpus(self) -> int:
        """GPUs the run uses: one per process over NCCL, one shared over gloo, none on CPU."""
        return 0 if self.device == "cpu" else 1 if self.shared_gpu else self.nproc

    def env(self) -> dict[str, str]:
        """The processes' environment: this one's, with no GPU visible for a CPU run."""
        return {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if self.device == "cpu" else dict(os.environ)

    def train(self) -> list[str]:
        """What torchrun starts for a torchtitan run (its arguments follow)."""
        return ["bench/multi_gpu.py", SHARED_GPU_TRAIN] if self.shared_gpu else ["-m", "torchtitan_ext.train"]


def torchrun(nproc: int, args: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Run ``args`` under torchrun on ``nproc`` local processes, output to ``log``; its exit code.

    ``--standalone`` lets the rendezvous take a free port, so runs beside other torchrun jobs on this host (a
    parallel test suite) do not collide on the default 29500."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]
    with open(log, "w") as f:
        return subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env).returncode


def train_on_shared_gpu(argv: list[str]) -> None:
    """One process of a torchtitan run whose processes all share ``cuda:0`` over gloo; started by torchrun.

    torchtitan 0.2.2 puts the process of local rank r on ``cuda:r`` and initializes NCCL. Here every process
    reads local rank 0 (its GPU is ``cuda:0``, and its device meshes are built on it), ``init_process_group``
    takes gloo whatever backend it is asked for, and the change of process-group timeouts after step 1 (a
    barrier, then new timeouts) is skipped, so the groups keep their start-up timeout. FSDP2 reduces with SUM
    on gloo (the train specs of torchtitan_ext do that). Then ``torchtitan_ext.train`` runs with ``argv``, as
    under ``python -m``, and the process leaves as it does.
    """
    import torch.distributed as dist

    # Before torchtitan is imported: its ConfigManager.parse_args takes sys.argv[1:] of import time as default.
    sys.argv = [str(ROOT / "torchtitan_ext" / "train.py"), *argv]
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # torchtitan_ext, run from the repository root
    os.environ["LOCAL_RANK"] = "0"
    torch.cuda.set_device(0)
    init_process_group = dist.init_process_group

    def init_gloo(backend: str | None = None, *args, **kwargs) -> None:
        init_process_group("gloo", *args, **kwargs)

    dist.init_process_group = init_gloo
    from torchtitan.distributed import utils as dist_utils

    from torchtitan_ext import train

    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None
    train.main()


def median_after_warmup(series: list[tuple[int, float]] | None, skip: int = 2) -> float | None:
    if not series:
        return None
    return median([v for _, v in series[skip:]] or [v for _, v in series])


def ns_gflop_per_step(config: str, world: int) -> float | None:
    """Busiest rank's Newton–Schulz GFLOP per step from the plan simulator (FSDP layout, 5 iterations); None
    for a model flavor the simulator does not know."""
    from dtensor_muon.plan.simulate import simulate

    with open(ROOT / config, "rb") as f:
        model = tomllib.load(f)["model"]
    try:
        return simulate(f"{model['name']}:{model['flavor']}", [world])[0].ns_gflop_max
    except ValueError:
        return None


def run_torchtitan(config: str, variant: str, launch: Launch, steps: int, extra: list[str], out: Path) -> dict:
    from torchtitan_ext.summary import latest_events, scalars

    dump = out / f"{Path(config).stem}_{variant}"
    args = [
        *launch.train(),
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
    log = out / f"{dump.name}.log"
    code = torchrun(launch.nproc, args, log, launch.env())
    row: dict = {
        "config": Path(config).stem,
        "variant": variant,
        "ranks": launch.nproc,
        "gpus": launch.gpus,
        "backend": launch.backend,
        "returncode": code,
    }
    if code != 0:
        row["log_tail"] = log.read_text(errors="replace")[-3000:]
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
            ns = ns_gflop_per_step(config, launch.nproc)
            row["mfu_with_ns_pct"] = None if ns is None else mfu + 100 * ns / (step_s * PEAK_BF16_TFLOPS * 1e3)
        row["phases_ms"] = {
            tag.split("/", 1)[1]: median_after_warmup(v) for tag, v in series.items() if tag.startswith("muon/time_")
        }
    return row


def nccl_check(world: int, launch: Launch, quick: bool, out: Path) -> dict:
    path = out / f"nccl_ws{world}.json"
    path.unlink(missing_ok=True)
    flags = ["--device", launch.device, "--backend", launch.backend] + (["--quick"] if quick else [])
    code = torchrun(
        world, ["bench/nccl_correctness.py", "--json", str(path), *flags], out / f"nccl_ws{world}.log", launch.env()
    )
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    return {"world_size": world, "backend": launch.backend, "returncode": code, "rows": rows}


def main() -> None:
    if sys.argv[1:2] == [SHARED_GPU_TRAIN]:
        train_on_shared_gpu(sys.argv[2:])
        return
    parser = benchmark_parser(__doc__, "multi_gpu")
    parser.add_argument(
        "--nproc",
        "--gpus",
        dest="gpus",
        type=int,
        default=None,
        help="processes per run (default: the GPUs over nccl; 2 over gloo)",
    )
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default=None, help="default: cuda where a GPU is visible, else cpu"
    )
    add_backend_argument(parser)
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="*",
        default=None,
        help="correctness check's process counts (default 2 4 8 up to --nproc)",
    )
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 20; quick: 4)")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), help="optimizers to train with"
    )
    parser.add_argument(
        "--llama-config",
        default=None,
        help="default train_configs/llama3_8b.toml (quick: train_configs/llama3_tiny.toml)",
    )
    parser.add_argument(
        "--deepseek-config",
        default=None,
        help="default train_configs/deepseek_v3_16b.toml (quick: train_configs/moe_tiny.toml)",
    )
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
        help="parts to leave out (quick on cpu: deepseek; no names: none)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "multi_gpu", help="logs and dump folders")
    args = parser.parse_args()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    settle_backend(parser, args, "use --device cpu (gloo)")
    if args.gpus is None:
        args.gpus = torch.cuda.device_count() if args.backend == "nccl" else 2
    if args.world_sizes is None:
        args.world_sizes = [w for w in (2, 4, 8) if w <= args.gpus] or [1]
    if args.skip is None:
        args.skip = ["deepseek"] if args.quick and args.device == "cpu" else []
    processes = max([args.gpus, *([] if "nccl" in args.skip else args.world_sizes)])
    require_gpus_for_nccl(parser, args, processes)
    if args.steps is None:
        args.steps = 4 if args.quick else 20
    if args.llama_config is None:
        args.llama_config = "train_configs/llama3_tiny.toml" if args.quick else "train_configs/llama3_8b.toml"
    if args.deepseek_config is None:
        args.deepseek_config = "train_configs/moe_tiny.toml" if args.quick else "train_configs/deepseek_v3_16b.toml"
    launch = Launch(args.gpus, args.device, args.backend)
    args.out = args.out.resolve()  # the runs start in the repository root
    args.out.mkdir(parents=True, exist_ok=True)
    nccl = []
    if "nccl" not in args.skip:
        for world in args.world_sizes:
            nccl.append(nccl_check(world, launch, args.quick, args.out))

    runs = []
    if "llama3" not in args.skip:
        runs += [(args.llama_config, v, []) for v in args.variants]
    if "deepseek" not in args.skip:
        ep = ["--parallelism.expert_parallel_degree", str(args.gpus)]
        runs += [(args.deepseek_config, v, ep) for v in args.variants]
    rows = []
    for config, variant, parallel in runs:
        row = run_torchtitan(config, variant, launch, args.steps, parallel + args.extra, args.out)
        print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
        if "log_tail" in row:
            print(f"{row['config']} {row['variant']} failed; the end of its log:\n{row['log_tail']}", flush=True)
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
                ("ranks", "ranks", "{}"),
                ("gpus", "GPUs", "{}"),
                ("backend", "backend", "{}"),
                ("tokens_per_s", "tokens/s", "{:.0f}"),
                ("vs_adamw", "× AdamW", "{:.3f}"),
                ("mfu_model_pct", "MFU model %", "{:.2f}"),
                ("mfu_with_ns_pct", "MFU +NS %", "{:.2f}"),
                ("peak_reserved_gib", "peak GiB", "{:.1f}"),
                ("returncode", "exit", "{}"),
            ],
        )
    )
    checks = [{**r, "backend": e["backend"], "returncode": e["returncode"]} for e in nccl for r in e["rows"]]
    checks += [
        {"world_size": e["world_size"], "backend": e["backend"], "returncode": e["returncode"]}
        for e in nccl
        if not e["rows"]
    ]
    if checks:
        print(
            markdown_table(
                checks,
                [
                    ("world_size", "ranks", "{}"),
                    ("backend", "backend", "{}"),
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
