"""Whether a stack's chain of m×m products runs faster a sub-batch at a time, its operands kept in L2.

    PYTHONPATH=src python tools/kernels/chain_sub_batches.py --stacks 40,128 --subs 32,16,8 --out chain.json

On 768-wide expert stacks the Gram form's m×m products are bound by memory (m³ FLOPs on 6m² bytes:
``bench/ns_roofline.py``), and a whole stack's operands (47 MB a factor for 40 matrices) leave the 50 MB L2. Run a
sub-batch of S matrices through the whole chain before the next, and a product's operands were written by the
product just before: in L2, if S·m² fits. Two chains, each replayed from one CUDA graph, whole stack against
sub-batches of S:

    bmm     K dependent ``torch.bmm`` products P_i = P_{i-1}·X (cuBLAS), time a product
    gram    one Gram-form segment of two iterations on the SYRK kernels, the five m×m products
            (Z = poly(R), R·Z, Z·(R·Z), poly, Q·Z), the dispatch deciding as for 8 matrices so that every
            sub-batch takes the kernels of the whole stack; its Q checked bit for bit against the whole stack's

Prints one row per (chain, stack, sub-batch): µs, ratio to the whole stack, TFLOP/s and GB/s for bmm.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
from graph_timing import graph_us
from torch import Tensor

from dtensor_muon.kernels.shapes import decide_as_batch
from dtensor_muon.kernels.triton_matmuls import SYRK_MATMULS
from dtensor_muon.linalg.newton_schulz import KELLER_COEFFICIENTS


def bmm_chain(x: Tensor, outs: list[Tensor], sub: int) -> Callable[[], Tensor]:
    """len(outs) dependent products P_i = P_{i-1}·X over the stack ``x``, ``sub`` matrices at a time."""

    def work() -> Tensor:
        for s in range(0, x.size(0), sub):
            previous = x[s : s + sub]
            for out in outs:
                torch.bmm(previous, x[s : s + sub], out=out[s : s + sub])
                previous = out[s : s + sub]
        return outs[-1]

    return work


def gram_chain(r: Tensor, sub: int) -> Callable[[], Tensor]:
    """Q of one Gram-form segment of two Keller iterations from the Gram matrices ``r``, ``sub`` at a time."""
    a, b, c = KELLER_COEFFICIENTS
    products = SYRK_MATMULS

    def work() -> Tensor:
        qs = []
        with decide_as_batch(8):
            for s in range(0, r.size(0), sub):
                part = r[s : s + sub]
                z = products.poly(part, a, b, c)
                r2 = products.symmetric_product(z, products.symmetric_product(part, z))
                qs.append(products.symmetric_product(z, products.poly(r2, a, b, c)))
        return torch.cat(qs) if len(qs) > 1 else qs[0]

    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, default=768, help="the short side of the experts (the Gram side)")
    parser.add_argument("--n", type=int, default=2048, help="the long side")
    parser.add_argument("--stacks", default="40,128", help="matrices in the stack, comma-separated")
    parser.add_argument("--subs", default="32,16,8", help="sub-batch sizes, comma-separated")
    parser.add_argument("--products", type=int, default=5, help="products in the bmm chain")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: L2 {props.L2_cache_size / 2**20:.0f} MB, {props.multi_processor_count} SMs")
    m, rows = args.m, []
    for total in (int(s) for s in args.stacks.split(",")):
        subs = [total, *(int(s) for s in args.subs.split(",") if int(s) < total)]
        x = torch.randn(total, m, m, device="cuda", dtype=torch.bfloat16) / m**0.5
        outs = [torch.empty_like(x) for _ in range(args.products)]
        g = torch.randn(total, m, args.n, device="cuda", dtype=torch.bfloat16)
        g = g / g.float().norm(dim=(1, 2), keepdim=True).to(torch.bfloat16)
        with decide_as_batch(8):
            r = SYRK_MATMULS.gram(g)
        whole_bmm = whole_gram = 0.0
        reference: Tensor | None = None
        for sub in subs:
            us, _ = graph_us(bmm_chain(x, outs, sub))
            us /= args.products
            whole_bmm = whole_bmm or us
            tflops = 2 * total * m**3 / (us * 1e-6) / 1e12
            gbps = 3 * total * m * m * 2 / (us * 1e-6) / 1e9
            rows.append({"chain": "bmm", "stack": total, "sub": sub, "us": us, "ratio": us / whole_bmm,
                         "tflops": tflops, "gbps": gbps})  # fmt: skip
            print(f"bmm  m {m} stack {total:4d} sub {sub:4d}: {us:7.1f} µs a product ({us / whole_bmm:.2f}×), "
                  f"{tflops:4.0f} TFLOP/s, {gbps:5.0f} GB/s")  # fmt: skip
            us, q = graph_us(gram_chain(r, sub))
            whole_gram = whole_gram or us
            reference = q.clone() if reference is None else reference
            same = bool(torch.equal(q, reference))
            rows.append({"chain": "gram", "stack": total, "sub": sub, "us": us, "ratio": us / whole_gram,
                         "bitwise_equal_to_whole": same})  # fmt: skip
            print(f"gram m {m} stack {total:4d} sub {sub:4d}: {us:7.1f} µs the 5 products ({us / whole_gram:.2f}×), "
                  f"bitwise equal to the whole stack: {same}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"device": props.name, "m": m, "n": args.n, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
