"""Newton–Schulz (5 steps of Keller's quintic, bf16 working dtype) on the shapes an optimizer meets: ours, as the
optimizer runs it and eagerly, against plain torch, torch.optim.Muon's Newton–Schulz and Emerging-Optimizers'
(when its package imports).

    PYTHONPATH=src python bench/bench_newton_schulz.py --rounds 3     # GPU: the table, bench/results/newton_schulz.json
    PYTHONPATH=src python bench/bench_newton_schulz.py --quick        # anywhere (CPU too): tiny shapes, seconds
    PYTHONPATH=src python bench/bench_newton_schulz.py --shapes 4096x4096,8x1024x4096 --json ''

Methods:
- ``ours``: :class:`dtensor_muon.linalg.ns_graphs.NewtonSchulzGraphs`, what the optimizer calls on CUDA (replayed from a
  CUDA graph where the dispatch captures one, eager above ``MAX_GRAPH_WORK``);
- ``ours, eager``: :func:`dtensor_muon.linalg.newton_schulz.newton_schulz` called directly;
- ``torch``: the same iteration on plain torch matmuls, batched (the library's torch backend);
- ``torch.optim.Muon``: torch's own ``_zeropower_via_newtonschulz`` (a batch slice by slice, as Muon runs one
  parameter after the other);
- ``Emerging-Optimizers``: its ``newton_schulz`` (Keller's coefficients, its Triton SYRK for 2-D on CUDA).

Columns: median ms over ``--rounds`` rounds (``triton.testing.do_bench`` medians on CUDA, wall clock on CPU; the
methods interleaved, each round starting one method later) and the rounds' range; that rate as % of an 8192³
bf16 matmul timed in the same round (the card runs power-capped, so its clock moves; the SM clock after each
timing is in the JSON), TFLOP/s counted as 5·(4m²n + 2m³) per matrix, m = min dim, for every method alike (an
effective rate: SYRK products and the Gram form do fewer FLOPs, so ours can pass 100%); the output's singular-value range from float64; its relative difference to ``torch`` and whether that is within
``BF16_TOLERANCE``; the host's milliseconds per call with calls enqueued back to back (at or above the GPU time,
the call is host-bound). Inputs are fp32 Gaussian gradients (Emerging-Optimizers requires fp32).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from common import benchmark_parser, markdown_table, write_result
from torch import Tensor

from dtensor_muon.kernels import select_backend, use_backend, use_gram
from dtensor_muon.kernels.shapes import gram_work
from dtensor_muon.linalg.newton_schulz import KELLER_COEFFICIENTS, newton_schulz
from dtensor_muon.linalg.ns_graphs import MAX_GRAPH_WORK, NewtonSchulzGraphs

FULL_SHAPES: list[tuple[int, ...]] = [
    (1024, 4096),
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (8192, 8192),
    (8192, 28672),
    (64, 2048, 1408),
    (8, 1024, 4096),
]
QUICK_SHAPES: list[tuple[int, ...]] = [(48, 96), (96, 48), (3, 40, 64)]
# Two bf16 Newton–Schulz implementations differ by their fp32 sums' order and bf16 roundings, amplified over five
# steps: up to 0.020 relative (8192×28672, H200); ten bf16 unit roundoffs (2⁻⁸ each) bound it with a margin.
BF16_TOLERANCE = 10 * 2**-8

Method = Callable[[Tensor], Tensor]


def ns_flops(shape: tuple[int, ...]) -> float:
    """5·(4m²n + 2m³) per matrix, m = min(rows, cols), n = max."""
    m, n = sorted(shape[-2:])
    batch = shape[0] if len(shape) == 3 else 1
    return batch * 5 * (4 * m * m * n + 2 * m**3)


def sigma_range(x: Tensor) -> tuple[float, float]:
    """(min σ, max σ) over all matrices of x, in float64: σ² are the eigenvalues of the smaller Gram matrix."""
    x64 = x.to(torch.float64)
    if x64.size(-2) > x64.size(-1):
        x64 = x64.mT
    eig = torch.linalg.eigvalsh(x64 @ x64.mT).clamp(min=0).sqrt()
    return eig.min().item(), eig.max().item()


def time_ms(fn: Callable[[], object], cuda: bool) -> float:
    """Median milliseconds: ``triton.testing.do_bench`` on CUDA, three wall-clock runs after one on CPU."""
    if cuda:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def host_ms(fn: Callable[[], object], cuda: bool, calls: int = 20) -> float:
    """Host milliseconds per call: ``calls`` calls enqueued back to back without synchronizing, after a
    synchronized one (on CPU simply the wall time)."""
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    if cuda:
        torch.cuda.synchronize()
    return host


def plain_torch(g: Tensor) -> Tensor:
    """The iteration on plain torch matmuls (batched; for 2-D, torch.optim.Muon's bits)."""
    with use_backend("torch"):
        return newton_schulz(g)


def torch_muon(g: Tensor) -> Tensor:
    """torch.optim.Muon's Newton–Schulz (2-D only: a batch goes slice by slice, as Muon does per parameter)."""
    from torch.optim._muon import _zeropower_via_newtonschulz as zeropower

    if g.ndim == 2:
        return zeropower(g, KELLER_COEFFICIENTS, 5, 1e-7)
    return torch.stack([zeropower(s, KELLER_COEFFICIENTS, 5, 1e-7) for s in g])


def emerging_optimizers(cuda: bool) -> Method | None:
    """Emerging-Optimizers' Newton–Schulz with Keller's coefficients ("simple"), its Triton SYRK for 2-D on CUDA
    (it refuses SYRK for 3-D: batches run its batched plain step); None where the package does not import."""
    try:
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import newton_schulz as eo_newton_schulz
    except ImportError:
        return None

    def run(g: Tensor) -> Tensor:
        return eo_newton_schulz(g, steps=5, coefficient_type="simple", use_syrk=cuda and g.ndim == 2)

    return run


def methods_here(cuda: bool) -> dict[str, Method]:
    """The compared methods by column name, in table order."""
    methods: dict[str, Method] = {
        "ours": NewtonSchulzGraphs(),
        "ours, eager": newton_schulz,
        "torch": plain_torch,
        "torch.optim.Muon": torch_muon,
    }
    eo = emerging_optimizers(cuda)
    if eo is not None:
        methods["Emerging-Optimizers"] = eo
    return methods


def matmul_ceiling_tflops(cuda: bool) -> float:
    """TFLOP/s of an 8192³ bf16 matmul (256³ on CPU), timed like the methods."""
    size = 8192 if cuda else 256
    a = torch.randn(size, size, device="cuda" if cuda else "cpu", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * size**3 / time_ms(lambda: a @ b, cuda) / 1e9


def sm_clock_mhz(cuda: bool) -> int | None:
    """The GPU's SM clock now (through NVML), None where it cannot be read."""
    if not cuda:
        return None
    try:
        return int(torch.cuda.clock_rate())
    except Exception:
        return None


def ours_route(g: Tensor) -> str:
    """How ours runs ``g``: the products' kernels, the form, and whether a CUDA graph replays it."""
    x = g.to(torch.bfloat16)
    x = x.mT if x.size(-2) > x.size(-1) else x
    backend = select_backend(x)
    if backend.name == "torch":
        return "torch matmuls, standard"
    kernels = ("Gluon SYRK" if backend.uses_gluon_syrk(x) else "Triton SYRK") if backend.uses_syrk(x) else "cuBLAS"
    form = "Gram" if use_gram("auto", x, backend, schedule_validated=True) else "standard"
    return f"{kernels}, {form}" + (", graph" if gram_work(x) <= MAX_GRAPH_WORK else "")


def measure_shape(
    shape: tuple[int, ...],
    methods: dict[str, Method],
    cuda: bool,
    rounds: int,
    input_dtype: torch.dtype = torch.float32,
) -> tuple[list[dict], list[float]]:
    """One row per method: accuracy from one call (after a first that tunes, compiles and captures), then
    ``rounds`` timings per method, interleaved, each round also timing the matmul ceiling; the row's % of it is
    the median over rounds of its rate against that round's ceiling. Returns the rows and the ceilings. The input
    is a standard normal G in ``input_dtype`` (bfloat16: what the optimizer's momentum pass hands Newton–Schulz)."""
    torch.manual_seed(0)
    g = torch.randn(shape, device="cuda" if cuda else "cpu", dtype=torch.float32).to(input_dtype)
    reference = plain_torch(g).to(torch.float64)
    eager = newton_schulz(g)
    name = "x".join(map(str, shape))
    route = ours_route(g)
    rows = []
    for method, fn in methods.items():
        fn(g)
        out = fn(g)
        lo, hi = sigma_range(out)
        diff = ((out.to(torch.float64) - reference).norm() / reference.norm()).item()
        rows.append(
            {
                "shape": name,
                "method": method,
                "ours_route": route,
                "sigma_min": lo,
                "sigma_max": hi,
                "rel_diff_vs_torch": diff,
                "within_bf16_tolerance": diff <= BF16_TOLERANCE,
                "same_bits_as_eager": torch.equal(out, eager),
                "ms_rounds": [],
                "sm_mhz_rounds": [],
            }
        )
        del out
    del eager
    ceilings = []
    pairs = list(zip(rows, methods.values()))
    for r in range(rounds):
        ceilings.append(matmul_ceiling_tflops(cuda))
        # Round r starts at method r: a method's time depends on what ran just before it (the power cap holds
        # the clock down after a power-hungry method), so no method keeps one neighbour every round.
        for row, fn in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            row["ms_rounds"].append(time_ms(lambda fn=fn: fn(g), cuda))
            row["sm_mhz_rounds"].append(sm_clock_mhz(cuda))
    torch_ms = None
    for row, fn in pairs:
        row["host_ms"] = host_ms(lambda fn=fn: fn(g), cuda, calls=20 if cuda else 3)
        row["ms"] = statistics.median(row["ms_rounds"])
        row["ms_min"], row["ms_max"] = min(row["ms_rounds"]), max(row["ms_rounds"])
        row["tflops"] = ns_flops(shape) / row["ms"] / 1e9
        row["pct_of_matmul"] = statistics.median(
            100 * ns_flops(shape) / ms / 1e9 / ceiling for ms, ceiling in zip(row["ms_rounds"], ceilings)
        )
        if row["method"] == "torch":
            torch_ms = row["ms"]
    for row in rows:
        row["speedup_vs_torch"] = None if torch_ms is None else torch_ms / row["ms"]
    return rows, ceilings


def syrk_configs() -> dict[str, str]:
    """The Triton SYRK kernel's autotuned config per key (M, K, batch, transposed, TMA mode, epilogue, C)."""
    from dtensor_muon.kernels.triton_syrk import _syrk_tuned

    return {str(key): str(cfg) for key, cfg in _syrk_tuned.cache.items()}


COLUMNS = [
    ("shape", "shape", "{}"),
    ("method", "method", "{}"),
    ("ms", "ms", "{:.3f}"),
    ("ms_min", "min", "{:.3f}"),
    ("ms_max", "max", "{:.3f}"),
    ("speedup_vs_torch", "× torch", "{:.2f}"),
    ("pct_of_matmul", "% of matmul", "{:.1f}"),
    ("sigma_min", "σ min", "{:.3f}"),
    ("sigma_max", "σ max", "{:.3f}"),
    ("rel_diff_vs_torch", "Δ torch", "{:.1e}"),
    ("host_ms", "host ms", "{:.3f}"),
]


def main() -> None:
    parser = benchmark_parser(__doc__, "newton_schulz")
    parser.add_argument("--shapes", default=None, help="comma-separated, e.g. 4096x14336,8x1024x4096")
    parser.add_argument("--rounds", type=int, default=3, help="timings per method, interleaved; the median counts")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    cuda = torch.cuda.is_available() and not args.quick
    if args.quick:
        torch.set_num_threads(1)  # tiny matrices: more threads only contend
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = FULL_SHAPES if cuda else QUICK_SHAPES
    torch.set_float32_matmul_precision("medium")  # Emerging-Optimizers' bf16 path; the others cast to bf16
    methods = methods_here(cuda)
    rows: list[dict] = []
    ceilings: dict[str, list[float]] = {}
    started = time.perf_counter()
    for shape in shapes:
        print(f"[{time.perf_counter() - started:6.1f} s] {shape}", flush=True)
        shape_rows, shape_ceilings = measure_shape(shape, methods, cuda, args.rounds)
        rows += shape_rows
        ceilings["x".join(map(str, shape))] = shape_ceilings
        print(
            f"matmul ceiling in the rounds: {', '.join(f'{c:.3g}' for c in shape_ceilings)} TFLOP/s; "
            f"ours: {shape_rows[0]['ours_route']}",
            flush=True,
        )
        # Written after every shape: a run cut short keeps what it measured.
        write_result(
            args,
            rows,
            ceiling_tflops_rounds=ceilings,
            bf16_tolerance=BF16_TOLERANCE,
            syrk_configs=syrk_configs() if cuda else None,
        )
    print(markdown_table(rows, COLUMNS))
    off = [f"{r['shape']} {r['method']}" for r in rows if not r["within_bf16_tolerance"]]
    if off:
        print(f"outside the bf16 tolerance {BF16_TOLERANCE:.3f} of torch: {', '.join(off)}")


if __name__ == "__main__":
    main()
