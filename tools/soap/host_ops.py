"""The host's share of SOAP's step on a small MoE, on CPU: the torch operations one steady step issues and its
median time, a stand-in for the launches and host time of the GPU step (every operation but a view is a launch
there) when a change to the host's work is made without a GPU at hand.

    PYTHONPATH=src:bench python tools/soap/host_ops.py                    # SOAP and KL-SOAP, basis="cholqr"
    PYTHONPATH=<other checkout>/src:bench python tools/soap/host_ops.py   # the same before a change

One process, one CPU thread; 4 layers, each with 32 experts of 24×64 and 32 of 64×24 (units of 4) and one
64×64 matrix; ``match_update_rms=0.2`` (the learning-rate study's setting), a refresh every 10 steps. The time
is the median of 16 steady steps (the refresh steps left out) after 3 untimed ones; the operations are the
outermost ``aten::`` calls the profiler records in one steady step (views such as ``reshape`` included), as
``bench/optimizer_step.py`` counts a CPU step's.
Matrices this small leave the time to the host, not to arithmetic; the GPU figures come from
``bench/lr_study_step.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from optimizer_step import has_aten_ancestor
from torch.profiler import ProfilerActivity, profile

from dtensor_muon import KLSOAP, SOAP

LAYERS, EXPERTS = 4, 32
WARM_UP, TIMED, REFRESH_EVERY = 3, 18, 10


def model(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    """The named parameters of the module docstring."""
    g = torch.Generator().manual_seed(seed)
    params = []
    for layer in range(LAYERS):
        for name, shape in (("moe.experts.w1", (EXPERTS, 24, 64)), ("moe.experts.w2", (EXPERTS, 64, 24))):
            params.append((f"layers.{layer}.{name}", torch.nn.Parameter(torch.randn(shape, generator=g))))
        params.append((f"layers.{layer}.attention.wq", torch.nn.Parameter(torch.randn(64, 64, generator=g))))
    return params


def measure(front: type) -> dict[str, float]:
    """Median ms of a steady step and the operations of one, for ``front`` (SOAP or KLSOAP)."""
    params = model()
    opt = front(params, lr=3e-3, basis="cholqr", precondition_frequency=REFRESH_EVERY, match_update_rms=0.2)
    g = torch.Generator().manual_seed(1)

    def step() -> float:
        for _, p in params:
            p.grad = torch.randn(p.shape, generator=g)
        return timed_step()

    def timed_step() -> float:
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start

    for _ in range(WARM_UP):
        step()
    times = [step() for _ in range(TIMED)]
    steady = [t for i, t in enumerate(times) if (WARM_UP + i) % REFRESH_EVERY != 0]  # step t refreshes at t ≡ 1
    if (WARM_UP + TIMED) % REFRESH_EVERY == 0:  # the profiled step must not be a refresh
        step()
    for _, p in params:
        p.grad = torch.randn(p.shape, generator=g)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timed_step()
    ops = Counter(e.name for e in prof.events() if e.name.startswith("aten::") and not has_aten_ancestor(e))
    return {"steady_ms": 1e3 * statistics.median(steady), "ops": sum(ops.values()), "top": dict(ops.most_common(6))}


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(1)
    for front in (SOAP, KLSOAP):
        result = measure(front)
        print(
            f"{front.__name__}: {result['steady_ms']:.2f} ms a steady step, {result['ops']} operations; {result['top']}"
        )


if __name__ == "__main__":
    main()
