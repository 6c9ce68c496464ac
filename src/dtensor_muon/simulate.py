"""Plan simulator: the Muon plan of a torchtitan model under FSDP ``Shard(0)`` at any world size, on CPU.

    python -m dtensor_muon.plan --model llama3:8B --world-size 8 64 512

Builds the model on the meta device (no memory), routes its parameters as :class:`dtensor_muon.Muon`
would, lays every parameter out as FSDP2 does (``Shard(0)`` over all ranks, chunked like ``torch.chunk``),
and prints per world size: per-rank Newton–Schulz GFLOP per step (max and mean, ``ns_steps`` iterations),
the imbalance max/mean, the busiest rank over the plan's lower bound (:attr:`..plan.Plan.lower_bound`, 1.000:
no assignment of these units does better) and over max(mean load, costliest unit), bytes sent and received per rank per step (max), and the estimated time of the
busiest rank at the given TFLOP/s and GB/s.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import asdict, dataclass

import torch

from .layout import ParamLayout, chunk_range
from .plan import Plan, build_plan
from .routing import uses_muon

MODEL_FAMILIES = {
    "llama3": ("torchtitan.models.llama3", "Transformer", "llama3_args"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "DeepSeekV3Model", "deepseekv3_args"),
}


def model_matrix_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the Muon parameters of a torchtitan model named ``family:flavor``."""
    import importlib

    family, _, flavor = model.partition(":")
    if family not in MODEL_FAMILIES:
        raise ValueError(f"--model: unknown family {family!r}; expected one of {sorted(MODEL_FAMILIES)}")
    module_name, class_name, args_name = MODEL_FAMILIES[family]
    module = importlib.import_module(module_name)
    flavors = getattr(module, args_name)
    if flavor not in flavors:
        raise ValueError(f"--model: unknown {family} flavor {flavor!r}; expected one of {sorted(flavors)}")
    args = copy.deepcopy(flavors[flavor])
    if family == "deepseek_v3" and not hasattr(args, "moe_impl"):
        args.moe_impl = "standard"  # what update_from_config sets from torchtitan's default job config
    with torch.device("meta"):
        net = getattr(module, class_name)(args)
    return [(n, tuple(p.shape)) for n, p in net.named_parameters() if uses_muon(n, p, None)]


def fsdp_layout(name: str, shape: tuple[int, ...], world_size: int) -> ParamLayout:
    """The layout FSDP2 gives a parameter: ``Shard(0)`` over ``world_size`` ranks."""
    boxes = []
    for rank in range(world_size):
        box = [(0, s) for s in shape]
        box[0] = chunk_range(0, shape[0], world_size, rank)
        boxes.append(tuple(box))
    return ParamLayout(name, shape, tuple(boxes), 0)


@dataclass
class Summary:
    """What one simulated plan costs per step."""

    model: str
    world_size: int
    matrices: int
    local_matrices: int
    ns_gflop_max: float
    ns_gflop_mean: float
    imbalance: float
    max_over_bound: float
    max_over_simple_bound: float
    bytes_sent_max: float
    bytes_received_max: float
    est_ns_ms: float
    est_comm_ms: float
    plan_seconds: float


def summarize_plan(model: str, plan: Plan, ns_steps: int, tflops: float, gbps: float, seconds: float) -> Summary:
    gflop = [f * ns_steps / 1e9 for f in plan.rank_flops]
    sent_max = max(plan.rank_bytes_sent)
    received_max = max(plan.rank_bytes_received)
    return Summary(
        model=model,
        world_size=plan.world_size,
        matrices=len(plan.routes),
        local_matrices=sum(r.is_local for r in plan.routes),
        ns_gflop_max=max(gflop),
        ns_gflop_mean=sum(gflop) / len(gflop),
        imbalance=plan.imbalance,
        max_over_bound=max(plan.rank_flops) / plan.lower_bound,
        max_over_simple_bound=max(plan.rank_flops) / plan.simple_lower_bound,
        bytes_sent_max=sent_max,
        bytes_received_max=received_max,
        est_ns_ms=max(gflop) / tflops,  # GFLOP / (TFLOP/s) = ms
        est_comm_ms=max(sent_max, received_max) / (gbps * 1e6),
        plan_seconds=seconds,
    )


def simulate(
    model: str,
    world_sizes: list[int],
    ns_steps: int = 5,
    wire_bytes: int = 2,
    bucket_mb: float = 64.0,
    tflops: float = 800.0,
    gbps: float = 50.0,
) -> list[Summary]:
    """Plan ``model`` at each world size; see the module docstring."""
    shapes = model_matrix_shapes(model)
    out = []
    for world in world_sizes:
        start = time.perf_counter()
        layouts = [fsdp_layout(n, s, world) for n, s in shapes]
        plan = build_plan(layouts, list(range(len(layouts))), int(bucket_mb * 2**20), wire_bytes)
        out.append(summarize_plan(model, plan, ns_steps, tflops, gbps, time.perf_counter() - start))
    return out


def format_table(rows: list[Summary]) -> str:
    header = (
        f"{'model':<18}{'ranks':>6}{'matrices':>9}{'local':>7}{'NS GFLOP max':>14}{'mean':>11}"
        f"{'imbal':>7}{'/bound':>8}{'/max(mean,largest)':>19}{'MB sent max':>12}{'MB recv max':>12}{'NS ms':>8}{'comm ms':>9}{'plan s':>8}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.model:<18}{r.world_size:>6}{r.matrices:>9}{r.local_matrices:>7}{r.ns_gflop_max:>14.1f}"
            f"{r.ns_gflop_mean:>11.1f}{r.imbalance:>7.3f}{r.max_over_bound:>8.3f}{r.max_over_simple_bound:>19.3f}"
            f"{r.bytes_sent_max / 1e6:>12.1f}"
            f"{r.bytes_received_max / 1e6:>12.1f}{r.est_ns_ms:>8.2f}{r.est_comm_ms:>9.2f}{r.plan_seconds:>8.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m dtensor_muon.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        help="family:flavor, e.g. llama3:8B, llama3:70B, llama3:405B, deepseek_v3:16B (repeatable)",
    )
    parser.add_argument("--world-size", type=int, nargs="+", required=True)
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument("--wire-bytes", type=int, default=2, help="bytes per element on the wire (bf16: 2)")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--tflops", type=float, default=800.0, help="Newton–Schulz TFLOP/s per rank")
    parser.add_argument("--gbps", type=float, default=50.0, help="all-to-all GB/s per rank")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    for size in args.world_size:
        if size < 1:
            parser.error(f"--world-size must be >= 1, got {size}")
    rows = [
        row
        for model in args.model
        for row in simulate(
            model, args.world_size, args.ns_steps, args.wire_bytes, args.bucket_mb, args.tflops, args.gbps
        )
    ]
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
