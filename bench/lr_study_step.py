"""One optimizer step of the learning-rate study's models (``bench/lr_study.py``), per optimizer, on one device:
where a step's time goes when one process trains the whole model.

    PYTHONPATH=src:bench python bench/lr_study_step.py --model moe --optimizers SOAP-cholqr KLSOAP-cholqr Muon
    PYTHONPATH=src:bench python bench/lr_study_step.py --quick      # CPU, seconds (no launches counted)

Each optimizer (the study's names: ``Muon``, ``NorMuon``, ``AdamW``, ``SOAP``, ``KLSOAP``, ``SOAP-cholqr``,
``KLSOAP-cholqr``, built by :func:`lr_study.build_optimizer` at lr 1e-3) trains a fresh copy of the model
(seed 0) on the study's batches for 14 steps. Per optimizer the table gives the median over steps 3–14 (one
of them refreshes SOAP's bases) of the forward and backward pass and of ``step()``: the host's time until it
returns and the time until the device has finished it, and the slowest step (step 1: SOAP's first
eigendecompositions). Step 15 runs under ``torch.profiler``: kernel launches (``cudaLaunchKernel`` and its
variants) and calls that may wait for the device (any ``cuda…Synchronize`` and ``cudaMemcpyAsync``) in that one
step, and the device time the profiler attributes to ``step()``. Results go to
``bench/results/lr_study_step[_quick].json`` under ``--label`` (default: the checkout's commit), beside the
labels already there, so a run before a change and one after sit side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import common
import lr_study
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

RESULTS = lr_study.ROOT / "bench" / "results"
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
STEPS, SKIPPED = 14, 2


def measure(optimizer: str, model_name: str, quick: bool, tokens: Path) -> dict[str, float]:
    """The figures of the module docstring for one optimizer."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    data = torch.load(tokens)
    config = replace((lr_study.QUICK_MODELS if quick else lr_study.MODELS)[model_name], vocab=int(data["vocab"]))
    torch.manual_seed(0)
    model = lr_study.Transformer(config)
    model.init_weights()
    model.to(device)
    opt = lr_study.build_optimizer(lr_study.Run(model_name, optimizer, 1e-3, 0), model, device)
    stream = data["train"].to(device)

    def forward_backward(i: int) -> None:
        x, y = lr_study.batch(stream, i, 16, config.seq, salt=1)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()

    passes, host, done = [], [], []
    for i in range(STEPS):
        sync()
        t0 = time.perf_counter()
        forward_backward(i)
        sync()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        passes.append(t1 - t0)
        host.append(t2 - t1)
        done.append(t3 - t1)
    forward_backward(STEPS)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        opt.step()
        sync()
    events = prof.key_averages()
    step_device_us = sum(e.device_time_total for e in events if e.key.startswith("Optimizer.step#"))
    return {
        "forward_backward_ms": 1e3 * statistics.median(passes[SKIPPED:]),
        "step_host_ms": 1e3 * statistics.median(host[SKIPPED:]),
        "step_ms": 1e3 * statistics.median(done[SKIPPED:]),
        "slowest_step_ms": 1e3 * max(done),
        "launches": sum(e.count for e in events if e.key in LAUNCHES),
        "syncs": sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaMemcpyAsync"),
        "step_device_ms": step_device_us / 1e3,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(lr_study.MODELS), default="moe")
    parser.add_argument("--optimizers", nargs="+", default=["SOAP-cholqr", "KLSOAP-cholqr", "Muon"])
    parser.add_argument("--quick", action="store_true", help="the study's small models, for a CPU check")
    parser.add_argument("--label", default=None, help="key of this run in the results (default: the commit)")
    parser.add_argument("--tokens", type=Path, default=lr_study.TOKENS)
    args = parser.parse_args(argv)
    label = args.label or common.git_commit() or "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = {}
    print(f"{args.model}, {device}, {label}")
    print("| optimizer | fwd+bwd ms | step ms | step host ms | slowest step ms | launches | syncs | step device ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.optimizers:
        r = rows[name] = measure(name, args.model, args.quick, args.tokens)
        print(
            f"| {name} | {r['forward_backward_ms']:.1f} | {r['step_ms']:.1f} | {r['step_host_ms']:.1f} | "
            f"{r['slowest_step_ms']:.0f} | {r['launches']} | {r['syncs']} | {r['step_device_ms']:.1f} |",
            flush=True,
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    out = RESULTS / f"lr_study_step{'_quick' if args.quick else ''}.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    results.setdefault(args.model, {})[label] = {"device": device, "torch": torch.__version__, "optimizers": rows}
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"→ {out.relative_to(lr_study.ROOT)}")


if __name__ == "__main__":
    main()
