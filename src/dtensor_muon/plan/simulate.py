"""Plan simulator: a matrix optimizer's plan of a torchtitan model under FSDP, TP and EP at any world size, on CPU.

    python -m dtensor_muon.plan --model llama3:8B --world-size 8 64 512
    python -m dtensor_muon.plan --model llama3:70B --world-size 512 --tp 8
    python -m dtensor_muon.plan --model deepseek_v3:16B --world-size 64 --ep 8
    python -m dtensor_muon.plan --model qwen3:30B-A3B --world-size 64 --optimizer soap

Builds the model on the meta device (no memory), routes its parameters as the optimizer would, lays every
parameter out as torchtitan 0.2.2 does (chunked like ``torch.chunk``), and plans the matrices with the rule's
declared cost (``--optimizer``: its rule and the defaults of its options table, read from the front end when
the simulator runs; plan/ itself imports no rule):

- dense parameters on the mesh (dp = W/tp, tp): FSDP ``Shard(0)`` over dp, and with ``--tp`` torchtitan's
  tensor-parallel plan (:func:`tensor_parallel_dim`: column-parallel ``Shard(0)``, row-parallel ``wo``/``w2``
  ``Shard(1)``, the MLA down-projections and the router replicated; the AdamW parameters: embedding and
  output ``Shard(0)``, norms replicated; 3-D experts ``Shard(1)``, w2 ``Shard(2)``), FSDP's shard then strided
  over TP's;
- with ``--ep``, 3-D experts on their own mesh (W/ep, ep): ``Shard(0)`` over ep, FSDP over the rest on dim 0
  (strided) or, when W exceeds the expert count, on dim 1, as torchtitan chooses (experts stay replicated
  over tp: the simulator models no expert tensor parallelism).

Each mesh gets its own plan, as in the optimizer, and the per-rank loads add up. It prints per world size: per-rank
planned GFLOP per step (max and mean: the rule's cost, Newton–Schulz's FLOPs for ``ns_steps`` iterations for
Muon, SOAP's operations as TF32-product FLOPs), the imbalance max/mean, the busiest rank over the plan's lower
bound (:attr:`.Plan.lower_bound`, 1.000: no assignment of these units does better) and over max(mean load,
costliest unit), bytes sent and received per rank per step (max), the all-to-alls per step (one out and one
back per bucket of ``--bucket-mb`` of whole matrices: each rank's share of a bucket shrinks as 1/W, so at large
W many small all-to-alls, latency-bound, carry the step; raise ``--bucket-mb`` there), and the estimated time of
the busiest rank at the given TFLOP/s and GB/s (bandwidth only: no per-collective latency); then the optimizer's
memory per rank (:mod:`.memory`, each term's maximum over the ranks in GiB, the largest total of one rank, and
that total with the rank's float32 parameters and gradients).
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..distributed.layout import ParamLayout, TensorParallelLayout, chunk_range, layout_boxes, tensor_parallel_layout
from ..kernels.batching import MAX_BATCH
from ..kernels.low_precision import MOMENTUM_DTYPES
from .builder import UNITS_PER_PARAMETER, build_plan
from .memory import MemoryPeak, MeshPlan, OptimizerMemory, memory_per_rank, peak
from .model import Plan, combined_lower_bounds
from .placement import TensorParallelGroup
from .routing import uses_muon

if TYPE_CHECKING:
    from ..rules.base import MatrixRule

MODEL_FAMILIES = {
    "llama3": ("torchtitan.models.llama3", "Transformer", "llama3_args"),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "DeepSeekV3Model", "deepseekv3_args"),
    "qwen3": ("torchtitan.models.qwen3", "Qwen3Model", "qwen3_args"),
}

FRONT_ENDS: dict[str, tuple[type, dict[str, Any], int]] = {}
"""``--optimizer`` name → the front-end class (its ``rule``), a param group of its option defaults and its default
wire dtype's bytes. The front ends sit above plan/, which imports none of them: :mod:`dtensor_muon.optim`
registers each (:func:`register_front_end`) when the package is imported, as ``python -m dtensor_muon.plan`` does
first."""


def register_front_end(front_end: type, defaults: dict[str, Any], wire_bytes: int) -> None:
    """Make a front-end class known to the simulator as ``--optimizer`` its lower-case name: :data:`FRONT_ENDS`."""
    FRONT_ENDS[front_end.__name__.lower()] = (front_end, dict(defaults), wire_bytes)


ParamShapes = list[tuple[str, tuple[int, ...], bool]]
"""(name, shape, routed to the matrix rule) of each parameter of a model."""


def model_parameters(model: str, layers: int | None = None) -> ParamShapes:
    """(name, shape, uses the matrix rule) of every parameter of a torchtitan model named ``family:flavor``;
    ``layers``: only its first that many layers (a cut-down model)."""
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
    if layers is not None:
        if not 1 <= layers <= args.n_layers:
            raise ValueError(f"layers: expected 1 to {args.n_layers} for {model}, got {layers}")
        args.n_layers = layers
    if family == "deepseek_v3" and not hasattr(args, "moe_impl"):
        args.moe_impl = "standard"  # what update_from_config sets from torchtitan's default job config
    with torch.device("meta"):
        net = getattr(module, class_name)(args)
    return [(n, tuple(p.shape), uses_muon(n, p, None)) for n, p in net.named_parameters()]


def model_matrix_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the matrix-rule parameters of a torchtitan model named ``family:flavor``."""
    return [(name, shape) for name, shape, matrix in model_parameters(model) if matrix]


def optimizer_rule(name: str, ns_steps: int = 5) -> tuple[MatrixRule, dict[str, Any], int]:
    """The rule of front end ``name`` (:data:`FRONT_ENDS`), a param group of its defaults (``ns_steps`` for
    Newton–Schulz's) and its default wire dtype's bytes."""
    if name not in FRONT_ENDS:
        raise ValueError(f"--optimizer: expected one of {sorted(FRONT_ENDS)}, got {name!r}")
    front_end, defaults, wire_bytes = FRONT_ENDS[name]
    group = dict(defaults)
    if "ns_steps" in group:
        group["ns_steps"] = ns_steps
    return front_end.rule, group, wire_bytes


def fsdp_layout(name: str, shape: tuple[int, ...], world_size: int) -> ParamLayout:
    """The layout FSDP2 gives a parameter: ``Shard(0)`` over ``world_size`` ranks."""
    boxes = []
    for rank in range(world_size):
        box = [(0, s) for s in shape]
        box[0] = chunk_range(0, shape[0], world_size, rank)
        boxes.append(tuple(box))
    return ParamLayout(name, shape, tuple(boxes), 0)


ROW_PARALLEL = ("wo", "w2")
"""Modules torchtitan's plans make ``RowwiseParallel`` (weight ``Shard(1)``)."""
NOT_TENSOR_PARALLEL = ("wq_a", "wkv_a", "gate")
"""Modules torchtitan's plans leave replicated over tp (MLA down-projections, the MoE router)."""


def tensor_parallel_dim(name: str, shape: tuple[int, ...]) -> int | None:
    """The dim torchtitan's tensor-parallel plan shards a 2-D weight on (None: replicated over tp)."""
    if len(shape) != 2:
        return None
    module = name.removesuffix(".weight").rsplit(".", 1)[-1]
    if module in NOT_TENSOR_PARALLEL:
        return None
    return 1 if module in ROW_PARALLEL else 0


def dense_placements(name: str, shape: tuple[int, ...], tp: int) -> tuple[Placement, ...]:
    """FSDP over dp, then (with tp > 1) TP, as torchtitan lays out a dense parameter on (dp, tp); 3-D experts
    without expert parallelism take torchtitan's expert ``TensorParallel`` (w1, w3 ``Shard(1)``, w2
    ``Shard(2)``) under FSDP's ``Shard(0)``."""
    if tp == 1:
        return (Shard(0),)
    if len(shape) == 3:
        return (Shard(0), Shard(2 if name.endswith("w2") else 1))
    dim = tensor_parallel_dim(name, shape)
    if dim is None:
        return (Shard(0), Replicate())
    if dim == 0:
        return (_StridedShard(0, split_factor=tp), Shard(0))
    return (Shard(0), Shard(dim))


def expert_placements(shape: tuple[int, ...], world_size: int, ep: int) -> tuple[Placement, ...]:
    """3-D experts on (W/ep, ep): ``Shard(0)`` over ep; FSDP on dim 1 when W exceeds the experts, else dim 0."""
    if world_size > shape[0]:
        return (Shard(1), Shard(0))
    return (_StridedShard(0, split_factor=ep), Shard(0))


def mesh_layout(name: str, shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements) -> ParamLayout:
    """A parameter's layout over a mesh of ``mesh_shape`` (mesh ranks = global ranks, row-major)."""
    return ParamLayout(name, shape, layout_boxes(name, shape, mesh_shape, tuple(placements)), 0)


CostFn = Callable[[int, tuple[int, int]], tuple[int, ...]]
"""``build_plan``'s ``cost_fn``: (parameter position, matrix shape) → (planned cost, owner-state bytes, shared)."""


def plan_model(
    params: ParamShapes,
    world: int,
    *,
    bucket_bytes: int,
    wire_itemsize: int,
    cost_fn: CostFn,
    batchable: bool,
    tp: int = 1,
    ep: int = 1,
    tp_mode: str = "owned",
    max_batch: int = MAX_BATCH,
    units_per_parameter: int = UNITS_PER_PARAMETER,
) -> tuple[list[MeshPlan], list[ParamLayout]]:
    """The plans of the matrix-rule parameters of ``params`` (one per mesh, see the module docstring) and the
    layouts of the AdamW parameters, at world size ``world``, in units of :func:`..builder.group_units`'s
    ``max_batch`` and ``units_per_parameter``."""
    if world % tp or world % ep:
        raise ValueError(f"world size {world} is not a multiple of --tp {tp} and --ep {ep}")
    dense_mesh = (world // tp, tp) if tp > 1 else (world,)
    groups: dict[tuple, list[tuple[ParamLayout, tuple[str, TensorParallelLayout] | None]]] = {}
    adamw = []
    for name, shape, matrix in params:
        if not matrix:
            adamw.append(mesh_layout(name, shape, dense_mesh, dense_placements(name, shape, tp)))
            continue
        choice = None
        if ep > 1 and len(shape) == 3:
            mesh_shape, placements = (world // ep, ep), expert_placements(shape, world, ep)
        else:
            mesh_shape, placements = dense_mesh, dense_placements(name, shape, tp)
            dim = tensor_parallel_dim(name, shape)
            if tp > 1 and dim is not None and tp_mode != "owned":
                choice = (tp_mode, tensor_parallel_layout(shape, mesh_shape, 1, dim))
        groups.setdefault(mesh_shape, []).append((mesh_layout(name, shape, mesh_shape, placements), choice))
    meshes = []
    load = [0] * world  # every mesh here spans all ranks: each plan balances the sum with the earlier ones
    for members in groups.values():
        layouts = [layout for layout, _ in members]
        plan = build_plan(
            layouts,
            list(range(len(members))),
            bucket_bytes,
            wire_itemsize,
            batchable=[batchable] * len(members),
            cost_fn=cost_fn,
            tensor_parallel=[choice for _, choice in members],
            max_batch=max_batch,
            units_per_parameter=units_per_parameter,
            base_load=load,
        )
        load = [a + b for a, b in zip(load, plan.rank_flops)]
        meshes.append(MeshPlan(plan, dict(enumerate(layouts))))
    return meshes, adamw


@dataclass
class Summary:
    """What one simulated configuration costs per step (loads of every mesh's plan added per rank) and holds."""

    model: str
    world_size: int
    tp: int
    ep: int
    tp_mode: str
    optimizer: str
    momentum_dtype: str
    offload: str
    matrices: int
    local_matrices: int
    distributed_matrices: int
    duplicated_matrices: int
    ns_gflop_max: float
    ns_gflop_mean: float
    imbalance: float
    max_over_bound: float
    max_over_simple_bound: float
    bytes_sent_max: float
    bytes_received_max: float
    exchanges: int
    """All-to-alls per step: one out and one back per bucket of every plan (owned and tensor-parallel)."""
    est_ns_ms: float
    est_comm_ms: float
    plan_seconds: float
    memory: MemoryPeak
    """The optimizer's memory per rank (:mod:`.memory`; bytes)."""


def _add(per_plan: list[list[int]]) -> list[int]:
    return [sum(values) for values in zip(*per_plan)]


def _tensor_parallel_matrices(plans: list[Plan], distributed: bool) -> int:
    return sum(
        len(u.members)
        for plan in plans
        for u in plan.units
        if isinstance(u.placement, TensorParallelGroup) and u.placement.distributed == distributed
    )


def summarize_plans(
    model: str,
    plans: list[Plan],
    tp: int,
    ep: int,
    tp_mode: str,
    tflops: float,
    gbps: float,
    seconds: float,
    memory: MemoryPeak,
    optimizer: str = "muon",
    momentum_dtype: str = "float32",
    offload: str = "none",
) -> Summary:
    """One row for the plans of one configuration (plans over the same ranks, each balanced with the loads
    of the ones before: :func:`plan_model`); the bounds are of all their units placed as one plan."""
    flops = _add([plan.rank_flops for plan in plans])
    gflop = [f / 1e9 for f in flops]
    sent_max = max(_add([plan.rank_bytes_sent for plan in plans]))
    received_max = max(_add([plan.rank_bytes_received for plan in plans]))
    mean = sum(flops) / len(flops)
    bound, simple = combined_lower_bounds(plans)
    return Summary(
        model=model,
        world_size=plans[0].world_size,
        tp=tp,
        ep=ep,
        tp_mode=tp_mode,
        optimizer=optimizer,
        momentum_dtype=momentum_dtype,
        offload=offload,
        matrices=sum(len(plan.routes) for plan in plans),
        local_matrices=sum(r.is_local for plan in plans for r in plan.routes),
        distributed_matrices=_tensor_parallel_matrices(plans, True),
        duplicated_matrices=_tensor_parallel_matrices(plans, False),
        ns_gflop_max=max(gflop),
        ns_gflop_mean=sum(gflop) / len(gflop),
        imbalance=max(flops) / mean if mean > 0 else 1.0,
        max_over_bound=max(flops) / bound if bound > 0 else 1.0,
        max_over_simple_bound=max(flops) / simple if simple > 0 else 1.0,
        bytes_sent_max=sent_max,
        bytes_received_max=received_max,
        exchanges=sum(2 * (len(plan.buckets) + len(plan.tensor_parallel_buckets)) for plan in plans),
        est_ns_ms=max(gflop) / tflops,  # GFLOP / (TFLOP/s) = ms
        est_comm_ms=max(sent_max, received_max) / (gbps * 1e6),
        plan_seconds=seconds,
        memory=memory,
    )


def simulate(
    model: str,
    world_sizes: list[int],
    ns_steps: int = 5,
    wire_bytes: int | None = None,
    bucket_mb: float = 64.0,
    tflops: float = 800.0,
    gbps: float = 50.0,
    tp: int = 1,
    ep: int = 1,
    tp_mode: str = "owned",
    *,
    optimizer: str = "muon",
    momentum_dtype: str = "float32",
    cuda_graphs: bool = True,
    max_batch: int = MAX_BATCH,
    units_per_parameter: int = UNITS_PER_PARAMETER,
    offload: str = "none",
) -> list[Summary]:
    """Plan ``model`` for ``optimizer`` at each world size with tensor-parallel degree ``tp``, expert-parallel
    degree ``ep`` and the dense matrices' ``tp_mode`` (owned, duplicated, distributed or auto), and model its
    memory with the momentum buffer in ``momentum_dtype`` and ``offload`` ("none" or "host"); ``wire_bytes`` None: the optimizer's default wire
    dtype; ``max_batch``, ``units_per_parameter``: the unit sizes (:func:`..builder.group_units`). See the module
    docstring."""
    rule, group, default_wire = optimizer_rule(optimizer, ns_steps)
    wire = default_wire if wire_bytes is None else wire_bytes
    spec = OptimizerMemory.from_rule(
        rule,
        group,
        wire,
        momentum_dtype=momentum_dtype,
        cuda_graphs=cuda_graphs,
        offload=offload == "host",
        bucket_bytes=int(bucket_mb * 2**20),
    )
    params = model_parameters(model)
    out = []
    for world in world_sizes:
        start = time.perf_counter()
        meshes, adamw = plan_model(
            params,
            world,
            bucket_bytes=int(bucket_mb * 2**20),
            wire_itemsize=wire,
            cost_fn=lambda k, shape: rule.cost(group, shape).plan_entry(),
            batchable=rule.can_batch(group),
            tp=tp,
            ep=ep,
            tp_mode=tp_mode,
            max_batch=max_batch,
            units_per_parameter=units_per_parameter,
        )
        seconds = time.perf_counter() - start
        memory = peak(memory_per_rank(meshes, adamw, spec, world))
        plans = [mesh.plan for mesh in meshes]
        out.append(
            summarize_plans(
                model, plans, tp, ep, tp_mode, tflops, gbps, seconds, memory, optimizer, momentum_dtype, offload
            )
        )
    return out


def format_table(rows: list[Summary]) -> str:
    header = (
        f"{'model':<18}{'ranks':>6}{'tp':>4}{'ep':>4}{'tp_mode':>12}{'matrices':>9}{'local':>7}{'dist':>6}{'dup':>5}{'GFLOP max':>14}{'mean':>11}"
        f"{'imbal':>7}{'/bound':>8}{'/max(mean,largest)':>19}{'MB sent max':>12}{'MB recv max':>12}{'all-to-alls':>12}"
        f"{'NS ms':>8}{'comm ms':>9}{'plan s':>8}"
    )
    lines = [header]
    for r in rows:
        lines.append(
            f"{r.model:<18}{r.world_size:>6}{r.tp:>4}{r.ep:>4}{r.tp_mode:>12}{r.matrices:>9}{r.local_matrices:>7}"
            f"{r.distributed_matrices:>6}{r.duplicated_matrices:>5}{r.ns_gflop_max:>14.1f}"
            f"{r.ns_gflop_mean:>11.1f}{r.imbalance:>7.3f}{r.max_over_bound:>8.3f}{r.max_over_simple_bound:>19.3f}"
            f"{r.bytes_sent_max / 1e6:>12.1f}"
            f"{r.bytes_received_max / 1e6:>12.1f}{r.exchanges:>12}{r.est_ns_ms:>8.2f}{r.est_comm_ms:>9.2f}"
            f"{r.plan_seconds:>8.2f}"
        )
    return "\n".join(lines)


MEMORY_COLUMNS = (
    ("shard", "shard_state"),
    ("adamw", "adamw_state"),
    ("owner", "owner_state"),
    ("exchange", "exchange"),
    ("NS work", "ns_workspace"),
    ("graphs", "cuda_graphs"),
    ("staging", "offload_staging"),
    ("optimizer", "optimizer"),
    ("params+grads", "params_grads"),
    ("sum", "with_params_grads"),
    ("host", "host_state"),
)
"""The memory table's columns (header, :class:`.memory.MemoryPeak` field)."""


def format_memory_table(rows: list[Summary]) -> str:
    """The optimizer's memory per rank, GiB: each term's maximum over the ranks, the largest optimizer total of
    one rank, the largest parameters and gradients, the largest sum of both on one rank, and the host memory
    of offloaded state."""
    header = f"{'model':<18}{'ranks':>6}{'tp':>4}{'ep':>4}{'optimizer':>10}{'momentum':>10}{'offload':>8}" + "".join(
        f"{title:>13}" for title, _ in MEMORY_COLUMNS
    )
    lines = [f"optimizer memory per rank, GiB (max over ranks)\n{header}"]
    for r in rows:
        cells = "".join(f"{getattr(r.memory, key) / 2**30:>13.3f}" for _, key in MEMORY_COLUMNS)
        lines.append(
            f"{r.model:<18}{r.world_size:>6}{r.tp:>4}{r.ep:>4}{r.optimizer:>10}{r.momentum_dtype:>10}{r.offload:>8}"
            f"{cells}"
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
    parser.add_argument("--optimizer", default="muon", choices=sorted(FRONT_ENDS), help="the matrix optimizer")
    parser.add_argument(
        "--momentum-dtype", default="float32", choices=MOMENTUM_DTYPES, help="storage of Muon/NorMuon/MOP's momentum"
    )
    parser.add_argument(
        "--offload",
        default="none",
        choices=("none", "host"),
        help="where the momentum and AdamW moments live (the optimizer's offload)",
    )
    parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="owners run Newton–Schulz eagerly (ns_cuda_graphs=False)"
    )
    parser.add_argument("--ns-steps", type=int, default=5)
    parser.add_argument(
        "--wire-bytes", type=int, help="bytes per element on the wire (default: the optimizer's wire dtype)"
    )
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--tflops", type=float, default=800.0, help="Newton–Schulz TFLOP/s per rank")
    parser.add_argument("--gbps", type=float, default=50.0, help="all-to-all GB/s per rank")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (torchtitan's TP plan)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree (3-D experts over ep ranks)")
    parser.add_argument(
        "--tp-mode",
        default="owned",
        choices=("owned", "duplicated", "distributed", "auto"),
        help="how the TP-sharded matrices are computed (Muon's tp_mode)",
    )
    parser.add_argument(
        "--max-batch", type=int, default=MAX_BATCH, help="most matrices in one unit (the engine plans with the default)"
    )
    parser.add_argument(
        "--units-per-parameter",
        type=int,
        default=UNITS_PER_PARAMETER,
        help="fewest units a parameter's batchable matrices form (the engine plans with the default)",
    )
    parser.add_argument("--json", help="also write the rows (memory in bytes) to this JSON file")
    args = parser.parse_args(argv)
    for label, value in (("--max-batch", args.max_batch), ("--units-per-parameter", args.units_per_parameter)):
        if value < 1:
            parser.error(f"{label} must be >= 1, got {value}")
    for size in args.world_size:
        if size < 1:
            parser.error(f"--world-size must be >= 1, got {size}")
        if size % args.tp or size % args.ep:
            parser.error(f"--world-size {size} must be a multiple of --tp {args.tp} and --ep {args.ep}")
    rows = [
        row
        for model in args.model
        for row in simulate(
            model,
            args.world_size,
            args.ns_steps,
            args.wire_bytes,
            args.bucket_mb,
            args.tflops,
            args.gbps,
            args.tp,
            args.ep,
            args.tp_mode,
            optimizer=args.optimizer,
            momentum_dtype=args.momentum_dtype,
            cuda_graphs=not args.no_cuda_graphs,
            max_batch=args.max_batch,
            units_per_parameter=args.units_per_parameter,
            offload=args.offload,
        )
    ]
    print(format_table(rows))
    print()
    print(format_memory_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
