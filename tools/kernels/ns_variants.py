"""Newton–Schulz with the dispatch varied, side by side: how each threshold of the dispatch was measured and how to
re-measure it (GPU; ``--quick`` checks the script on CPU). Timing, columns and interleaving are those of
``bench/bench_newton_schulz.py``.

    PYTHONPATH=src python tools/kernels/ns_variants.py --shapes 2048x8192,8x1024x4096 \\
        --methods torch,graphs,graphs:algorithm=standard,graphs:MIN_GLUON_SYRK_DIM=8192
    PYTHONPATH=src python tools/kernels/ns_variants.py --shapes 16x1024x4096 --methods ours,graphs
    PYTHONPATH=src python tools/kernels/ns_variants.py --quick

A method is ``torch`` (plain torch matmuls), ``ours`` (eager) or ``graphs`` (replayed from CUDA graphs where the
dispatch captures one), followed by ``:key=value`` settings applied around every call of that method only:

- ``algorithm=auto|standard|gram``: the Newton–Schulz form;
- ``backend=torch|triton|syrk``: force a backend (``syrk``: the SYRK kernels at every size);
- ``gluon=0|1``: the warp-specialized Gluon SYRK kernel off or on;
- ``decide=N``: the dispatch decides as for N matrices whatever the batch (``kernels.shapes.decide_as_batch``: how the
  optimizer runs a stack of units of N matrices each);
- ``staged=1`` (graphs only): the input written once into the runner's staging buffer and every call made on that
  buffer, as an owner's assembled input is (``NewtonSchulzGraphs.staging_buffer``: with ``--input-dtype bfloat16``
  the graph reads it in place, no start copy);
- ``loop=1``: a batch [B, m, n] run one matrix at a time (what the optimizer does for shapes it does not stack:
  ``--shapes 8x1024x4096 --methods graphs,graphs:loop=1`` re-measures ``kernels.batching.BATCH_MAX_NUMEL``);
- a tuned constant by name (see TUNABLES), e.g. ``WS_MIN_WORK=2**36``, ``TURN_LEAD=0``, ``MAX_GRAPH_WORK=2**38``,
  ``GRAM_MIN_ASPECT=99`` (values are integers, floats or ``a**b``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_newton_schulz import COLUMNS, QUICK_SHAPES, measure_shape, plain_torch
from common import machine, markdown_table
from dispatch_settings import TUNABLES, number, settings

from dtensor_muon.kernels.shapes import decide_as_batch
from dtensor_muon.linalg import ns_graphs
from dtensor_muon.linalg.newton_schulz import newton_schulz


def parse_method(spec: str) -> Callable[[Tensor], Tensor]:
    """The callable a method spec names (see the module docstring)."""
    base, *items = spec.split(":")
    if base == "torch" and not items:
        return plain_torch
    if base not in ("ours", "graphs"):
        raise ValueError(f"{spec!r}: a method starts with torch, ours or graphs")
    algorithm, backend, gluon, loop, decide, staged, constants = "auto", None, None, False, None, False, {}
    for item in items:
        key, _, value = item.partition("=")
        if key == "algorithm":
            algorithm = value
        elif key == "backend":
            backend = value
        elif key == "gluon":
            gluon = value != "0"
        elif key == "loop":
            loop = value != "0"
        elif key == "staged" and base == "graphs":
            staged = value != "0"
        elif key == "decide":
            decide = int(value)
        elif key in TUNABLES:
            constants[key] = number(value)
        else:
            raise ValueError(
                f"{spec!r}: unknown setting {key!r}; expected algorithm, backend, gluon, loop, decide, staged (graphs) "
                f"or {sorted(TUNABLES)}"
            )
    run = ns_graphs.NewtonSchulzGraphs() if base == "graphs" else newton_schulz
    written: list[Tensor] = []  # the input last written into the staging buffer

    def call(g: Tensor) -> Tensor:
        with settings(constants, backend, gluon), decide_as_batch(decide) if decide else nullcontext():
            buffer = run.staging_buffer(g.shape, g.dtype, g.device) if staged else None
            if buffer is not None:
                if not written or written[0] is not g:
                    buffer.copy_(g)
                    written[:] = [g]
                return run(buffer, algorithm=algorithm)
            if loop and g.ndim == 3:
                return torch.stack([run(m, algorithm=algorithm) for m in g.unbind(0)])
            return run(g, algorithm=algorithm)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2048x8192,8x1024x4096", help="comma-separated, e.g. 4096x4096,8x1024x4096")
    parser.add_argument("--methods", default="torch,ours,graphs", help="comma-separated method specs")
    parser.add_argument("--rounds", type=int, default=3, help="timings per method, interleaved; the median counts")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on CPU: checks the script")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--input-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the input's dtype (bfloat16: as the optimizer runs it, its momentum pass writing the input in bf16)",
    )
    args = parser.parse_args()
    try:
        methods = {spec: parse_method(spec) for spec in args.methods.split(",")}
    except ValueError as exc:
        parser.error(str(exc))
    cuda = torch.cuda.is_available() and not args.quick
    if args.quick:
        torch.set_num_threads(1)
        shapes = QUICK_SHAPES
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows: list[dict] = []
    for shape in shapes:
        shape_rows, ceilings = measure_shape(shape, methods, cuda, args.rounds, getattr(torch, args.input_dtype))
        print(
            f"{shape}: matmul ceiling {', '.join(f'{c:.3g}' for c in ceilings)} TFLOP/s; "
            f"dispatched: {shape_rows[0]['ours_route']}",
            flush=True,
        )
        rows += shape_rows
    print(markdown_table(rows, COLUMNS))
    if args.out is not None:
        args.out.write_text(
            json.dumps({"machine": machine(), "args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
            + "\n"
        )


if __name__ == "__main__":
    main()
