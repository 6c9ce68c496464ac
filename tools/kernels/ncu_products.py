"""One Newton–Schulz product per run, for Nsight Compute: three warm-up calls (tuning, compilation) outside the
profiled range, one call inside it (GPU only).

    M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__throughput.avg.pct_of_peak_sustained_elapsed
    M=$M,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum
    M=$M,dram__throughput.avg.pct_of_peak_sustained_elapsed
    M=$M,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
    M=$M,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_elapsed
    for c in ws_product ws_poly ws_gram triton_product cublas_product cublas_apply ws_gram4096 cublas_4096; do
        PYTHONPATH=src ncu --clock-control none --profile-from-start off --metrics $M python tools/kernels/ncu_products.py $c
    done

The cases are the 64×2048×1408 Gram form's products (X a transposed view of [64, 2048, 1408]) and the
4096² Gram product: on the Gluon kernel (ws_), the Triton kernel (triton_) and cuBLAS's full products.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from dtensor_muon.kernels.triton_syrk import symmetric_product
from dtensor_muon.kernels.ws_syrk import ws_syrk


def cases() -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    bf = torch.bfloat16
    xt = (torch.randn(64, 2048, 1408, device="cuda", dtype=bf) / 45).mT
    r = (xt @ xt.mT).contiguous()
    q = torch.randn(64, 1408, 1408, device="cuda", dtype=bf) / 38
    x4 = torch.randn(4096, 4096, device="cuda", dtype=bf) / 64
    return {
        "ws_product": lambda: ws_syrk(r, q),
        "ws_poly": lambda: ws_syrk(r, None, -4.7, 2.0, r, 3.4),
        "ws_gram": lambda: ws_syrk(xt),
        "triton_product": lambda: symmetric_product(r, q),
        "cublas_product": lambda: r @ q.mT,
        "cublas_apply": lambda: (xt.mT @ r).mT,
        "ws_gram4096": lambda: ws_syrk(x4),
        "cublas_4096": lambda: x4 @ x4,
    }


CASES = (
    "ws_product",
    "ws_poly",
    "ws_gram",
    "triton_product",
    "cublas_product",
    "cublas_apply",
    "ws_gram4096",
    "cublas_4096",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", choices=CASES)
    args = parser.parse_args()
    run = cases()[args.case]
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
