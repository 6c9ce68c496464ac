"""Each Newton–Schulz product on the warp-specialized Gluon SYRK kernel and on the Triton one, GPU time and host
time per launch (GPU only): where the Gluon kernel starts to pay (``ws_syrk.WS_MIN_WORK``) and where it stops
(``ws_syrk.WS_MAX_DIM``).

    PYTHONPATH=src python tools/kernels/ws_min_work.py --rounds 3 --out ws_min_work.json
    PYTHONPATH=src python tools/kernels/ws_min_work.py --shapes 1x4096x4096,1x8192x8192

Per shape BxMxN: the Gram matrix (K = N) and, for square or 8x1024x4096 shapes, the poly with its C term and
diagonal and the symmetric product of two MxM matrices (K = M). GPU time: median of ``rounds`` interleaved
``triton.testing.do_bench_cudagraph`` runs (launch cost excluded). Host time: µs per call with calls queued back
to back (the launch's cost to Python, descriptors included). A product whose GPU time is under its host time is
launch-bound in an eager chain.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from host_overhead import host_us  # this script's folder is on the path

from dtensor_muon.kernels.triton_syrk import symmetric_product, syrk
from dtensor_muon.kernels.ws_syrk import ws_syrk

SHAPES = "1x2048x2048,1x2048x8192,4x2048x2048,8x1024x4096,1x4096x4096"


def cases(shapes: str) -> dict[str, tuple[int, Callable[[], object], Callable[[], object]]]:
    """(multiply-adds B·m²·K, Gluon call, Triton call) of the same product, per case: the Gram matrix (K = n),
    the poly with its C term and diagonal (K = m) and the symmetric product of two m×m matrices."""
    torch.manual_seed(0)
    bf = torch.bfloat16
    table = {}
    for spec in shapes.split(","):
        batch, m, n = (int(v) for v in spec.split("x"))
        x = torch.randn(batch, m, n, device="cuda", dtype=bf) / n**0.5
        a = x @ x.mT
        q = torch.randn(batch, m, m, device="cuda", dtype=bf) / m**0.5
        name = f"{batch}x{m}x{n}"
        table[f"gram {name}"] = (batch * m * m * n, lambda x=x: ws_syrk(x), lambda x=x: syrk(x))
        if n == m or (batch, m, n) == (8, 1024, 4096):
            table[f"poly {batch}x{m}²"] = (
                batch * m**3,
                lambda a=a: ws_syrk(a, None, -4.7, 2.0, a, 3.4),
                lambda a=a: syrk(a, -4.7, 2.0, a, 3.4),
            )
            table[f"product {batch}x{m}²"] = (
                batch * m**3,
                lambda a=a, q=q: ws_syrk(a, q),
                lambda a=a, q=q: symmetric_product(a, q),
            )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default=SHAPES, help=f"comma-separated BxMxN (default {SHAPES})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    table = cases(args.shapes)
    for _, gluon, plain in table.values():
        gluon(), plain(), plain()  # compile; the Triton kernel's first call tunes, its second compiles the choice
    torch.cuda.synchronize()
    gpu: dict[str, dict[str, list[float]]] = {name: {"gluon": [], "triton": []} for name in table}
    for _ in range(args.rounds):
        for name, (_, gluon, plain) in table.items():
            gpu[name]["gluon"].append(triton.testing.do_bench_cudagraph(gluon, rep=50))
            gpu[name]["triton"].append(triton.testing.do_bench_cudagraph(plain, rep=50))
    rows = []
    print(
        f"{'product':<22} {'work 2^':>7} {'gluon ms':>9} {'triton ms':>9} {'gluon host us':>13} {'triton host us':>14}"
    )
    for name, (work, gluon, plain) in table.items():
        row = {
            "product": name,
            "work": work,
            "gluon_ms": statistics.median(gpu[name]["gluon"]),
            "triton_ms": statistics.median(gpu[name]["triton"]),
            "gluon_rounds": gpu[name]["gluon"],
            "triton_rounds": gpu[name]["triton"],
            "gluon_host_us": host_us(gluon, 100),
            "triton_host_us": host_us(plain, 100),
        }
        rows.append(row)
        print(
            f"{name:<22} {math.log2(work):7.1f} {row['gluon_ms']:9.4f} {row['triton_ms']:9.4f} "
            f"{row['gluon_host_us']:13.1f} {row['triton_host_us']:14.1f}",
            flush=True,
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "triton": triton.__version__,
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
