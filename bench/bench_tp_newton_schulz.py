"""Tensor-parallel Newton–Schulz, compute only: what one rank pays besides communication when a 4096×14336 matrix
(Llama3-8B's w1/w3, wide orientation) is split over 2 and 4 ranks along its long side, in the two ways a TP group
can orthogonalize it.

    PYTHONPATH=src python bench/bench_tp_newton_schulz.py                 # GPU: the table, bench/results/tp_newton_schulz.json
    PYTHONPATH=src python bench/bench_tp_newton_schulz.py --quick         # anywhere (CPU too): tiny shapes, seconds

Modes (5 steps of Keller's quintic, bf16 working dtype, fp32 Gaussian input):
- ``duplicated``: every rank runs the whole matrix's Newton–Schulz, as the engine calls it on CUDA
  (:class:`dtensor_muon.linalg.ns_graphs.NewtonSchulzGraphs`: eager above ``MAX_GRAPH_WORK``, which 4096×14336 is; the GPU
  backend in Gram form there). It needs the whole matrix on every rank (an all-gather, not timed here).
- ``distributed``: :func:`dtensor_muon.linalg.distributed_ns.distributed_newton_schulz` on one rank's block (the
  largest, rank 0's) with the all-reduce replaced by nothing: per iteration its block's partial Gram, P = a·I + b·A
  + c·A·A (m³, the same on every rank), P·X_j. The values differ from a real run's (A is the block's alone) but the
  products and their shapes are those a rank runs.
- ``…, graph`` (CUDA only): the same call replayed from one CUDA graph, its launches' host cost paid once.

Columns: ranks, mode, median ms per rank over ``--repeats`` timings after ``--warmup`` calls (CUDA events around
each call on CUDA, wall clock on CPU) with their range; speedup against ``duplicated``; multiply-adds per rank in the
standard form's count (distributed: steps·(2m²·n_j + m³); duplicated: steps·(2m²·n + m³), which the Gram form cuts);
what a rank all-reduces per optimizer step (steps × m²·itemsize of partial Grams, plus the norm's 4 bytes; a ring
all-reduce sends and receives about 2·(k−1)/k times that buffer) and in how many collectives; and, for the
distributed rows, the relative Frobenius difference between the emulated distributed result
(:func:`~dtensor_muon.linalg.distributed_ns.distributed_newton_schulz_blocks`, the all-reduce summed) and the
duplicated one, against ``BF16_TOLERANCE`` of bench/bench_newton_schulz.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from bench_newton_schulz import BF16_TOLERANCE
from common import benchmark_parser, markdown_table, median, write_result
from torch import Tensor

from dtensor_muon.linalg.distributed_ns import distributed_newton_schulz, distributed_newton_schulz_blocks
from dtensor_muon.linalg.ns_graphs import NewtonSchulzGraphs

FULL_SHAPE = (4096, 14336)
QUICK_SHAPE = (64, 256)
STEPS = 5
DTYPE = torch.bfloat16


def time_ms(fn: Callable[[], object], cuda: bool, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of each of ``repeats`` calls after ``warmup`` calls: CUDA events around each call (the GPU
    synchronized before it), or the wall clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def graphed(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
    """``fn`` captured into one CUDA graph (after an eager call that tunes and compiles its kernels); replaying
    it re-reads the same input buffers."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> Tensor:
        graph.replay()
        return out

    return replay


def no_all_reduce(t: Tensor) -> None:
    """The all-reduce replaced by nothing: one rank's compute alone."""


def relative_diff(x: Tensor, reference: Tensor) -> float:
    x64, ref64 = x.to(torch.float64), reference.to(torch.float64)
    return ((x64 - ref64).norm() / ref64.norm()).item()


def measure(shape: tuple[int, int], splits: list[int], cuda: bool, warmup: int, repeats: int) -> list[dict]:
    """The duplicated rows, then per split the distributed rows (rank 0's block, the largest)."""
    m, n = shape
    device = "cuda" if cuda else "cpu"
    g = torch.randn(shape, device=device, dtype=torch.float32, generator=torch.Generator(device).manual_seed(0))
    itemsize = torch.empty((), dtype=DTYPE).element_size()
    engine_ns = NewtonSchulzGraphs()
    duplicated_out = engine_ns(g, steps=STEPS, dtype=DTYPE)
    cases: list[tuple[dict, Callable[[], object]]] = []

    def case(ranks: int, mode: str, fn: Callable[[], object], block_cols: int, **row: object) -> None:
        base = {"ranks": ranks, "mode": mode, "m": m, "n": n, "block_cols": block_cols}
        cases.append(({**base, **row}, fn))

    duplicated = {
        "allreduce_bytes_per_step": 0,
        "collectives_per_step": 0,
        "macs_per_rank": STEPS * (2 * m * m * n + m**3),
    }
    case(1, "duplicated", lambda: engine_ns(g, steps=STEPS, dtype=DTYPE), n, **duplicated)
    if cuda:
        case(1, "duplicated, graph", graphed(lambda: engine_ns(g, steps=STEPS, dtype=DTYPE)), n, **duplicated)
    for k in splits:
        blocks = list(g.tensor_split(k, dim=1))
        block = blocks[0].contiguous()  # rank 0's own memory, as a rank holds it

        def rank0(block: Tensor = block) -> Tensor:
            return distributed_newton_schulz(block, long_dim=1, all_reduce=no_all_reduce, steps=STEPS, dtype=DTYPE)

        emulated = torch.cat(distributed_newton_schulz_blocks(blocks, long_dim=1, steps=STEPS, dtype=DTYPE), dim=1)
        diff = relative_diff(emulated, duplicated_out)
        del emulated
        row = {
            "allreduce_bytes_per_step": STEPS * m * m * itemsize + 4,
            "collectives_per_step": STEPS + 1,
            "macs_per_rank": STEPS * (2 * m * m * block.size(1) + m**3),
            "rel_diff_vs_duplicated": diff,
            "within_bf16_tolerance": diff <= BF16_TOLERANCE,
        }
        case(k, "distributed", rank0, block.size(1), **row)
        if cuda:
            case(k, "distributed, graph", graphed(rank0), block.size(1), **row)
    rows = []
    for row, fn in cases:
        times = time_ms(fn, cuda, warmup, repeats)
        rows.append({**row, "ms": median(times), "ms_min": min(times), "ms_max": max(times), "ms_repeats": times})
    duplicated_ms = rows[0]["ms"]
    for row in rows:
        row["speedup_vs_duplicated"] = duplicated_ms / row["ms"]
        row["allreduce_mib_per_step"] = row["allreduce_bytes_per_step"] / 2**20
        row["gmacs_per_rank"] = row["macs_per_rank"] / 1e9
    return rows


COLUMNS = [
    ("ranks", "ranks", "{}"),
    ("mode", "mode", "{}"),
    ("block_cols", "block", "{}"),
    ("ms", "ms per rank", "{:.3f}"),
    ("ms_min", "min", "{:.3f}"),
    ("ms_max", "max", "{:.3f}"),
    ("speedup_vs_duplicated", "× duplicated", "{:.2f}"),
    ("gmacs_per_rank", "GMAC per rank", "{:.1f}"),
    ("allreduce_mib_per_step", "all-reduce MiB/step", "{:.2f}"),
    ("collectives_per_step", "all-reduces/step", "{}"),
    ("rel_diff_vs_duplicated", "Δ duplicated", "{:.1e}"),
]


def main() -> None:
    parser = benchmark_parser(__doc__, "tp_newton_schulz")
    parser.add_argument(
        "--shape", default=None, help=f"MxN, the wide orientation (default {FULL_SHAPE[0]}x{FULL_SHAPE[1]})"
    )
    parser.add_argument("--splits", default="2,4", help="comma-separated TP sizes to split the long side over")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per case first")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case; the median counts (>= 10)")
    args = parser.parse_args()
    if args.repeats < 10:
        parser.error(f"--repeats must be at least 10, got {args.repeats}")
    cuda = torch.cuda.is_available() and not args.quick
    if args.quick:
        torch.set_num_threads(1)  # tiny matrices: more threads only contend
    shape = tuple(int(v) for v in args.shape.split("x")) if args.shape else (FULL_SHAPE if cuda else QUICK_SHAPE)
    if len(shape) != 2 or shape[0] > shape[1]:
        parser.error(f"--shape must be MxN with M <= N (the long side is split), got {args.shape}")
    splits = [int(v) for v in args.splits.split(",")]
    rows = measure(shape, splits, cuda, args.warmup, args.repeats)  # type: ignore[arg-type]
    print(markdown_table(rows, COLUMNS))
    write_result(args, rows, shape=list(shape), steps=STEPS, dtype=str(DTYPE), bf16_tolerance=BF16_TOLERANCE)
    off = [f"{r['ranks']} {r['mode']}" for r in rows if r.get("within_bf16_tolerance") is False]
    if off:
        print(f"outside the bf16 tolerance {BF16_TOLERANCE:.3f} of duplicated: {', '.join(off)}")


if __name__ == "__main__":
    main()
