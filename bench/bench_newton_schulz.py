"""Newton–Schulz (5 Keller steps, bf16) side by side: plain torch, torch.optim.Muon, Emerging-Optimizers, ours
(as dispatched, replayed from CUDA graphs as the optimizer runs it, forced to the standard and the Gram
form, with the Triton SYRK kernel in place of the warp-specialized Gluon one, with that one's consumers
passing the turn at a tile's end as before the twelfth session, and with the Gluon kernel only from 2³⁶
multiply-adds per product as before the thirteenth (eager and from graphs); and, replayed from graphs, in the
standard form and with the SYRK kernels at every size, in the dispatched and the Gram form).

    python bench/bench_newton_schulz.py                 # on a GPU: the full table, JSON to --out
    python bench/bench_newton_schulz.py --quick         # anywhere (CPU too): tiny shapes, smoke check
    python bench/bench_newton_schulz.py --methods standard,gram --shapes 2048x5632   # a subset

Columns: median ms over ``--rounds`` rounds (each a triton.testing.do_bench median on CUDA, wall clock on
CPU; the methods interleaved round by round) and the rounds' range; TFLOP/s counted as
5·(4m²n + 2m³) per matrix with m = min dim (the plain-matmul FLOPs, for every method alike); that rate
as % of an 8192³ bf16 matmul timed in the same round (the card runs power-capped, its clock moving with its
state; the SM clock after each timing is in the JSON); the output's singular-value range (min σ, max σ)
from float64 (eigenvalues of the float64 Gram matrix, i.e. squared singular values); the relative
difference to plain torch's output; whether the output has the same bits as ours (eager); and the host's
milliseconds per call with calls enqueued back to back (at or above the GPU time, the call is host-bound: its
time is the host's, and moves with it). Inputs are fp32 gradients (Emerging-Optimizers requires fp32).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from dtensor_muon.kernels import select_backend, use_backend, use_gram, ws_syrk
from dtensor_muon.newton_schulz import KELLER_COEFFICIENTS, newton_schulz
from dtensor_muon.ns_graphs import NewtonSchulzGraphs

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

Method = Callable[[Tensor], Tensor]


def ns_flops(shape: tuple[int, ...]) -> float:
    """5·(4m²n + 2m³) per matrix, m = min(rows, cols), n = max."""
    m, n = sorted(shape[-2:])
    batch = shape[0] if len(shape) == 3 else 1
    return batch * 5 * (4 * m * m * n + 2 * m**3)


def sigma_range(x: Tensor) -> tuple[float, float]:
    """(min σ, max σ) over all matrices of x, in float64: σ² are the eigenvalues of the smaller Gram."""
    x64 = x.to(torch.float64)
    if x64.size(-2) > x64.size(-1):
        x64 = x64.mT
    eig = torch.linalg.eigvalsh(x64 @ x64.mT).clamp(min=0).sqrt()
    return eig.min().item(), eig.max().item()


def time_ms(fn: Callable[[], object], cuda: bool) -> float:
    """Median milliseconds: do_bench on CUDA, a few wall-clock runs on CPU."""
    if cuda:
        import triton.testing

        return float(
            triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
        )
    fn()
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def host_ms(fn: Callable[[], object], cuda: bool, calls: int = 20) -> float:
    """Host milliseconds per call: ``calls`` calls enqueued back to back without synchronizing, after a
    synchronized one. Where it reaches the GPU time the call waits on its own launches, so its time is the
    host's and moves with the host's speed (on CPU it is simply the wall time)."""
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


def torch_muon(g: Tensor) -> Tensor:
    """torch.optim.Muon's own NS (2-D only: a batch goes slice by slice, as Muon does per parameter)."""
    from torch.optim._muon import _zeropower_via_newtonschulz as zp

    if g.ndim == 2:
        return zp(g, KELLER_COEFFICIENTS, 5, 1e-7)
    return torch.stack([zp(s, KELLER_COEFFICIENTS, 5, 1e-7) for s in g])


def emerging_optimizers() -> tuple[Method, str] | None:
    """Emerging-Optimizers 0.3.0 NS with its Triton SYRK (2-D; it refuses SYRK for 3-D, so batches run
    its batched plain step), under float32 matmul precision "medium" (its bf16 path)."""
    try:
        from emerging_optimizers.orthogonalized_optimizers.muon_utils import (
            newton_schulz as eo_ns,
        )
    except ImportError:
        return None

    def run(g: Tensor) -> Tensor:
        return eo_ns(g, steps=5, coefficient_type="simple", use_syrk=g.ndim == 2)

    return run, "EO 0.3.0 SYRK (3-D: plain batched)"


def plain_torch(g: Tensor) -> Tensor:
    with use_backend("torch"):
        return newton_schulz(g)


def ours_standard(g: Tensor) -> Tensor:
    return newton_schulz(g, algorithm="standard")


def ours_gram(g: Tensor) -> Tensor:
    return newton_schulz(g, algorithm="gram")


def ours_triton_syrk(g: Tensor) -> Tensor:
    with ws_syrk.ws_syrk_enabled(False):
        return newton_schulz(g)


def ours_turn_at_end(g: Tensor) -> Tensor:
    """Ours with the Gluon kernel's consumers passing the turn after a tile's last K slice (``TURN_LEAD`` 0, as
    before the twelfth session)."""
    lead, ws_syrk.TURN_LEAD = ws_syrk.TURN_LEAD, 0
    try:
        return newton_schulz(g)
    finally:
        ws_syrk.TURN_LEAD = lead


class Graphs:
    """Ours replayed from CUDA graphs in the given algorithm, with the backend forced to ``backend`` (None: as
    dispatched; "syrk": the SYRK kernels for every product, whatever the size)."""

    def __init__(self, algorithm: str, backend: str | None = None) -> None:
        self.algorithm = algorithm
        self.backend = backend
        self.graphs = NewtonSchulzGraphs()

    def __call__(self, g: Tensor) -> Tensor:
        if self.backend is None:
            return self.graphs(g, algorithm=self.algorithm)
        with use_backend(self.backend):
            return self.graphs(g, algorithm=self.algorithm)


class WsFrom2To36:
    """Ours (eager, or replayed from graphs) with the Gluon kernel only for products of at least 2³⁶
    multiply-adds (``WS_MIN_WORK`` as before the thirteenth session), the Triton kernel below: the
    dispatch of the twelfth session, whose SYRK and Gram floors were the Triton kernel's below 2³⁶."""

    def __init__(self, graphs: bool) -> None:
        self.run = NewtonSchulzGraphs() if graphs else newton_schulz

    def __call__(self, g: Tensor) -> Tensor:
        floor, ws_syrk.WS_MIN_WORK = ws_syrk.WS_MIN_WORK, 2**36
        try:
            return self.run(g)
        finally:
            ws_syrk.WS_MIN_WORK = floor


METHOD_KEYS = ("torch", "muon", "eo", "ours", "graphs", "standard", "gram", "triton", "turn-at-end", "ws-from-2^36",
               "ws-from-2^36-graphs", "standard-graphs", "syrk-graphs", "syrk-gram-graphs")


def select_methods(keys: str, cuda: bool) -> dict[str, Method]:
    """The methods named by comma-separated ``keys`` (METHOD_KEYS), in table order, by their column name;
    EO only on CUDA with its wheel installed."""
    wanted = set(keys.split(","))
    methods: dict[str, Method] = {}
    if "torch" in wanted:
        methods["torch NS5"] = plain_torch
    if "muon" in wanted:
        methods["torch.optim.Muon"] = torch_muon
    eo = emerging_optimizers() if cuda and "eo" in wanted else None
    if eo is not None:
        methods[eo[1]] = eo[0]
    if "ours" in wanted:
        methods["ours"] = newton_schulz
    if "graphs" in wanted:
        methods["ours, CUDA graphs"] = NewtonSchulzGraphs()
    if "standard" in wanted:
        methods["ours, standard form"] = ours_standard
    if "gram" in wanted:
        methods["ours, Gram form"] = ours_gram
    if "triton" in wanted:
        methods["ours, Triton SYRK"] = ours_triton_syrk
    if "turn-at-end" in wanted:
        methods["ours, turn at the tile's end"] = ours_turn_at_end
    if "ws-from-2^36" in wanted:
        methods["ours, Gluon from 2^36"] = WsFrom2To36(graphs=False)
    if "ws-from-2^36-graphs" in wanted:
        methods["ours, Gluon from 2^36, CUDA graphs"] = WsFrom2To36(graphs=True)
    if "standard-graphs" in wanted:
        methods["ours, standard form, CUDA graphs"] = Graphs("standard")
    if "syrk-graphs" in wanted:
        methods["ours, SYRK at every size, CUDA graphs"] = Graphs("auto", "syrk")
    if "syrk-gram-graphs" in wanted:
        methods["ours, SYRK at every size, Gram form, CUDA graphs"] = Graphs("gram", "syrk")
    return methods


def matmul_ceiling_tflops(cuda: bool) -> float:
    """TFLOP/s of an 8192³ bf16 matmul (512³ on CPU), timed like the methods."""
    size = 8192 if cuda else 512
    a = torch.randn(size, size, device="cuda" if cuda else "cpu", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    return 2 * size**3 / time_ms(lambda: a @ b, cuda) / 1e9


def sm_clock_mhz(cuda: bool) -> int | None:
    """The GPU's SM clock now (through NVML), None where it cannot be read. Under sustained matmuls the
    H200 here runs power-capped: 1.4–1.5 GHz instead of 1.98 (nvidia-smi's throttle reason "SW power
    cap"), so times move with the card's state; the clock after each timing is recorded beside it."""
    if not cuda:
        return None
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 (NVML's own errors derive from Exception): the clock is unknown, the timing counts
        return None


def bench_shape(
    shape: tuple[int, ...], methods: dict[str, Method], device: str, rounds: int
) -> tuple[list[dict], list[float]]:
    """One row per method: accuracy from one call, then ``rounds`` timings per method, the methods
    interleaved round by round, each round starting one method later (the GPU's clock drifts as it heats:
    4096² measured 2.22 and 2.62 ms with one config minutes apart), and the median of the rounds. Each
    round also times the 8192³ matmul ceiling; a row's % of it is the median over rounds of its rate
    against the same round's ceiling.
    Returns the rows and the ceilings of the rounds."""
    torch.manual_seed(0)
    g = torch.randn(shape, device=device, dtype=torch.float32)
    cuda = device == "cuda"
    rows = []
    reference = plain_torch(g).to(torch.float64)
    ours = newton_schulz(g)
    for name, fn in methods.items():
        fn(g)  # a first call tunes, compiles and (CUDA graphs) captures: the second is the steady state
        out = fn(g)
        lo, hi = sigma_range(out)
        diff = ((out.to(torch.float64) - reference).norm() / reference.norm()).item()
        rows.append(
            {
                "shape": "x".join(map(str, shape)),
                "method": name,
                "sigma_min": lo,
                "sigma_max": hi,
                "rel_diff_vs_torch": diff,
                "same_bits_as_ours": torch.equal(out, ours),
                "ms_rounds": [],
                "sm_mhz_rounds": [],
            }
        )
        del out
    del ours
    ceilings = []
    pairs = list(zip(rows, methods.values()))
    for r in range(rounds):
        ceilings.append(matmul_ceiling_tflops(cuda))
        # Round r starts at method r: a method's time depends on what ran just before it (the power cap
        # holds the clock down after a power-hungry method), so no method keeps one neighbour every round.
        for row, fn in pairs[r % len(pairs) :] + pairs[: r % len(pairs)]:
            row["ms_rounds"].append(time_ms(lambda fn=fn: fn(g), cuda))
            row["sm_mhz_rounds"].append(sm_clock_mhz(cuda))
    for row, fn in pairs:
        row["host_ms"] = host_ms(lambda fn=fn: fn(g), cuda)
    for row in rows:
        row["ms"] = statistics.median(row["ms_rounds"])
        row["tflops"] = ns_flops(shape) / row["ms"] / 1e9
        row["pct_of_matmul"] = statistics.median(
            100 * ns_flops(shape) / ms / 1e9 / ceiling for ms, ceiling in zip(row["ms_rounds"], ceilings)
        )
    working = g.to(torch.bfloat16)
    working = working.mT if working.size(-2) > working.size(-1) else working
    backend = select_backend(working)
    form = "gram" if use_gram("auto", working, backend, schedule_validated=True) else "standard"
    for row in rows:
        row["ours_backend"] = f"{backend.name}/{form}"
    return rows, ceilings


def syrk_configs() -> dict[str, str]:
    """The autotuned SYRK config per key (M, K, batch, transposed, TMA, fused C)."""
    from dtensor_muon.kernels.triton_syrk import _syrk_tuned

    return {str(key): str(cfg) for key, cfg in _syrk_tuned.cache.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes (runs on CPU)"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="write the rows as JSON here"
    )
    parser.add_argument(
        "--shapes", default=None, help="comma-separated, e.g. 4096x14336,8x1024x4096"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="timings per method, interleaved; the median is reported"
    )
    parser.add_argument(
        "--methods", default=",".join(METHOD_KEYS), help=f"comma-separated subset of {','.join(METHOD_KEYS)}"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    unknown = set(args.methods.split(",")) - set(METHOD_KEYS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; expected a subset of {list(METHOD_KEYS)}")
    cuda = torch.cuda.is_available() and not args.quick
    device = "cuda" if cuda else "cpu"
    torch.set_float32_matmul_precision(
        "medium"
    )  # Emerging-Optimizers' bf16 path; the others cast to bf16
    methods = select_methods(args.methods, cuda)
    if not methods:
        parser.error(f"--methods: none of {args.methods!r} is available here")
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = FULL_SHAPES if cuda else QUICK_SHAPES
    result = {
        "device": torch.cuda.get_device_name()
        if cuda
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "rows": [],
        "ceiling_rounds": {},
    }
    if cuda:
        import triton

        result["triton"] = triton.__version__
    rows = result["rows"]
    started = time.perf_counter()
    for shape in shapes:
        print(f"[{time.perf_counter() - started:6.1f} s] {shape}", flush=True)
        shape_rows, ceilings = bench_shape(shape, methods, device, args.rounds)
        rows += shape_rows
        result["ceiling_rounds"]["x".join(map(str, shape))] = ceilings
        print(f"matmul ceiling in the rounds: {', '.join(f'{c:.0f}' for c in ceilings)} TFLOP/s", flush=True)
        for row in rows[-len(methods) :]:
            print(
                f"{row['shape']:>14} {row['method']:<38} {row['ms']:9.3f} ms "
                f"[{min(row['ms_rounds']):.3f}–{max(row['ms_rounds']):.3f}] {row['tflops']:7.1f} TFLOP/s "
                f"{row['pct_of_matmul']:5.1f}%  σ [{row['sigma_min']:.3f}, {row['sigma_max']:.3f}] "
                f"Δtorch {row['rel_diff_vs_torch']:.1e} same bits {row['same_bits_as_ours']!s:5} "
                f"host {row['host_ms']:.3f} ms ours→{row['ours_backend']}",
                flush=True,
            )
        if cuda:
            result["syrk_configs"] = syrk_configs()
        # Written after every shape: a run cut short keeps what it measured.
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
