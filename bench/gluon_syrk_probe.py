"""The Gluon SYRK kernels against the Triton SYRK kernel and cuBLAS: the persistent one
(``bench/gluon_syrk.py``, ``--kernel persistent``), the warp-specialized one the library runs on Hopper
(``dtensor_muon.kernels.ws_syrk``, ``--kernel ws``) or the paired experiment (``bench/pair_syrk.py``,
``--kernel pairs``); ``--compare`` times more of them in the same rounds (``ws``, ``pairs:BKxSTAGES``).

    PYTHONPATH=src python3 bench/gluon_syrk_probe.py --kernel ws --rounds 3 --out bench/results/ws.json
    PYTHONPATH=src python3 bench/gluon_syrk_probe.py --kernel pairs --compare ws --parts correctness,timing

First each variant (2-D and batched, row-major and transposed views, Y ≠ X, a C term with a diagonal and a
per-matrix scale, sizes off the tile grid) is checked against an fp32 product: relative Frobenius error
< 1e-2 and an exactly symmetric result. Then the Newton–Schulz products of the shapes the issue names are
timed ``--rounds`` times interleaved (``triton.testing.do_bench_cudagraph``, median ms): Gluon, the Triton
SYRK kernel as the backend runs it, and cuBLAS's full product. Before that, for the persistent kernel, the
"probe" part times it whole, without its transposed stores and without its epilogue (``gluon_syrk.PROBE``).
Last, the "host" part times each launch's host cost (added in the eighth session after its device time ran
out: not yet run).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import pair_syrk as pair_module  # bench/ is on the path: this script runs as bench/gluon_syrk_probe.py
from gluon_syrk import gluon_syrk
from pair_syrk import pair_syrk
from torch import Tensor

from dtensor_muon.kernels.triton_syrk import symmetric_product, syrk
from dtensor_muon.kernels.ws_syrk import ws_syrk

KERNELS: dict[str, Callable[..., Tensor]] = {"persistent": gluon_syrk, "ws": ws_syrk, "pairs": pair_syrk}
# Further Gluon kernels timed beside the chosen one (``--compare``), by name.
COMPARED: dict[str, Callable[..., Tensor]] = {}


def pair_config(block_k: int, stages: int) -> Callable[..., Tensor]:
    """The paired kernel with the given K slice and ring depth (set on each call, so the variants interleave)."""
    def run(*args: object) -> Tensor:
        pair_module.BLOCK_K, pair_module.STAGES = block_k, stages
        return pair_syrk(*args)
    return run


def reference(x: Tensor, y: Tensor | None, alpha: float, beta: float, c: Tensor | None, diag: float,
              scale: Tensor | None, power: int) -> Tensor:
    """fp32 s^p·(alpha·X·Yᵀ + beta·C + diag·I)."""
    xf = x.float()
    yf = xf if y is None else y.float()
    r = alpha * xf @ yf.mT
    if c is not None:
        r = r + beta * c.float()
    if diag:
        r = r + diag * torch.eye(x.size(-2), device=x.device)
    if scale is not None:
        s = scale.view(-1, 1, 1) if r.ndim == 3 else scale.view(1, 1)
        r = r * s**power
    return r


def check(kernel: Callable[..., Tensor], name: str, x: Tensor, y: Tensor | None = None, alpha: float = 1.0,
          beta: float = 0.0, c: Tensor | None = None, diag: float = 0.0, scale: Tensor | None = None,
          power: int = 1) -> dict:
    out = kernel(x, y, alpha, beta, c, diag, scale, power)
    ref = reference(x, y, alpha, beta, c, diag, scale, power)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    symmetric = bool(torch.equal(out, out.mT))
    again = kernel(x, y, alpha, beta, c, diag, scale, power)
    row = {"case": name, "rel_err": err, "exactly_symmetric": symmetric, "deterministic": bool(torch.equal(out, again))}
    print(f"{name:<44} rel err {err:.2e} symmetric {symmetric} deterministic {row['deterministic']}")
    return row


def correctness(kernel: Callable[..., Tensor], device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    bf = torch.bfloat16
    rows = []
    x = torch.randn(512, 384, device=device, dtype=bf)
    rows.append(check(kernel, "gram 512x384", x))
    x = torch.randn(1408, 2048, device=device, dtype=bf)
    rows.append(check(kernel, "gram 1408x2048", x))
    x = torch.randn(304, 200, device=device, dtype=bf)
    rows.append(check(kernel, "gram 304x200 (off the tile grid)", x))
    x = torch.randn(3, 2048, 1408, device=device, dtype=bf).mT
    rows.append(check(kernel, "gram 3x1408x2048 transposed view", x))
    a = torch.randn(4, 1408, 1408, device=device, dtype=bf)
    a = ((a + a.mT) / 64).to(bf)
    scale = torch.rand(4, device=device) + 0.5
    rows.append(check(kernel, "poly 4x1408² (C, diag, scale)", a, None, -4.7, 2.0, a, 3.4, scale, 1))
    rows.append(check(kernel, "gram 4x1408² scale²", a, None, 1.0, 0.0, None, 0.0, scale, 2))
    b = (2.0 * a.float() + a.float() @ a.float()).to(bf)  # a polynomial in a: a·bᵀ is symmetric
    rows.append(check(kernel, "X·Yᵀ 4x1408², Y a polynomial in X", a, b))
    a = torch.randn(4096, 4096, device=device, dtype=bf) / 64
    rows.append(check(kernel, "gram 4096²", a))
    a = ((a + a.mT) / 2).to(bf)
    rows.append(check(kernel, "poly 4096² (C, diag)", a, None, -4.7, 2.0, a, 3.4))
    return rows


def cases(gluon: Callable[..., Tensor], device: torch.device) -> dict[str, dict[str, Callable[[], object]]]:
    torch.manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(4096, 4096, device=device, dtype=bf) / 64
    a = x @ x.mT
    xt = (torch.randn(64, 2048, 1408, device=device, dtype=bf) / 45).mT
    r = xt @ xt.mT
    q = torch.randn(64, 1408, 1408, device=device, dtype=bf) / 38
    big = torch.randn(8192, 8192, device=device, dtype=bf) / 90
    # The Gluon kernels' arguments per case (X, Y, alpha, beta, C, diag), then the other methods.
    arguments = {"gram 4096²": (x,), "poly 4096²": (a, None, -4.7, 2.0, a, 3.4), "gram 8192²": (big,),
                 "gram 64x1408x2048 (transposed)": (xt,), "poly 64x1408²": (r, None, -4.7, 2.0, r, 3.4),
                 "product 64x1408²": (r, q)}
    others = {
        "gram 4096²": {"triton": lambda: syrk(x), "cuBLAS": lambda: x @ x.mT},
        "poly 4096²": {
            "triton": lambda: syrk(a, -4.7, 2.0, a, 3.4),
            "cuBLAS": lambda: torch.addmm(a, a, a, beta=2.0, alpha=-4.7),
        },
        "gram 8192²": {"triton": lambda: syrk(big)},
        "gram 64x1408x2048 (transposed)": {"triton": lambda: syrk(xt), "cuBLAS": lambda: xt @ xt.mT},
        "poly 64x1408²": {
            "triton": lambda: syrk(r, -4.7, 2.0, r, 3.4),
            "cuBLAS": lambda: torch.baddbmm(r, r, r, beta=2.0, alpha=-4.7),
        },
        "product 64x1408²": {"triton": lambda: symmetric_product(r, q), "cuBLAS": lambda: r @ q.mT},
    }
    table = {}
    for case, args in arguments.items():
        table[case] = {"gluon": functools.partial(gluon, *args), **others[case]}
        for name, other in COMPARED.items():
            table[case][name] = functools.partial(other, *args)
    return table


def timing(gluon: Callable[..., Tensor], device: torch.device, rounds: int) -> list[dict]:
    table = cases(gluon, device)
    times: dict[tuple[str, str], list[float]] = {}
    for fns in table.values():
        for fn in fns.values():
            fn()  # compile and tune outside the timing
    torch.cuda.synchronize()
    for _ in range(rounds):
        for case, fns in table.items():
            for method, fn in fns.items():
                times.setdefault((case, method), []).append(triton.testing.do_bench_cudagraph(fn, rep=100))
    rows = []
    for case, fns in table.items():
        line = f"{case:<34}"
        for method in fns:
            ms = statistics.median(times[(case, method)])
            rows.append({"case": case, "method": method, "ms": ms, "rounds": times[(case, method)]})
            line += f" {method} {ms:.4f}"
        print(line)
    return rows


def probe(device: torch.device) -> list[dict]:
    """Where a tile's time goes: the kernel without its transposed stores (PROBE 1) and without any
    epilogue (PROBE 2), results wrong by design, timed against the whole kernel."""
    import gluon_syrk as module

    torch.manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(4096, 4096, device=device, dtype=bf) / 64
    xt = (torch.randn(64, 2048, 1408, device=device, dtype=bf) / 45).mT
    r = torch.randn(64, 1408, 1408, device=device, dtype=bf) / 38
    big = torch.randn(8192, 8192, device=device, dtype=bf) / 90
    rows = []
    for name, fn in (("gram 4096²", lambda: gluon_syrk(x)), ("gram 8192²", lambda: gluon_syrk(big)),
                     ("gram 64x1408x2048", lambda: gluon_syrk(xt)), ("product 64x1408²", lambda: gluon_syrk(r, r))):
        line = f"{name:<24}"
        for mode in (0, 1, 2):
            module.PROBE = mode
            try:
                fn()
                ms = statistics.median(triton.testing.do_bench_cudagraph(fn, rep=100) for _ in range(3))
            finally:
                module.PROBE = 0
            rows.append({"case": name, "probe": mode, "ms": ms})
            line += f" probe{mode} {ms:.4f}"
        print(line)
    return rows


def host_cost(gluon: Callable[..., Tensor], device: torch.device, calls: int = 50) -> list[dict]:
    """Host time per call (µs) of each case's Gluon and Triton launch: ``calls`` calls queued back to back
    without synchronizing, after a synchronized warm-up, so the wall clock is the host's (the launch queue
    holds them all). Where it exceeds the product's GPU time, launches starve the GPU in an eager chain."""
    rows = []
    for case, fns in cases(gluon, device).items():
        line = f"{case:<34}"
        for method in ("gluon", "triton"):
            fn = fns[method]
            fn()
            fn()  # the Triton kernel's first call tunes, its second compiles the chosen config's direct launch
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host_us = (time.perf_counter() - start) / calls * 1e6
            torch.cuda.synchronize()
            rows.append({"case": case, "method": method, "host_us_per_call": host_us})
            line += f" {method} {host_us:.1f} µs"
        print(line)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="persistent")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", default="correctness,probe,timing,host",
                        help="which parts to run, comma-separated (probe: the persistent kernel only)")
    parser.add_argument("--compare", default="",
                        help="more kernels timed beside it, comma-separated: ws, or pairs:BKxSTAGES (e.g. pairs:32x6)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    for name in filter(None, args.compare.split(",")):
        if name.startswith("pairs:"):
            block_k, stages = (int(v) for v in name.split(":")[1].split("x"))
            COMPARED[name] = pair_config(block_k, stages)
        else:
            COMPARED[name] = KERNELS[name]
    device = torch.device("cuda")
    kernel = KERNELS[args.kernel]
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "kernel": args.kernel}
    parts = [("correctness", lambda: correctness(kernel, device)),
             ("timing", lambda: timing(kernel, device, args.rounds)),
             ("host", lambda: host_cost(kernel, device))]
    if args.kernel == "persistent":
        parts.insert(1, ("probe", lambda: probe(device)))
    for part, run in parts:
        if part not in args.parts.split(","):
            continue
        try:
            result[part] = run()
        except Exception:  # noqa: BLE001 (report the failing part, e.g. a compile error, and go on)
            result[part] = traceback.format_exc()
            print(result[part])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
