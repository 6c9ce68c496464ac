"""What the owner's copy of O costs: the busiest rank's share with the directions' output cloned or borrowed.

    PYTHONPATH=src:bench python tools/kernels/borrowed_directions.py --model qwen3_30b_a3b --layers 8 --world-size 64,8

An owner used to copy each call's O twice before its exchange back (a clone of the CUDA graph's output, then the
send buffer); it now sends straight from the graph's buffer where that is safe (``engine/strategies/owned.py``).
This times ``bench/optimizer_step.py``'s share of the busiest FSDP rank (stacks as ``--stacks`` says) with its
directions through the optimizer's graphs, cloned (``borrow=False``) and borrowed (``borrow=True``), in alternating
rounds in one process: the directions alone (synchronized around each call) and the whole share issued back to
back. Prints the median and every round per world size; writes JSON with ``--out``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import optimizer_step as bench
import torch
from dispatch_settings import settings

from dtensor_muon.plan.routing import uses_muon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_30b_a3b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--world-size", default="64,8", help="comma-separated world sizes")
    parser.add_argument("--stacks", default="16", help="units per stack (bench/optimizer_step.py's spec)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    shapes, _ = bench.model_shapes(args.model, args.layers)
    names = {n for n, s in shapes if uses_muon(n, torch.empty(s, device="meta"), None)}
    group = bench.muon_group()
    rows = []
    for world in (int(w) for w in args.world_size.split(",")):
        share = bench.rank_share(shapes, names, group, world)
        units, constants = bench.stack_spec(args.stacks)
        with settings(constants):
            work = bench.ShareWork(share, group, device, units)
            graphs = work.runner
            runners = {"cloned": graphs, "borrowed": functools.partial(graphs, borrow=True)}
            times: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                for name, runner in runners.items():
                    work.runner = runner
                    times.setdefault(f"directions {name} ms", []).append(
                        bench.median_ms(work.newton_schulz, device, 3, args.steps)
                    )
                    times.setdefault(f"share back to back {name} ms", []).append(
                        bench.back_to_back_ms(work.step, device, 3, args.steps)
                    )
        owned_mb = sum(torch.Size(s).numel() for s, owned in share.units if owned) * 2 / 1e6
        rows.append({"world_size": world, "owned_o_mb": owned_mb, "rounds": times})
        medians = "; ".join(f"{k} {sorted(v)[len(v) // 2]:.3f} {[round(x, 3) for x in v]}" for k, v in times.items())
        print(f"{world} ranks, owned O {owned_mb:.0f} MB: {medians}")
        del work
        bench.free(device)
    if args.out:
        args.out.write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "args": vars(args) | {"out": str(args.out)}, "rows": rows},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
