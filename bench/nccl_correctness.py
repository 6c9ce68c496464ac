"""NCCL correctness: the engine's distributed result equals the single-GPU result on the same gradients.

    torchrun --nproc_per_node N bench/nccl_correctness.py          # bench/results/nccl_correctness.json
    python bench/nccl_correctness.py --world-size N                # the same, N processes spawned here
    python bench/nccl_correctness.py --quick                       # 2 gloo processes on CPU, tiny shapes

Every rank holds the same full parameters and per-step gradients (seeded), sharded with ``Shard(0)`` over
all ranks (and a 3-D expert parameter, a 3×k matrix with empty shards, AdamW embeddings and norms). Rank 0
also runs the same optimizer on plain tensors. For the owner exchange, gather_all and overlap modes it
reports the max relative difference of every parameter after the steps; the tolerance is bf16 rounding
(the Newton–Schulz matmuls may take different cuBLAS kernels for a batch of another size): 1e-2 relative
on the update, checked as |Δθ_dist − Δθ_single| ≤ 1e-2·|Δθ_single|_max per parameter. Exits 1 when a mode
is outside it. ``--device cpu`` (``--quick``'s) runs the same check over gloo.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import benchmark_parser, markdown_table, write_result
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
    return {n: (p.full_tensor() if mesh is not None else p.detach()) for n, p in named}


def check(args) -> list[dict]:
    """Every mode against the single-process run, on this process's rank; returns the rows."""
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    gen = torch.Generator(device=device).manual_seed(0)
    init = [(n, torch.randn(s, generator=gen, device=device)) for n, s in (QUICK_SHAPES if args.quick else SHAPES)]
    single = run(init, args.steps, None, device)
    rows = []
    for mode, options in MODES:
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
    write_result(args, rows, tolerance=TOLERANCE, device=args.device)


def spawned(rank: int, world: int, init_file: str, args) -> None:
    """A process of ``--world-size`` started by this script (no torchrun)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    ranked(args, f"file://{init_file}")
    exit_without_finalization()  # a spawned child finalizes CPython; gloo can abort it there (README, Limits)


def ranked(args, init_method: str | None = None) -> None:
    rank = int(os.environ.get("RANK", 0))
    if args.device == "cpu":
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = (
        {}
        if init_method is None
        else {"init_method": init_method, "rank": rank, "world_size": int(os.environ["WORLD_SIZE"])}
    )
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", **kwargs)
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
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="processes to spawn when not under torchrun (default: the GPUs; quick: 2)",
    )
    args = parser.parse_args()
    if args.device is None:
        args.device = "cpu" if args.quick else "cuda"
    if "RANK" in os.environ:  # under torchrun
        ranked(args)
        return
    world = args.world_size or (2 if args.quick or args.device == "cpu" else torch.cuda.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(spawned, args=(world, os.path.join(tmp, "init"), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
