"""The optimizer's memory model (dtensor_muon.plan.memory) against what a step really holds, per rank.

    python bench/memory.py --device cuda --world-size 2 --model llama3:8B --layers 2   # NCCL, one GPU per rank
    python bench/memory.py --device cuda --world-size 1 --model qwen3:30B-A3B --layers 1
    python bench/memory.py --device cuda --world-size 1 --model qwen3:30B-A3B --layers 1 --offload host
    python bench/memory.py --device cuda --backend gloo --world-size 4 --overlap   # 4 ranks sharing one GPU
    python bench/memory.py --quick                                                     # 2 gloo ranks on CPU

A cut-down torchtitan model (its first ``--layers`` layers, the simulator's shapes and routing) laid out as
FSDP2 lays it (``Shard(0)`` over the ranks, float32 shards built from local pieces, no whole tensor), random
gradients, ``--optimizer`` with its defaults. Per rank it prints the model's terms next to the measurement:

- state: the bytes of the optimizer's state (``nbytes`` of each local tensor: the rule's shard state, AdamW's
  and the owner state), on any device; with ``--offload host`` the offloaded tensors and their spares are the
  host state (the model's ``host_state``), and the device terms keep the rest;
- on CUDA, from ``torch.cuda.memory_allocated``/``max_memory_allocated``: the growth over the first step that
  stays after it (the model's ``cuda_graphs``: the graphs' buffers, and whatever else a first step keeps), and
  the peak of a later step over what was allocated when it began (the model's ``exchange`` + ``ns_workspace``
  + ``offload_staging``); with ``--overlap`` also what a step leaves allocated when it returns, which the next
  forward's hooks release (the update buffers and the return exchanges in flight).

On CUDA the ranks take one GPU each over NCCL, or, with ``--backend gloo``, share one GPU (each process's
allocator is its own, so each rank's figures are its own; the exchanges then run through gloo).
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import benchmark_parser, markdown_table, write_result
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from dtensor_muon import exit_without_finalization
from dtensor_muon.distributed.layout import box_shape
from dtensor_muon.engine.offload import offloaded_keys
from dtensor_muon.kernels.batching import units_per_stack
from dtensor_muon.kernels.low_precision import MOMENTUM_DTYPES
from dtensor_muon.plan.memory import OptimizerMemory, memory_per_rank
from dtensor_muon.plan.simulate import FRONT_ENDS, fsdp_layout, model_parameters, optimizer_rule, plan_model

GIB = 2**30


def local_dtensor(shape: tuple[int, ...], world: int, rank: int, mesh, device: torch.device) -> DTensor:
    """A ``Shard(0)`` DTensor of ``shape`` over ``mesh`` built from this rank's random piece alone."""
    piece = torch.randn(box_shape(fsdp_layout("", shape, world).boxes[rank]), device=device) * 0.02
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(piece, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)


def state_bytes(opt: torch.optim.Optimizer, offload: str) -> dict[str, int]:
    """Bytes of the optimizer's state on this rank: the rule's shard state, AdamW's, the owner state, and with
    offload the host state (offloaded tensors and the spares the engine keeps beside them)."""
    held = {"shard_state": 0, "adamw_state": 0, "owner_state": 0, "host_state": 0}
    if offload == "host":
        held["host_state"] = sum(t.nbytes for t in opt._engine.offload._spares.values())

    def nbytes(t: torch.Tensor) -> int:
        return (t.to_local() if isinstance(t, DTensor) else t).nbytes

    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state[p].items():
                if key == "owner_state":
                    held["owner_state"] += sum(nbytes(t) for matrix in value.values() for t in matrix.values())
                elif offload == "host" and key in offloaded_keys(opt.rule, group):
                    held["host_state"] += nbytes(value)
                else:
                    held["shard_state" if group["use_muon"] else "adamw_state"] += nbytes(value)
    return held


def modelled(args, world: int) -> list[dict[str, int]]:
    """The memory model's terms of every rank for this run."""
    rule, group, wire = optimizer_rule(args.optimizer)
    meshes, adamw = plan_model(
        model_parameters(args.model, args.layers),
        world,
        bucket_bytes=int(64.0 * 2**20),
        wire_itemsize=wire,
        cost_fn=lambda k, shape: rule.cost(group, shape).plan_entry(),
        batchable=rule.can_batch(group),
    )
    spec = OptimizerMemory.from_rule(
        rule,
        group,
        wire,
        momentum_dtype=args.momentum_dtype,
        cuda_graphs=args.device == "cuda",
        offload=args.offload == "host",
        units_per_stack=units_per_stack(torch.device(args.device)),
    )
    return [vars(r) | {"optimizer": r.optimizer} for r in memory_per_rank(meshes, adamw, spec, world)]


def worker(rank: int, world: int, init_file: str, out_dir: str, args) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    shared = args.backend == "gloo"
    if cuda:
        torch.cuda.set_device(0 if shared else rank)
    dist.init_process_group(
        args.backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    device = torch.device("cuda", 0 if shared else rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    shapes = model_parameters(args.model, args.layers)
    params = [(name, nn.Parameter(local_dtensor(shape, world, rank, mesh, device))) for name, shape, _ in shapes]
    options = {} if args.momentum_dtype == "float32" else {"momentum_dtype": args.momentum_dtype}
    opt = FRONT_ENDS[args.optimizer][0](params, lr=1e-3, offload=args.offload, overlap=args.overlap, **options)
    if args.overlap:
        holder = nn.Module()
        for i, (_, p) in enumerate(params):
            holder.register_parameter(f"p{i}", p)
        opt.attach(holder)
    allocated = []  # before the first step, after it, before the second
    peaks = []
    for _ in range(2):
        base = torch.cuda.memory_allocated() if cuda else 0  # before the gradients
        for _, p in params:
            p.grad = local_dtensor(tuple(p.shape), world, rank, mesh, device)
        if cuda:
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated())
            torch.cuda.reset_peak_memory_stats()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
            allocated.append(torch.cuda.memory_allocated())
        for _, p in params:
            p.grad = None
        if args.overlap and cuda:
            kept = torch.cuda.memory_allocated() - base  # the step's leftovers, gradients freed
        opt.flush()
    row = {"rank": rank, **state_bytes(opt, args.offload)}
    if cuda:
        row["first_step_kept"] = allocated[1] - allocated[0]
        row["step_peak"] = peaks[1] - allocated[2]
        if args.overlap:
            row["kept_into_forward"] = kept
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()
    exit_without_finalization()  # a spawned child finalizes CPython; gloo can abort it there (docs/limits.md)


def main() -> None:
    parser = benchmark_parser(__doc__, "memory")
    parser.add_argument("--model", default=None, help="family:flavor (default llama3:8B; quick: llama3:debugmodel)")
    parser.add_argument("--layers", type=int, default=None, help="the model's first layers only (default 2)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--optimizer", default="muon", choices=sorted(FRONT_ENDS))
    parser.add_argument("--momentum-dtype", default="float32", choices=MOMENTUM_DTYPES)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--offload", choices=["none", "host"], default="none", help="the optimizer's offload")
    parser.add_argument("--overlap", action="store_true", help="overlap=True: also what a step leaves for the forward")
    parser.add_argument(
        "--backend", choices=["nccl", "gloo"], default=None, help="CUDA: nccl (a GPU per rank, the default) or gloo"
    )
    args = parser.parse_args()
    if args.model is None:
        args.model = "llama3:debugmodel" if args.quick else "llama3:8B"
    if args.layers is None:
        args.layers = 2
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    if args.backend == "nccl" and torch.cuda.device_count() < args.world_size:
        parser.error(f"NCCL takes one GPU per rank: {args.world_size} ranks, {torch.cuda.device_count()} GPUs")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.world_size, os.path.join(tmp, "init"), tmp, args), nprocs=args.world_size)
        measured = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(args.world_size)]
    rows = []
    for rank, (got, model) in enumerate(zip(measured, modelled(args, args.world_size))):
        row = {"rank": rank, **{f"model_{k}": v for k, v in model.items()}, **{f"held_{k}": v for k, v in got.items()}}
        row["model_step"] = model["exchange"] + model["ns_workspace"] + model["offload_staging"]
        rows.append({k: (v / GIB if k != "rank" and isinstance(v, int) else v) for k, v in row.items()})
    print(
        f"{args.model}, {args.layers} layers, {args.world_size} ranks, {args.optimizer}, {args.momentum_dtype} "
        f"momentum, offload {args.offload}, {args.device} (GiB)"
    )
    columns = [("rank", "rank", "{}")]
    for term in ("shard_state", "adamw_state", "owner_state", "host_state"):
        columns += [(f"model_{term}", f"{term} model", "{:.4f}"), (f"held_{term}", "held", "{:.4f}")]
    columns += [
        ("model_cuda_graphs", "graphs model", "{:.4f}"),
        ("held_first_step_kept", "first step kept", "{:.4f}"),
        ("model_step", "exchange+NS+staging model", "{:.4f}"),
        ("held_step_peak", "step peak", "{:.4f}"),
        *(
            [("held_kept_into_forward", "kept into forward", "{:.4f}")]
            if args.overlap and args.device == "cuda"
            else []
        ),
    ]
    print(markdown_table(rows, columns))
    write_result(args, rows)


if __name__ == "__main__":
    main()
