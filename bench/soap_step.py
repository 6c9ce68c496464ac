"""The SOAP optimizer step on Llama3-8B's matrices, on one device, per phase, side by side with Muon: the work
of one rank computing every matrix, and of the slowest rank of each optimizer's plan at 8 and at 64 ranks.

    PYTHONPATH=src python bench/soap_step.py                         # Llama3-8B, 16 layers: 112 matrices
    PYTHONPATH=src python bench/soap_step.py --variants SOAP KLSOAP REKLS --world-sizes 1 8 64 512
    PYTHONPATH=src python bench/soap_step.py --layers 4 --variants SOAP SOAP-cholqr --float32-matmul-precision high
    PYTHONPATH=src python bench/soap_step.py --quick                 # tiny shapes on CPU, under a minute

Matrices: the Muon-routed parameters of the torchtitan Llama3 8B model's first ``--layers`` layers (per layer
wq 4096×4096, wk and wv 1024×4096, wo 4096×4096, w1 and w3 14336×4096, w2 4096×14336; the shapes come from
``optimizer_step.parameter_shapes``), fp32, with fixed-seed random values and gradients (the same gradient at
every step). ``--quick`` takes torchtitan's debugmodel flavor shrunk to width 64 (optimizer_step's), 2
layers, and ``max_preconditioner_dim`` 128, so that its 192-long MLP side is left unpreconditioned as the
8B model's 14336-long one is by the default 8192.

Matrix sets (``--world-sizes``, default 1 8 64). At world size 1 one rank computes every matrix. At W > 1,
every matrix is laid out as FSDP2 lays it (``Shard(0)`` over W ranks, ``dtensor_muon.plan.simulate.fsdp_layout``)
and planned by ``dtensor_muon.plan.build_plan`` with each optimizer's own rule cost, as its engine plans it
(``MatrixCost.planned``: for SOAP each operation's FLOPs weighted by its measured rate, ``SOAPRule.cost``;
``--plan-by flops`` plans nominal FLOPs instead, ``--plan-by planned flops`` both, one after the other).
Every rank's set (the matrices it computes, ``Plan.computed_by``; ranks whose matrices have the same shapes
share one) is allocated and timed, on one device with no process group: what that rank computes per step,
without the exchange. The slowest rank is
the one whose step takes longest, and each optimizer's row is its own plan's slowest rank: SOAP's against
Muon's (``dtensor_muon.Muon`` defaults: momentum 0.95, Nesterov, 5 bf16 Newton–Schulz iterations), each with
the set its plan gives.

Variants (``--variants``; default SOAP, SOAP-cholqr and REKLS): ``dtensor_muon.SOAP`` (Shampoo factors, one
power iteration + Householder QR per refresh), ``SOAP-cholqr`` (``dtensor_muon.SOAP(basis="cholqr")``: the
power iteration orthogonalized by Cholesky QR on matrix products, :mod:`dtensor_muon.linalg.eigenbasis`), ``KLSOAP``
(KL-Shampoo factors, QR) and ``REKLS`` (KL-Shampoo factors, eigh per refresh), with the front ends' defaults:
betas (0.9, 0.95), shampoo_beta 0.95, precondition_frequency ``--precondition-frequency`` (default 1: the basis
is refreshed every step), max_preconditioner_dim 8192. SOAP's factor, projection and rotation products run in
float32 at torch's default precision ("highest": no TF32) unless ``--float32-matmul-precision high`` is given
(SOAP-cholqr's refresh products run in float32-accurate split TF32 and its first Gram matrix in TF32 on CUDA
either way); Muon's Newton–Schulz runs in bf16 either way.

heavyball's SOAP (``heavyball.SOAP`` 3.x, eager: ``heavyball.utils.compile_mode = None``), when importable and
unless ``--no-heavyball``: on the one-rank set only (it has no owner per matrix: under FSDP2 every rank
computes every matrix, so its per-rank step is the one-rank step), at the same settings: lr 3e-3, betas
(0.9, 0.95), shampoo_beta 0.95, eps 1e-8, weight_decay 0.1, the same precondition frequency, max_precond_dim
8192 (the same sides left unpreconditioned), no schedule for the frequency, ``consume_grad`` off (it keeps the
gradient as ours do, so every timed step has one). Step ms and memory only (its phases are not separable).

Measured, per (set, optimizer), after ``--warmup`` untimed steps (so SOAP's first-step eigh, Muon's CUDA-graph
captures and the allocator's warm-up are not counted), medians over ``--repeats`` steady-state steps:

- step ms: ``optimizer.step()`` over the set (prepare, direction, apply), on the host clock with the device
  synchronized (``torch.cuda.synchronize``) before and after each step, as bench/optimizer_step.py times it;
- per phase of the SOAP rule (``dtensor_muon.rules.soap.SOAPRule``, on the slowest rank's set), called on the
  same matrices with their own owner state after the same warm-up, each call between two CUDA events (on CPU
  the host clock), summed over the set per step:
  factors (``update_factors``: G·Gᵀ and Gᵀ·G, or KL's whitened products), refresh (``refresh_basis``:
  eigh, or the Rayleigh quotients, the sort, K·Q and QR per side, plus the rotation of the first moment
  into the new basis) and Adam (``adam_in_basis``: the projections Q_Lᵀ·G·Q_R and Q_L·N·Q_Rᵀ and Adam's
  moments in the basis); their sum is the direction alone, step ms minus it the element-wise prepare and
  apply and the engine's overhead;
- GFLOP/step: the rule's cost model's nominal FLOPs (SOAPRule.cost, MuonRule.cost), and TFLOP/s = that over
  step ms; planned GFLOP: what the plan balanced for that rank (SOAP: TF32-product FLOP equivalents);
- memory (CUDA): allocated after the optimizer's construction (parameters, gradients and state, which both
  optimizers create eagerly) and the peak over its steps, ``torch.cuda.max_memory_allocated`` with the peak
  statistics reset before each optimizer.

Prints one Markdown table and writes ``bench/results/soap_step.json`` (rows, and every timed rank set with its
step ms under ``sets``).
"""

from __future__ import annotations

import gc
import importlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from common import benchmark_parser, markdown_table, median, write_result
from optimizer_step import QUICK_FLAVOR, ParameterSet, parameter_shapes

import dtensor_muon
from dtensor_muon.optim.base import MatrixOptimizer
from dtensor_muon.plan import build_plan
from dtensor_muon.plan.routing import uses_muon
from dtensor_muon.plan.simulate import fsdp_layout
from dtensor_muon.rules.soap import SOAPRule

VARIANTS: dict[str, type[MatrixOptimizer]] = {
    "SOAP": dtensor_muon.SOAP,
    "SOAP-cholqr": dtensor_muon.SOAP,
    "KLSOAP": dtensor_muon.KLSOAP,
    "REKLS": dtensor_muon.REKLS,
}
VARIANT_OPTIONS: dict[str, dict[str, Any]] = {"SOAP-cholqr": {"basis": "cholqr"}}
"""Options a variant adds to its class's defaults."""
DEFAULT_VARIANTS = ("SOAP", "SOAP-cholqr", "REKLS")
HEAVYBALL = "heavyball-SOAP"
FAMILY, FLAVOR = "llama3", "8B"
QUICK_MAX_PRECONDITIONER_DIM = 128
BUCKET_BYTES = 64 * 2**20
"""The optimizers' default exchange bucket (64 MiB), as the engine plans with it."""
WIRE_ITEMSIZE = 4
"""SOAP's wire dtype, float32."""
SOAP_LR, MUON_LR, WEIGHT_DECAY = 3e-3, 0.02, 0.1
PHASES = ("factors", "refresh", "adam")
PLAN_NAMES = {"planned": "each rule's planned cost", "flops": "nominal FLOPs"}
GIB = 2**30

Matrix = tuple[str, tuple[int, int]]


def llama3_matrices(layers: int, quick: bool) -> tuple[list[Matrix], str]:
    """(name, shape) of the Muon-routed parameters of Llama3 8B's first ``layers`` layers (quick: the shrunk
    debugmodel's), and where the shapes came from."""
    shapes, source = parameter_shapes(FAMILY, QUICK_FLAVOR if quick else FLAVOR, layers, quick)
    matrices = [(n, tuple(s)) for n, s in shapes if uses_muon(n, torch.empty(s, device="meta"), None)]
    return matrices, source


def optimizer_group(cls: type[MatrixOptimizer], **options: Any) -> dict[str, Any]:
    """The matrix param group ``cls(params, **options)`` builds (its settings, as the rule's cost reads them)."""
    opt = cls([("w", torch.nn.Parameter(torch.zeros(2, 2)))], **options)
    return next(g for g in opt.param_groups if g["use_muon"])


@dataclass(frozen=True)
class RankSet:
    """The matrices (indices into the matrix list) one rank computes in an optimizer's plan at ``world_size``,
    with every rank whose matrices have the same shapes (``ranks``; ``indices`` are the lowest such rank's),
    and the set's planned cost (what the plan balanced)."""

    optimizer: str
    world_size: int
    ranks: tuple[int, ...]
    indices: tuple[int, ...]
    planned: int


def rank_sets(
    optimizer: str, cls: type[MatrixOptimizer], matrices: list[Matrix], group: dict[str, Any], world_size: int,
    plan_by: str = "planned",
) -> list[RankSet]:  # fmt: skip
    """Plan ``matrices`` under FSDP ``Shard(0)`` over ``world_size`` ranks with the rule's cost, as the engine
    does (``plan_by="planned"``: :attr:`MatrixCost.planned`; ``"flops"``: nominal FLOPs), and return each
    distinct rank set (ranks whose matrices have the same shapes share one), by decreasing planned cost."""
    rule = cls.rule
    layouts = [fsdp_layout(name, shape, world_size) for name, shape in matrices]

    def cost(k: int, shape: tuple[int, int]) -> tuple[int, int, int]:
        c = rule.cost(group, shape)
        return c.plan_entry() if plan_by == "planned" else (c.flops, c.owner_state_bytes, 0)

    plan = build_plan(
        layouts,
        list(range(len(layouts))),
        BUCKET_BYTES,
        WIRE_ITEMSIZE,
        batchable=[rule.can_batch(group)] * len(layouts),
        cost_fn=cost,
    )
    by_shapes: dict[tuple, list[tuple[int, tuple[int, ...]]]] = {}
    for rank in range(world_size):
        indices = tuple(sorted(plan.routes[i].spec.param_index for i in plan.computed_by(rank)))
        if indices:
            by_shapes.setdefault(tuple(sorted(matrices[i][1] for i in indices)), []).append((rank, indices))
    sets = [
        RankSet(optimizer, world_size, tuple(r for r, _ in ranks), ranks[0][1], plan.rank_flops[ranks[0][0]])
        for ranks in by_shapes.values()
    ]
    return sorted(sets, key=lambda s: -s.planned)


def set_flops(matrices: list[Matrix], indices: tuple[int, ...], cls: type[MatrixOptimizer], group: dict) -> int:
    """The rule's cost model summed over a set: FLOPs per step."""
    return sum(cls.rule.cost(group, matrices[i][1]).flops for i in indices)


def describe(matrices: list[Matrix], indices: tuple[int, ...]) -> str:
    """A set's matrices counted by kind: ``"w1×2, wq×1"``."""
    kinds = Counter(matrices[i][0].split(".")[-2] for i in indices)
    return ", ".join(f"{kind}×{n}" for kind, n in sorted(kinds.items()))


class Clock:
    """Elapsed milliseconds between marks: device time between CUDA events on CUDA (read after
    :meth:`sync`), the host clock elsewhere (where every operation has finished when it returns)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else 1e3 * (end - start)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_step(opt: torch.optim.Optimizer, clock: Clock, warmup: int, repeats: int) -> list[float]:
    """``repeats`` timings (ms, host clock, the device synchronized around each) of ``opt.step()`` after
    ``warmup`` untimed steps."""
    times = []
    for step in range(warmup + repeats):
        clock.sync()
        start = time.perf_counter()
        opt.step()
        clock.sync()
        if step >= warmup:
            times.append(1e3 * (time.perf_counter() - start))
    return times


def measure_step(
    make: Callable[[list[tuple[str, torch.nn.Parameter]]], torch.optim.Optimizer],
    params: ParameterSet,
    warmup: int,
    repeats: int,
) -> dict[str, float | None]:
    """Step ms (median, min) and memory of the optimizer ``make(params.named)``; its state is freed after."""
    device = params.device
    params.reset()
    free(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    opt = make(params.named)
    clock = Clock(device)
    clock.sync()
    before = torch.cuda.memory_allocated(device) / GIB if cuda else None
    times = time_step(opt, clock, warmup, repeats)
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    del opt
    free(device)
    return {"step_ms": median(times), "min_ms": min(times), "mem_before_gib": before, "peak_gib": peak}


def measure_phases(group: dict[str, Any], params: ParameterSet, warmup: int, repeats: int) -> dict[str, float]:
    """Per SOAP phase, the median over ``repeats`` steps of its ms summed over the set's matrices (see the
    module docstring), after ``warmup`` steps of the rule's ``direction``; the owner state is freed after."""
    rule, device = SOAPRule(), params.device
    params.reset()
    free(device)
    clock = Clock(device)
    grads = [p.grad for _, p in params.named]
    states = [rule.init_owner_state(tuple(p.shape), group, device) for _, p in params.named]
    for _ in range(warmup):
        for g, s in zip(grads, states):
            rule.direction(g, [s], group, None)
    per_step: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for r in range(repeats):
        t = warmup + r + 1  # the step each matrix takes now (its state's ``step`` + 1)
        clock.sync()
        marks = []
        for g, s in zip(grads, states):
            m0 = clock.mark()
            rule.update_factors(g, s, group, t)
            m1 = clock.mark()
            if rule.refreshes_at(group, t):
                rule.refresh_basis(s, group, t)
            m2 = clock.mark()
            rule.adam_in_basis(g, s, group, t)
            m3 = clock.mark()
            s["step"].add_(1)
            marks.append((m0, m1, m2, m3))
        clock.sync()
        for k, phase in enumerate(PHASES):
            per_step[phase].append(sum(clock.ms(m[k], m[k + 1]) for m in marks))
    del states
    free(device)
    out = {f"{phase}_ms": median(v) for phase, v in per_step.items()}
    out["phases_ms"] = median([sum(v[r] for v in per_step.values()) for r in range(repeats)])
    return out


def ours(cls: type[MatrixOptimizer], options: dict[str, Any]) -> Callable[..., torch.optim.Optimizer]:
    return lambda named: cls(named, **options)


def heavyball_soap(
    precondition_frequency: int, max_preconditioner_dim: int
) -> Callable[..., torch.optim.Optimizer] | None:
    """heavyball's SOAP at this benchmark's settings (see the module docstring), eager; None if not importable."""
    try:
        heavyball = importlib.import_module("heavyball")
    except ImportError:
        return None
    heavyball.utils.compile_mode = None

    def make(named: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        opt = heavyball.SOAP(
            [p for _, p in named],
            lr=SOAP_LR,
            betas=(0.9, 0.95),
            shampoo_beta=0.95,
            eps=1e-8,
            weight_decay=WEIGHT_DECAY,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_preconditioner_dim,
            use_precond_schedule=False,
        )
        opt.consume_grad = False  # it would set p.grad = None after a step; here every step reuses the gradient
        return opt

    return make


def case_label(world_size: int, n_matrices: int) -> str:
    return f"all {n_matrices} matrices (1 rank)" if world_size == 1 else f"slowest of {world_size} ranks"


def main() -> None:
    parser = benchmark_parser(__doc__, "soap_step")
    parser.add_argument("--layers", type=int, default=None, help="first N Llama3 8B layers (default 16; quick: 2)")
    parser.add_argument(
        "--world-sizes",
        type=int,
        nargs="+",
        default=[1, 8, 64],
        help="plans whose every rank set runs (1: every matrix)",
    )
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(DEFAULT_VARIANTS))
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (step 1 is SOAP's eigh)")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps, medians (default 5; quick: 3)")
    parser.add_argument("--max-preconditioner-dim", type=int, default=None, help="SOAP's (default 8192; quick: 128)")
    parser.add_argument("--precondition-frequency", type=int, default=1, help="steps between basis refreshes")
    parser.add_argument("--no-heavyball", action="store_true", help="leave heavyball's SOAP out even if importable")
    parser.add_argument(
        "--plan-by",
        nargs="+",
        choices=["planned", "flops"],
        default=["planned"],
        help="what the plans balance: each rule's planned cost, as the engine (default), or nominal FLOPs; "
        "both: each plan's sets timed in this process, one after the other",
    )
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--float32-matmul-precision",
        choices=["highest", "high", "medium"],
        default="highest",
        help="torch.set_float32_matmul_precision for SOAP's float32 products (default torch's: highest; high: TF32)",
    )
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.float32_matmul_precision)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.layers is None:
        args.layers = 2 if args.quick else 16
    if args.repeats is None:
        args.repeats = 3 if args.quick else 5
    if args.max_preconditioner_dim is None:
        args.max_preconditioner_dim = QUICK_MAX_PRECONDITIONER_DIM if args.quick else 8192
    if args.warmup < 1 or args.repeats < 1 or args.precondition_frequency < 1:
        parser.error("--warmup, --repeats and --precondition-frequency must be >= 1")
    if any(w < 1 for w in args.world_sizes):
        parser.error("--world-sizes must be >= 1")
    if args.quick:
        torch.set_num_threads(1)  # tiny matrices: more threads only wait on each other on a shared CPU
    args.variants = [v for v in VARIANTS if v in args.variants]
    device = torch.device(args.device)

    matrices, shapes_from = llama3_matrices(args.layers, args.quick)
    soap_options = {
        v: {
            "lr": SOAP_LR,
            "weight_decay": WEIGHT_DECAY,
            "max_preconditioner_dim": args.max_preconditioner_dim,
            "precondition_frequency": args.precondition_frequency,
            **VARIANT_OPTIONS.get(v, {}),
        }
        for v in args.variants
    }
    heavyball = None if args.no_heavyball else heavyball_soap(args.precondition_frequency, args.max_preconditioner_dim)
    muon_options = {"lr": MUON_LR, "weight_decay": WEIGHT_DECAY}
    groups = {v: optimizer_group(VARIANTS[v], **soap_options[v]) for v in args.variants}
    muon_group = optimizer_group(dtensor_muon.Muon, **muon_options)
    world_sizes = sorted(set(args.world_sizes))
    classes: dict[str, type[MatrixOptimizer]] = {**{v: VARIANTS[v] for v in args.variants}, "Muon": dtensor_muon.Muon}
    options = {**soap_options, "Muon": muon_options}
    plan_groups = {**groups, "Muon": muon_group}
    n_values = sum(torch.Size(s).numel() for _, s in matrices)
    print(
        f"Llama3 {QUICK_FLAVOR + ' (shrunk)' if args.quick else FLAVOR}, {args.layers} layers: {len(matrices)} "
        f"matrices, {n_values / 1e6:,.1f} M values, fp32, on {device}; shapes from the {shapes_from}; "
        f"medians of {args.repeats} steps after {args.warmup} untimed ones (step 1: SOAP's eigh); float32 "
        f"matmul precision {args.float32_matmul_precision}; precondition_frequency {args.precondition_frequency}; "
        f"plans balance {' and '.join(PLAN_NAMES[p] for p in args.plan_by)}; "
        f"heavyball's SOAP {'included (one-rank set)' if heavyball else 'not included (not importable or --no-heavyball)'}"
    )

    rows: list[dict[str, Any]] = []
    measured: list[dict[str, Any]] = []
    for w in world_sizes:
        muon_slowest = None  # Muon's cost has no separate planned part: every --plan-by gives it the same plan
        for plan_by in args.plan_by if w > 1 else args.plan_by[:1]:
            slowest: dict[str, tuple[RankSet, dict[str, Any]]] = {}
            for name, cls in classes.items():
                if name == "Muon" and muon_slowest is not None:
                    slowest[name] = muon_slowest
                    continue
                for rank_set in rank_sets(name, cls, matrices, plan_groups[name], w, plan_by):
                    params = ParameterSet([matrices[i] for i in rank_set.indices], device)
                    timing = measure_step(ours(cls, options[name]), params, args.warmup, args.repeats)
                    measured.append(
                        {**asdict(rank_set), "plan": plan_by, "matrices": [matrices[i][0] for i in rank_set.indices]}
                        | timing
                    )
                    print(
                        f"  {name} at {w} ranks, plan of {plan_by}: {len(rank_set.ranks)} rank(s) with "
                        f"{describe(matrices, rank_set.indices)}: {timing['step_ms']:.2f} ms",
                        flush=True,
                    )
                    if name not in slowest or timing["step_ms"] > slowest[name][1]["step_ms"]:
                        slowest[name] = (rank_set, timing)
                    del params
                    free(device)
            muon_slowest = slowest["Muon"]
            for name, (rank_set, timing) in slowest.items():
                params = ParameterSet([matrices[i] for i in rank_set.indices], device)
                row = {
                    "case": case_label(w, len(rank_set.indices)),
                    "world_size": w,
                    "plan": plan_by,
                    "optimizer": name,
                    "set": describe(matrices, rank_set.indices),
                    "ranks": len(rank_set.ranks),
                    "matrices": len(rank_set.indices),
                    "values_m": sum(p.numel() for _, p in params.named) / 1e6,
                    "planned_gflop": rank_set.planned / 1e9,
                    "gflop": set_flops(matrices, rank_set.indices, classes[name], plan_groups[name]) / 1e9,
                    **timing,
                }
                if name != "Muon":
                    row.update(measure_phases(groups[name], params, args.warmup, args.repeats))
                row["vs_muon"] = row["step_ms"] / muon_slowest[1]["step_ms"]
                rows.append(row)
                if heavyball is not None and w == 1 and name == "Muon":
                    hb = {**row, "optimizer": HEAVYBALL, **measure_step(heavyball, params, args.warmup, args.repeats)}
                    for key in ("planned_gflop", "gflop"):
                        hb.pop(key)
                    hb["vs_muon"] = hb["step_ms"] / row["step_ms"]
                    rows.append(hb)
                del params
                free(device)
    for row in rows:
        if "gflop" in row:
            row["tflops"] = row["gflop"] / row["step_ms"]  # GFLOP / ms = TFLOP/s

    print(
        markdown_table(
            rows,
            [
                ("case", "case", "{}"),
                ("plan", "plan of", "{}"),
                ("optimizer", "optimizer", "{}"),
                ("set", "slowest rank's matrices", "{}"),
                ("ranks", "ranks with them", "{}"),
                ("matrices", "matrices", "{}"),
                ("planned_gflop", "planned GFLOP", "{:,.2f}"),
                ("gflop", "GFLOP/step", "{:,.2f}"),
                ("step_ms", "step ms", "{:.2f}"),
                ("vs_muon", "× Muon", "{:.2f}"),
                ("factors_ms", "factors ms", "{:.2f}"),
                ("refresh_ms", "refresh ms", "{:.2f}"),
                ("adam_ms", "projections + Adam ms", "{:.2f}"),
                ("phases_ms", "phases Σ ms", "{:.2f}"),
                ("tflops", "TFLOP/s", "{:.2f}"),
                ("mem_before_gib", "GiB before step 1", "{:.1f}"),
                ("peak_gib", "peak GiB", "{:.1f}"),
            ],
        )
    )
    write_result(
        args,
        rows,
        model=f"{FAMILY}:{QUICK_FLAVOR if args.quick else FLAVOR}",
        shapes_from=shapes_from,
        shapes={name: list(shape) for name, shape in matrices},
        sets=measured,
        soap_options=soap_options,
        muon_options=muon_options,
    )


if __name__ == "__main__":
    main()
