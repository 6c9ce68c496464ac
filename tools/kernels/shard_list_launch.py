"""Muon's momentum pass and apply over a rank's shards in ONE launch, against what the step runs today (one fused
kernel per shard of at least ``MIN_KERNEL_NUMEL`` entries, torch's multi-tensor passes below it), GPU only:
whether a list launch would take the shards of a high world size (Qwen3-30B-A3B at 64 ranks: 24 expert shards of
3.1 M entries, below the threshold) at the fused kernels' traffic.

    PYTHONPATH=src python tools/kernels/shard_list_launch.py --out shard_list_launch.json

A list launch reads a table on the device (int64, one row per shard: [entries, its first program, each tensor's
offset in elements from its role's first tensor (the tensors of a role share a dtype)], copied from pinned host
memory each call: from pageable memory the copy would wait for the stream's work); a program finds its shard by
binary search over the rows' first programs. Two kernel shapes:

- ``chunk``: a program per ``CHUNK`` entries of a shard, looping over them ``BLOCK`` at a time;
- ``block``: a program per ``BLOCK`` entries.

Both compute :mod:`dtensor_muon.kernels.elementwise`'s arithmetic (ATen's lerp; θ·d rounded, then one fused
multiply-add), so each path's bits are checked against torch's multi-tensor passes. Per case and path: host ms
per call (calls queued back to back), device ms per call (CUDA events around the queued calls) and wall ms with
the device synchronized around each call (as ``bench/optimizer_step.py``'s share rows time a step), and GB/s over
the device time (momentum: 16 bytes an fp32 entry with U in fp32, 14 with U in bf16; apply: 10 with O in bf16).

``--table-cost`` (any machine): the host's µs to build one table for each case's shards, this layout against the
one first measured in the library's passes (:func:`owner_table`: an entry per program, built with
``torch.repeat_interleave`` and ``triton.cdiv``).

Why: in ``bench/optimizer_step.py``'s share rows, the library with list launches (the owner table) in its passes
over a rank's shards took longer than with today's paths, though fewer bytes move (BENCHMARKS.md, "Element-wise
passes at high world sizes"); the wall column here, per pass, is the one to set beside those rows.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from dtensor_muon.kernels import elementwise as ew
from dtensor_muon.kernels.lerp import fp32_bits, lerp, lerp_weights

MOMENTUM, DECAY, ALPHA = 0.95, 0.998, -0.02
BLOCK = 2048
CASES = {
    "qwen3_64_ranks": [3 << 20] * 24 + [1 << 17] * 16 + [1 << 14] * 16 + [1 << 12] * 8,
    "qwen3_8_ranks": [25 << 20] * 24 + [1 << 20] * 16 + [1 << 17] * 16 + [1 << 15] * 8,
}
"""The busiest rank's Muon shards of Qwen3-30B-A3B's first 8 layers (``bench/optimizer_step.py``'s share)."""


@triton.jit
def _shard_row(table_ptr, SHARDS, ROW: tl.constexpr, STEPS: tl.constexpr):
    """This program's shard row: the last row whose first program is at most this one (binary search over the
    rows' column 1 in ``STEPS`` ≥ log2(SHARDS) halvings)."""
    program = tl.program_id(0)
    lo = program * 0
    hi = lo + SHARDS
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        below = tl.load(table_ptr + ROW * mid + 1) <= program
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return table_ptr + ROW * lo, program


@triton.jit
def _momentum_entries(g_ptr, b_ptr, u_ptr, offsets, inside, w_a, omw_a, w_n, omw_n, SMALL_A: tl.constexpr,
                      SMALL_N: tl.constexpr):  # fmt: skip
    """B' = lerp(B, g, 1 − μ) into b and U = lerp(g, B', μ) into u at ``offsets`` (where ``inside``)."""
    g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    advanced = lerp(b, g, w_a, omw_a, SMALL_A).to(b_ptr.dtype.element_ty)
    tl.store(b_ptr + offsets, advanced, mask=inside)
    u = lerp(g, advanced.to(tl.float32), w_n, omw_n, SMALL_N)
    tl.store(u_ptr + offsets, u.to(u_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _momentum_chunk_kernel(table_ptr, g_base, b_base, u_base, SHARDS, w_a, omw_a, w_n, omw_n, SMALL_A: tl.constexpr,
                           SMALL_N: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """B' = lerp(B, g, 1 − μ) into b, U = lerp(g, B', μ) into u on this program's chunk; row: [entries, first
    program, g, b, u offsets]."""
    row, program = _shard_row(table_ptr, SHARDS, 5, STEPS)
    end = tl.load(row)
    start = (program - tl.load(row + 1)) * CHUNK
    g_ptr, b_ptr, u_ptr = g_base + tl.load(row + 2), b_base + tl.load(row + 3), u_base + tl.load(row + 4)
    for step in range(0, CHUNK, BLOCK):
        offsets = start + step + tl.arange(0, BLOCK)
        inside = offsets < end
        _momentum_entries(g_ptr, b_ptr, u_ptr, offsets, inside, w_a, omw_a, w_n, omw_n, SMALL_A, SMALL_N)


@triton.jit
def _momentum_block_kernel(table_ptr, g_base, b_base, u_base, SHARDS, w_a, omw_a, w_n, omw_n, SMALL_A: tl.constexpr,
                           SMALL_N: tl.constexpr, STEPS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The same on this program's ``BLOCK`` entries (the rows' first programs count blocks)."""
    row, program = _shard_row(table_ptr, SHARDS, 5, STEPS)
    offsets = (program - tl.load(row + 1)) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < tl.load(row)
    g_ptr, b_ptr, u_ptr = g_base + tl.load(row + 2), b_base + tl.load(row + 3), u_base + tl.load(row + 4)
    _momentum_entries(g_ptr, b_ptr, u_ptr, offsets, inside, w_a, omw_a, w_n, omw_n, SMALL_A, SMALL_N)


@triton.jit
def _apply_chunk_kernel(
    table_ptr, p_base, o_base, SHARDS, STEPS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr
):
    """θ ← round(θ·d) + a·O on this program's chunk; row: [entries, first program, θ, O offsets, d, a bits]."""
    row, program = _shard_row(table_ptr, SHARDS, 6, STEPS)
    end = tl.load(row)
    start = (program - tl.load(row + 1)) * CHUNK
    p_ptr, o_ptr = p_base + tl.load(row + 2), o_base + tl.load(row + 3)
    decay = tl.load(row + 4).to(tl.int32).to(tl.float32, bitcast=True)
    alpha = tl.load(row + 5).to(tl.int32).to(tl.float32, bitcast=True)
    for step in range(0, CHUNK, BLOCK):
        offsets = start + step + tl.arange(0, BLOCK)
        inside = offsets < end
        p = tl.load(p_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        decayed = (p * decay).to(p_base.dtype.element_ty).to(tl.float32)
        tl.store(p_ptr + offsets, tl.fma(o, alpha, decayed).to(p_base.dtype.element_ty), mask=inside)


def table(roles: list[list[torch.Tensor]], extra: list[list[int]], per_program: int) -> tuple[torch.Tensor, int]:
    """The launch's table (module docstring) with a program per ``per_program`` entries; (table, programs). One
    row per shard, built in plain integers (an ``array``, no per-program entries): the host's cost grows with
    the shards, not with the entries (``--table-cost``)."""
    offsets = [[(t.data_ptr() - ts[0].data_ptr()) // t.element_size() for t in ts] for ts in roles]
    entries = [t.numel() for t in roles[0]]
    rows: list[int] = []
    programs = 0
    for i, n in enumerate(entries):
        rows += [n, programs, *(role[i] for role in offsets), *extra[i]]
        programs += -(-n // per_program)
    host = torch.frombuffer(array.array("q", rows), dtype=torch.int64)
    host = host.pin_memory() if torch.cuda.is_available() else host.clone()
    return host.to(roles[0][0].device, non_blocking=True), programs


def owner_table(roles: list[list[torch.Tensor]], extra: list[list[int]], per_program: int) -> tuple[torch.Tensor, int]:
    """The layout first measured in the library's passes, for the host-time comparison (``--table-cost``): the
    rows, then each program's shard (``torch.repeat_interleave``), the counts by ``triton.cdiv`` (Triton's JIT
    wrapper when called from Python)."""
    rows: list[int] = []
    counts: list[int] = []
    for i, entries in enumerate(t.numel() for t in roles[0]):
        offsets = [(ts[i].data_ptr() - ts[0].data_ptr()) // ts[0].element_size() for ts in roles]
        rows += [entries, sum(counts), *offsets, *extra[i]]
        counts.append(triton.cdiv(entries, per_program))
    owners = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    host = torch.empty(len(rows) + owners.numel(), dtype=torch.int64, pin_memory=torch.cuda.is_available())
    host[: len(rows)] = torch.tensor(rows, dtype=torch.int64)
    host[len(rows) :] = owners
    return host, int(owners.numel())


def halvings(shards: int) -> int:
    """Binary-search steps that find any of ``shards`` rows (the kernels' ``STEPS``)."""
    return max(1, (shards - 1).bit_length())


def paths(grads, buffers, params, updates, u_dtype) -> dict[str, dict[str, Callable[[], list[torch.Tensor]]]]:
    """Per pass, per path: one call over every shard, returning what it wrote (for the bits check)."""
    shards, steps = len(grads), halvings(len(grads))
    w_a, omw_a, small_a = lerp_weights(1 - MOMENTUM)
    w_n, omw_n, small_n = lerp_weights(MOMENTUM)

    def today_momentum() -> list[torch.Tensor]:
        return ew.momentum_steps(
            grads, buffers, MOMENTUM, True, write_buffer=True, want_input=True, input_dtype=u_dtype
        )

    def list_momentum(kernel: str, chunk: int) -> list[torch.Tensor]:
        inputs = [torch.empty_like(b, dtype=u_dtype) for b in buffers]
        tab, programs = table([grads, buffers, inputs], [[]] * shards, chunk if kernel == "chunk" else BLOCK)
        args = (tab, grads[0], buffers[0], inputs[0], shards, w_a, omw_a, w_n, omw_n)
        if kernel == "chunk":
            _momentum_chunk_kernel[(programs,)](
                *args, SMALL_A=small_a, SMALL_N=small_n, STEPS=steps, BLOCK=BLOCK, CHUNK=chunk
            )
        else:
            _momentum_block_kernel[(programs,)](*args, SMALL_A=small_a, SMALL_N=small_n, STEPS=steps, BLOCK=BLOCK)
        return inputs

    def today_apply() -> list[torch.Tensor]:
        ew.decay_and_add_many(params, updates, [DECAY] * shards, [ALPHA] * shards)
        return params

    def list_apply(chunk: int) -> list[torch.Tensor]:
        factors = [[fp32_bits(DECAY), fp32_bits(ALPHA)]] * shards
        tab, programs = table([params, updates], factors, chunk)
        _apply_chunk_kernel[(programs,)](tab, params[0], updates[0], shards, STEPS=steps, BLOCK=BLOCK, CHUNK=chunk)
        return params

    momentum: dict[str, Callable[[], list[torch.Tensor]]] = {"today": today_momentum}
    apply: dict[str, Callable[[], list[torch.Tensor]]] = {"today": today_apply}
    for chunk in (8 * BLOCK, 16 * BLOCK):
        momentum[f"chunk {chunk}"] = lambda chunk=chunk: list_momentum("chunk", chunk)
        apply[f"chunk {chunk}"] = lambda chunk=chunk: list_apply(chunk)
    momentum[f"block {BLOCK}"] = lambda: list_momentum("block", BLOCK)
    return {"momentum": momentum, "apply": apply}


def reference(grads, buffers, params, updates, u_dtype) -> dict[str, list[torch.Tensor]]:
    """torch's multi-tensor passes on copies: U (rounded to ``u_dtype``) and B' for momentum, θ' for the apply."""
    advanced = [b.clone() for b in buffers]
    torch._foreach_lerp_(advanced, grads, 1 - MOMENTUM)
    inputs = [u.to(u_dtype) for u in torch._foreach_lerp(grads, advanced, MOMENTUM)]
    applied = [p.clone() for p in params]
    torch._foreach_mul_(applied, DECAY)
    torch._foreach_add_(applied, updates, alpha=ALPHA)
    return {"momentum": inputs + advanced, "apply": applied}


def measure(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Host ms per call (queued back to back), device ms per call (events around them) and wall ms per call
    with the device synchronized around each (medians of ``reps``)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e3
    end.record()
    torch.cuda.synchronize()
    walls = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    return {"host_ms": host, "device_ms": start.elapsed_time(end) / reps, "wall_ms": statistics.median(walls)}


def run_case(name: str, sizes: list[int], u_dtype: torch.dtype, reps: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(n: int) -> torch.Tensor:
        return torch.randn(n, generator=gen, device="cuda")

    grads, start_buffers, start_params = ([randn(n) for n in sizes] for _ in range(3))
    updates = [randn(n).to(torch.bfloat16) for n in sizes]
    want = reference(grads, start_buffers, start_params, updates, u_dtype)
    entries = sum(sizes)
    bytes_per = {"momentum": 12 + torch.finfo(u_dtype).bits // 8, "apply": 10}
    rows = []
    for pass_name, by_path in paths(grads, start_buffers, start_params, updates, u_dtype).items():
        for path in by_path:
            buffers, params = [b.clone() for b in start_buffers], [p.clone() for p in start_params]
            fresh = paths(grads, buffers, params, updates, u_dtype)[pass_name][path]
            got = fresh()  # one call from the starting state: the bits
            if pass_name == "momentum":
                got = [u if u.dtype == u_dtype else u.to(u_dtype) for u in got] + buffers
            bits = all(torch.equal(a, b) for a, b in zip(got, want[pass_name]))
            times = measure(fresh, reps)
            rows.append(
                {
                    "case": name,
                    "pass": pass_name,
                    "path": path,
                    "shards": len(sizes),
                    "entries": entries,
                    **times,
                    "gb_s": bytes_per[pass_name] * entries / times["device_ms"] / 1e6,
                    "bits_equal_torch": bits,
                }
            )
            print(
                f"{name:16s} {pass_name:8s} {path:12s} host {times['host_ms']:7.3f}  device {times['device_ms']:7.3f}"
                f"  wall {times['wall_ms']:7.3f} ms  {rows[-1]['gb_s']:6.0f} GB/s  bits {bits}",
                flush=True,
            )
    return rows


def table_cost(reps: int) -> list[dict]:
    """Host µs to build one launch's table for each case's shards (momentum's three roles; views of one entry,
    so it runs anywhere), by :func:`table` and :func:`owner_table`, chunked and per block."""
    rows = []
    for name, sizes in CASES.items():
        roles = [
            [torch.empty(1, dtype=dtype).expand(n) for n in sizes] for dtype in (torch.float32,) * 2 + (torch.bfloat16,)
        ]
        for builder in (table, owner_table):
            for per_program in (16 * BLOCK, BLOCK):
                builder(roles, [[]] * len(sizes), per_program)
                start = time.perf_counter()
                for _ in range(reps):
                    builder(roles, [[]] * len(sizes), per_program)
                us = (time.perf_counter() - start) / reps * 1e6
                rows.append({"case": name, "builder": builder.__name__, "per_program": per_program, "host_us": us})
                print(
                    f"{name:16s} {builder.__name__:10s} a program per {per_program:6d} entries: {us:8.1f} µs",
                    flush=True,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {sorted(CASES)}")
    parser.add_argument("--input-dtype", choices=["bfloat16", "float32"], default="bfloat16", help="U's dtype")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--table-cost", action="store_true", help="only the host cost of the tables (any machine)")
    parser.add_argument("--out", default=None, help="JSON result file")
    args = parser.parse_args()
    if args.table_cost:
        rows = table_cost(args.reps)
    elif not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (--table-cost runs anywhere)")
    else:
        u_dtype = getattr(torch, args.input_dtype)
        rows = [row for name in args.cases.split(",") for row in run_case(name, CASES[name], u_dtype, args.reps)]
    if args.out:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        machine = {
            "device": device,
            "host_cpus": os.cpu_count(),
            "torch": torch.__version__,
            "triton": triton.__version__,
        }
        Path(args.out).write_text(json.dumps({"machine": machine, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
