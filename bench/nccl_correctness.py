"""NCCL correctness: the engine's distributed result equals the single-GPU result on the same gradients.

    torchrun --nproc_per_node N bench/nccl_correctness.py          # bench/results/nccl_correctness.json
    python bench/nccl_correctness.py --world-size N                # the same, N processes spawned here
    python bench/nccl_correctness.py --backend gloo --nproc 2      # 2 processes sharing cuda:0 over gloo
    python bench/nccl_correctness.py --quick                       # 2 gloo processes on CPU, tiny shapes

Every rank holds the same full parameters and per-step gradients (seeded), sharded with ``Shard(0)`` over
all ranks (and a 3-D expert parameter, a 3×k matrix with empty shards, AdamW embeddings and norms). Rank 0
also runs the same optimizer on plain tensors. For the owner exchange, gather_all and overlap modes it
reports the max relative difference of every parameter after the steps; the tolerance is bf16 rounding
(the Newton–Schulz matmuls may take different cuBLAS kernels for a batch of another size): 1e-2 relative
on the update, checked as |Δθ_dist − Δθ_single| ≤ 1e-2·|Δθ_single|_max per parameter. Exits 1 when a mode
is outside it. ``--device cpu`` (``--quick``'s) runs the same check over gloo.

NCCL takes one GPU per process. ``--backend gloo`` on CUDA puts every process on ``cuda:0`` instead and talks
through gloo (which copies CUDA tensors through the host), so N ranks can be checked on a one-GPU machine
before a several-GPU one is at hand; the DTensors, meshes and Newton–Schulz stay on the GPU. ``--nproc`` is
another name for ``--world-size``. A gloo run that is neither ``--quick`` nor given ``--json`` writes
bench/results/nccl_correctness_gloo.json, never nccl_correctness.json.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (
    add_backend_argument,
    benchmark_parser,
    markdown_table,
    require_gpus_for_nccl,
    settle_backend,
    write_result,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from dtensor_muon import Muon, exit_without_finalization

SHAPES = [
    ("tok_embeddings.weight", (1000, 256)),
    ("layers.0.wq", (256, 256)),
    ("layers.0.w1", (704, 256)),
    ("layers.0.w2", (256, 704)),
    ("layers.0.tiny", (3, 256)),
    ("layers.0.experts", (8, 256, 128)),
    ("layers.0.norm.weight", (256,)),
    ("layers.1.wq", (256, 256)),
    ("output.weight", (1000, 256)),
]
QUICK_SHAPES = [
    ("tok_embeddings.weight", (64, 16)),
    ("layers.0.wq", (16, 16)),
    ("layers.0.w1", (48, 16)),
    ("layers.0.w2", (16, 48)),
    ("layers.0.tiny", (1, 16)),
    ("layers.0.experts", (4, 16, 8)),
    ("layers.0.norm.weight", (16,)),
    ("layers.1.wq", (16, 16)),
    ("output.weight", (64, 16)),
]
TOLERANCE = 1e-2
MODES = [("owner", {}), ("gather_all", {"exchange": "gather_all"}), ("overlap", {"overlap": True})]


def run(
    params: list[tuple[str, torch.Tensor]], steps: int, mesh, device: torch.device, **options
) -> dict[str, torch.Tensor]:
    model = nn.Module()
    named = []
    for name, value in params:
        p = nn.Parameter(distribute_tensor(value, mesh, [Shard(0)]) if mesh is not None else value.clone())
        model.register_parameter(name.replace(".", "_"), p)
        named.append((name, p))
    opt = Muon(named, lr=0.02, **options)
    if options.get("overlap"):
        opt.attach(model)
    for step in range(steps):
        gen = torch.Generator(device=device).manual_seed(step)
        for _, p in named:
            g = torch.randn(p.shape, generator=gen, device=device)
            p.grad = distribute_tensor(g, mesh, [Shard(0)]) if mesh is not None else g
        opt.step()
    opt.flush()
    return {n: (whole(p) if mesh is not None else p.detach()) for n, p in named}


def whole(p: torch.Tensor) -> torch.Tensor:
    """The whole of a ``Shard(0)`` DTensor over every rank. Over gloo with CUDA tensors the pieces travel as
    CPU objects: DTensor's own all-gather (``full_tensor``) of CUDA tensors over gloo crashes in torch 2.11."""
    if dist.get_backend() != "gloo" or p.device.type != "cuda":
        return p.full_tensor()
    pieces: list[torch.Tensor | None] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, p.to_local().cpu())
    return torch.cat(pieces).to(p.device)


def modes_for(args) -> list[tuple[str, dict]]:
    """The modes to check: all of :data:`MODES`, but ``gather_all`` over gloo on CUDA, where its
    ``full_tensor()`` (DTensor's all-gather of CUDA tensors over gloo) crashes the process in torch 2.11."""
    shared_gpu = args.backend == "gloo" and args.device == "cuda"
    return [(mode, options) for mode, options in MODES if not (shared_gpu and mode == "gather_all")]


def check(args) -> list[dict]:
    """Every mode against the single-process run, on this process's rank; returns the rows."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    gen = torch.Generator(device=device).manual_seed(0)
    init = [(n, torch.randn(s, generator=gen, device=device)) for n, s in (QUICK_SHAPES if args.quick else SHAPES)]
    single = run(init, args.steps, None, device)
    rows = []
    for mode, options in modes_for(args):
        dist_result = run(init, args.steps, mesh, device, **options)
        worst = 0.0
        for name, start in init:
            delta_single = single[name] - start
            delta_dist = dist_result[name] - start
            rel = ((delta_dist - delta_single).abs().max() / delta_single.abs().max().clamp(min=1e-30)).item()
            worst = max(worst, rel)
        rows.append({"mode": mode, "world_size": world, "max_rel_update_diff": worst, "ok": worst <= TOLERANCE})
    return rows


def report(args, rows: list[dict]) -> None:
    print(
        markdown_table(
            rows,
            [
                ("mode", "mode", "{}"),
                ("world_size", "ranks", "{}"),
                ("max_rel_update_diff", "max rel diff", "{:.2e}"),
                ("ok", "ok", "{}"),
            ],
        )
    )
    write_result(args, rows, tolerance=TOLERANCE, device=args.device, backend=args.backend)


def spawned(rank: int, world: int, init_file: str, args) -> None:
    """A process of ``--world-size`` started by this script (no torchrun)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    ranked(args, f"file://{init_file}")
    exit_without_finalization()  # a spawned child finalizes CPython; gloo can abort it there (docs/limits.md)


def cuda_index(args) -> int:
    """This process's GPU: its local rank over NCCL, ``cuda:0`` for every process over gloo (one GPU shared)."""
    return 0 if args.backend == "gloo" else int(os.environ.get("LOCAL_RANK", 0))


def ranked(args, init_method: str | None = None) -> None:
    rank = int(os.environ.get("RANK", 0))
    if args.device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(cuda_index(args))
        torch.cuda.init()  # the device mesh then keeps this device instead of choosing cuda:LOCAL_RANK
    kwargs = (
        {}
        if init_method is None
        else {"init_method": init_method, "rank": rank, "world_size": int(os.environ["WORLD_SIZE"])}
    )
    dist.init_process_group(args.backend, **kwargs)
    rows = check(args)
    if rank == 0:
        report(args, rows)
    dist.destroy_process_group()
    if not all(r["ok"] for r in rows):
        raise SystemExit(1)


def main() -> None:
    parser = benchmark_parser(__doc__, "nccl_correctness")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda (quick: cpu)")
    add_backend_argument(parser)
    parser.add_argument(
        "--world-size",
        "--nproc",
        type=int,
        default=None,
        help="processes to spawn when not under torchrun (default: the GPUs over nccl; 2 over gloo)",
    )
    args = parser.parse_args()
    if args.device is None:
        args.device = "cpu" if args.quick else "cuda"
    settle_backend(parser, args, "use --device cpu (gloo), or --quick")
    if "RANK" in os.environ:  # under torchrun
        ranked(args)
        exit_without_finalization()
    world = args.world_size or (torch.cuda.device_count() if args.backend == "nccl" else 2)
    require_gpus_for_nccl(parser, args, world)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(spawned, args=(world, os.path.join(tmp, "init"), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
