"""Ring depth, register split and turn lead of the warp-specialized Gluon SYRK kernel (``kernels/ws_syrk.py``),
each variant against the Triton SYRK kernel on the Newton–Schulz products of 4096², 4096×14336 and
64×2048×1408 (GPU only).

    PYTHONPATH=src python tools/kernels/ws_syrk_tuning.py --rounds 3 --out ws_tuning.json
    PYTHONPATH=src python tools/kernels/ws_syrk_tuning.py --variants "5,24,240,168,0;5,24,240,168,1"

A variant is STAGES,PRODUCER_REGS,CONSUMER_REGS,MAX_REGS,TURN_LEAD, set on the module before each launch (the
default list varies one at a time from the library's values). Each case times the Triton kernel once per round
and every variant once per round (``triton.testing.do_bench_cudagraph``); the table shows the medians in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from dtensor_muon.kernels import ws_syrk as ws
from dtensor_muon.kernels.triton_syrk import symmetric_product, syrk

# The library's values first, then one change at a time: ring depth, producer registers, turn lead.
VARIANTS = "5,24,240,168,1;4,24,240,168,1;3,24,240,168,1;5,40,232,168,1;5,24,240,168,0;5,24,240,168,2"


def parse_variants(text: str) -> list[tuple[int, ...]]:
    """``"S,P,C,R,L;..."`` as tuples (STAGES, PRODUCER_REGS, CONSUMER_REGS, MAX_REGS, TURN_LEAD)."""
    variants = [tuple(int(v) for v in item.split(",")) for item in text.split(";") if item]
    if not variants or any(len(v) != 5 for v in variants):
        raise SystemExit(
            f"--variants: expected 'STAGES,PRODUCER_REGS,CONSUMER_REGS,MAX_REGS,TURN_LEAD;...', got {text!r}"
        )
    return variants


def cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(Gluon, Triton) calls of the same product per case."""
    torch.manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(4096, 4096, device="cuda", dtype=bf) / 64
    a = x @ x.mT
    wide = torch.randn(4096, 14336, device="cuda", dtype=bf) / 100
    xt = (torch.randn(64, 2048, 1408, device="cuda", dtype=bf) / 45).mT
    r = xt @ xt.mT
    q = torch.randn(64, 1408, 1408, device="cuda", dtype=bf) / 38
    return {
        "gram 4096²": (lambda: ws.ws_syrk(x), lambda: syrk(x)),
        "poly 4096²": (lambda: ws.ws_syrk(a, None, -4.7, 2.0, a, 3.4), lambda: syrk(a, -4.7, 2.0, a, 3.4)),
        "gram 4096x14336": (lambda: ws.ws_syrk(wide), lambda: syrk(wide)),
        "gram 64x1408x2048T": (lambda: ws.ws_syrk(xt), lambda: syrk(xt)),
        "poly 64x1408²": (lambda: ws.ws_syrk(r, None, -4.7, 2.0, r, 3.4), lambda: syrk(r, -4.7, 2.0, r, 3.4)),
        "product 64x1408²": (lambda: ws.ws_syrk(r, q), lambda: symmetric_product(r, q)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=VARIANTS, help=f"';'-separated variants (default {VARIANTS})")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    variants = parse_variants(args.variants)
    chosen = (ws.STAGES, ws.PRODUCER_REGS, ws.CONSUMER_REGS, ws.MAX_REGS, ws.TURN_LEAD)
    result: dict[str, dict[str, list[float]]] = {}
    print(f"{'case':<20} triton " + " ".join(str(v) for v in variants))
    try:
        for name, (gluon, plain) in cases().items():
            plain()
            row: dict[str, list[float]] = {"triton": []}
            for _ in range(args.rounds):
                for variant in variants:
                    ws.STAGES, ws.PRODUCER_REGS, ws.CONSUMER_REGS, ws.MAX_REGS, ws.TURN_LEAD = variant
                    gluon()  # compile outside the timing
                    row.setdefault(str(variant), []).append(triton.testing.do_bench_cudagraph(gluon, rep=60))
                row["triton"].append(triton.testing.do_bench_cudagraph(plain, rep=60))
            result[name] = row
            print(f"{name:<20} " + " ".join(f"{statistics.median(v):.4f}" for v in row.values()), flush=True)
    finally:
        ws.STAGES, ws.PRODUCER_REGS, ws.CONSUMER_REGS, ws.MAX_REGS, ws.TURN_LEAD = chosen
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
