"""SOAP's basis refresh (``basis="cholqr"``, :mod:`dtensor_muon.linalg.eigenbasis`) taken apart: what each operation of
one refresh of a k×k factor costs, and what the float32 Cholesky passes' replacements cost and how accurate they
are. This is how BENCHMARKS.md's per-operation table of the refresh (section "The refresh on matrix products")
was measured.

    PYTHONPATH=src python tools/soap/refresh_ops.py                 # k = 4096 and 1024, on the GPU
    PYTHONPATH=src python tools/soap/refresh_ops.py --sides 2048
    PYTHONPATH=src python tools/soap/refresh_ops.py --quick         # k = 128 on CPU: checks the script

The factor is K = G·Gᵀ of a k×2k Gaussian G; the old basis Q_old is float64 eigh's of a factor one perturbed
gradient before (a warm basis, as after many refreshes). Per operation: median ms of ``--repeats`` calls (CUDA
events on the GPU, the host clock on CPU), after two untimed calls.

Operations: one product K·Q in float32, TF32 and bf16; the float32-accurate split TF32 product and Gram matrix
(:func:`accurate_matmul`, :func:`accurate_gram`); a TF32 Gram matrix; ``cholesky_ex``;
``solve_triangular`` (Q·R⁻¹); a whole ``power_cholqr``; float32 ``eigh`` and Householder ``qr`` of K·Q.

Replacements, on the two passes' real inputs (the shifted power-iteration product Ŷ and the first pass's
output, each with its float32-accurate Gram matrix): Q·R⁻¹ by column blocks whose updates are products
(TF32, or split TF32 with ``accurate``), by an explicit blocked inverse of R, and a right-looking blocked
Cholesky with product updates; each with its largest entry error against float64 (relative to the largest
entry) and the result's max|QᵀQ − I|. Then, on a batch of warm factors, ‖QᵀQ − I‖_F after the first pass with
a TF32 and with a split-TF32 Gram matrix, and the series second pass (:func:`eb.series_pass`, products only)
against the Cholesky pass on the latter's output.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor

from dtensor_muon.linalg import eigenbasis as eb
from dtensor_muon.rules.soap import eigh_descending


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median ms of ``repeats`` calls after two untimed ones."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def product(a: Tensor, b: Tensor, accurate: bool) -> Tensor:
    """a·b: split TF32 to float32 accuracy (``accurate``) or TF32."""
    if accurate:
        return eb.accurate_matmul(a, b)
    with eb.float32_matmul_precision("high"):
        return a @ b


def blocked_solve(y: Tensor, r: Tensor, block: int, accurate: bool) -> Tensor:
    """Y·R⁻¹ (R upper) by column blocks: Q_j = (Y_j − Q_<j·R_<j,j)·R_jj⁻¹, the updates as products."""
    k = r.shape[-1]
    q = torch.empty_like(y)
    for j0 in range(0, k, block):
        j1 = min(j0 + block, k)
        rhs = y[..., j0:j1]
        if j0:
            rhs = rhs - product(q[..., :j0], r[..., :j0, j0:j1], accurate)
        q[..., j0:j1] = torch.linalg.solve_triangular(r[..., j0:j1, j0:j1], rhs, upper=True, left=False)
    return q


def blocked_inverse(r: Tensor, block: int, accurate: bool) -> Tensor:
    """R⁻¹ (R upper) by column blocks: X_jj = R_jj⁻¹, X_<j,j = −X_<j,<j·R_<j,j·X_jj."""
    k = r.shape[-1]
    x = torch.zeros_like(r)
    eye = torch.eye(block, dtype=r.dtype, device=r.device)
    for j0 in range(0, k, block):
        j1 = min(j0 + block, k)
        inverse = torch.linalg.solve_triangular(r[..., j0:j1, j0:j1], eye[: j1 - j0, : j1 - j0], upper=True)
        x[..., j0:j1, j0:j1] = inverse
        if j0:
            x[..., :j0, j0:j1] = -product(product(x[..., :j0, :j0], r[..., :j0, j0:j1], accurate), inverse, accurate)
    return x


def blocked_cholesky(g: Tensor, block: int, accurate: bool) -> Tensor:
    """Right-looking blocked Cholesky (lower L): panel solves, trailing updates as products."""
    a = g.clone()
    k = g.shape[-1]
    lower = torch.zeros_like(g)
    for j0 in range(0, k, block):
        j1 = min(j0 + block, k)
        diagonal = torch.linalg.cholesky_ex(a[..., j0:j1, j0:j1])[0]
        lower[..., j0:j1, j0:j1] = diagonal
        if j1 < k:
            panel = torch.linalg.solve_triangular(diagonal.mT, a[..., j1:, j0:j1], upper=True, left=False)
            lower[..., j1:, j0:j1] = panel
            a[..., j1:, j1:] -= product(panel, panel.mT, accurate)
    return lower


def tf32_gram(q: Tensor) -> Tensor:
    """QᵀQ in TF32 (float32 on CPU)."""
    with eb.float32_matmul_precision("high" if q.is_cuda else "highest"):
        return q.mT @ q


def first_pass(factor: Tensor, q_old: Tensor, accurate: bool) -> tuple[Tensor, Tensor]:
    """(Ŷ, Q₁): the shifted, column-normalized power-iteration product of a warm basis and the first Cholesky
    QR pass on it, with its Gram matrix split-TF32 accurate (as the refresh computes it) or TF32."""
    y = eb.accurate_matmul(factor, q_old)
    y = y / y[..., :, :1].norm(dim=-2, keepdim=True) + eb.SHIFT * q_old
    y_hat = (y / torch.linalg.vector_norm(y, dim=-2, keepdim=True)).contiguous()
    gram = eb.accurate_gram(y_hat) if accurate else tf32_gram(y_hat)
    return y_hat, eb.cholesky_qr_pass(y_hat, gram, eb.FIRST_PASS_SHIFT)[0]


def defect(q: Tensor) -> float:
    """max|QᵀQ − I| in float64."""
    q64 = q.to(torch.float64)
    return float((q64.mT @ q64 - torch.eye(q.shape[-1], dtype=torch.float64, device=q.device)).abs().max())


def warm_factor(k: int, device: torch.device, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(K, Q_old): a factor and float64 eigh's basis of the factor one perturbed gradient before."""
    gen = torch.Generator(device=device).manual_seed(seed)
    g = torch.randn(k, 2 * k, device=device, generator=gen) / k
    before = g @ g.mT
    g = g + 0.05 * torch.randn(k, 2 * k, device=device, generator=gen) / k
    q_old = torch.linalg.eigh(before.double())[1].flip(-1).float().contiguous()
    return g @ g.mT, q_old


def operations(k: int, device: torch.device, repeats: int) -> None:
    """One refresh's operations, ms each."""
    factor, q_old = warm_factor(k, device)
    y = eb.accurate_matmul(factor, q_old)
    y_hat = (y / torch.linalg.vector_norm(y, dim=-2, keepdim=True)).contiguous()
    gram = eb.accurate_gram(y_hat) + eb.FIRST_PASS_SHIFT * torch.eye(k, device=device)
    r = torch.linalg.cholesky_ex(gram)[0].mT.contiguous()
    bf16 = factor.bfloat16(), q_old.bfloat16()
    with eb.float32_matmul_precision("highest"):
        rows = {"K·Q float32": median_ms(lambda: factor @ q_old, device, repeats)}
    rows["K·Q TF32"] = median_ms(lambda: product(factor, q_old, False), device, repeats)
    rows["K·Q bf16"] = median_ms(lambda: bf16[0] @ bf16[1], device, repeats)
    rows["K·Q split TF32 (accurate_matmul)"] = median_ms(lambda: eb.accurate_matmul(factor, q_old), device, repeats)
    rows["QᵀQ split TF32 (accurate_gram)"] = median_ms(lambda: eb.accurate_gram(q_old), device, repeats)
    rows["ŶᵀŶ TF32"] = median_ms(lambda: tf32_gram(y_hat), device, repeats)
    rows["cholesky_ex"] = median_ms(lambda: torch.linalg.cholesky_ex(gram), device, repeats)
    rows["solve_triangular (Ŷ·R⁻¹)"] = median_ms(
        lambda: torch.linalg.solve_triangular(r, y_hat, upper=True, left=False), device, repeats
    )
    refresh = (factor[None], q_old[None], lambda a, b: eigh_descending(a, fallback=b))
    rows["power_cholqr (whole refresh)"] = median_ms(lambda: eb.power_cholqr(*refresh), device, repeats)
    rows["eigh float32"] = median_ms(lambda: torch.linalg.eigh(factor), device, max(1, repeats // 3))
    rows["Householder qr of K·Q float32"] = median_ms(lambda: torch.linalg.qr(y), device, max(1, repeats // 3))
    print(f"k = {k}: one refresh's operations (ms)")
    for name, ms in rows.items():
        print(f"  {name:36s} {ms:9.3f}")


def replacements(k: int, device: torch.device, repeats: int, blocks: list[int]) -> None:
    """The float32 Cholesky QR passes against product-based replacements: ms, error, orthogonality."""
    factor, q_old = warm_factor(k, device)
    y_hat, q_1 = first_pass(factor, q_old, accurate=True)
    eye = torch.eye(k, device=device)
    gram_1 = eb.accurate_gram(y_hat)
    r_1 = torch.linalg.cholesky_ex(gram_1)[0].mT.contiguous()
    gram_2 = eb.accurate_gram(q_1)
    r_2 = torch.linalg.cholesky_ex(gram_2)[0].mT.contiguous()
    print(f"k = {k}: the passes' float32 operations against product-based ones (ms, error, max|QᵀQ − I|)")
    print(f"  second pass input: max|QᵀQ − I| {float((gram_2 - eye).abs().max()):.1e}, "
          f"‖QᵀQ − I‖_F {float(torch.linalg.matrix_norm(gram_2 - eye)):.1e}")  # fmt: skip
    compare_solves("first pass", y_hat, r_1, (False,), blocks, device, repeats)
    compare_solves("second pass", q_1, r_2, (False, True), blocks, device, repeats)
    compare_choleskys("first pass", gram_1, blocks, device, repeats)
    compare_choleskys("second pass", gram_2, blocks, device, repeats)


def compare_solves(
    name: str, q_in: Tensor, r: Tensor, accurate_options: tuple[bool, ...], blocks: list[int],
    device: torch.device, repeats: int,
) -> None:  # fmt: skip
    """Q_in·R⁻¹ by ``solve_triangular`` and by the blocked solve and inverse: ms, error, orthogonality."""
    want = torch.linalg.solve_triangular(r.double(), q_in.double(), upper=True, left=False)

    def report(label: str, run: Callable[[], Tensor]) -> None:
        ms, q = median_ms(run, device, repeats), run()
        error = float((q.double() - want).abs().max() / want.abs().max())
        print(f"  {name}, {label:34s} {ms:8.3f} ms  error {error:.1e}  defect {defect(q):.1e}")

    report("solve_triangular float32", lambda: torch.linalg.solve_triangular(r, q_in, upper=True, left=False))
    for block in blocks:
        for accurate in accurate_options:
            label = "split TF32" if accurate else "TF32"
            report(f"blocked solve b={block} {label}", lambda b=block, a=accurate: blocked_solve(q_in, r, b, a))
            report(
                f"blocked inverse b={block} {label}",
                lambda b=block, a=accurate: product(q_in, blocked_inverse(r, b, a), a),
            )


def compare_choleskys(name: str, gram: Tensor, blocks: list[int], device: torch.device, repeats: int) -> None:
    """``cholesky_ex`` and the blocked Cholesky of one pass's Gram matrix: ms, largest entry error."""
    want = torch.linalg.cholesky(gram.double())

    def report(label: str, run: Callable[[], Tensor]) -> None:
        ms, got = median_ms(run, device, repeats), run()
        print(f"  {name}, {label:34s} {ms:8.3f} ms  error {float((got.double() - want).abs().max()):.1e}")

    report("cholesky_ex float32", lambda: torch.linalg.cholesky_ex(gram)[0])
    for block in blocks:
        for accurate in (False, True):
            label = f"blocked Cholesky b={block} {'split TF32' if accurate else 'TF32'}"
            report(label, lambda b=block, a=accurate: blocked_cholesky(gram, b, a))


def series(k: int, batch: int, device: torch.device, repeats: int) -> None:
    """The second pass on the real first pass's output of ``batch`` warm factors: ‖QᵀQ − I‖_F after a first
    pass with a TF32 and with a split-TF32 Gram matrix; on the latter, the series pass against the Cholesky
    pass (ms, largest entry difference from float64 Cholesky QR, max|QᵀQ − I|)."""
    pairs = [warm_factor(k, device, seed) for seed in range(batch)]
    factor, q_old = torch.stack([f for f, _ in pairs]), torch.stack([q for _, q in pairs])
    eye = torch.eye(k, device=device)
    norms = {}
    for accurate in (False, True):
        _, q_1 = first_pass(factor, q_old, accurate)
        norms[accurate] = torch.linalg.matrix_norm(eb.accurate_gram(q_1) - eye).max().item()
    gram = eb.accurate_gram(q_1)
    q64 = q_1.double()
    want = torch.linalg.solve_triangular(torch.linalg.cholesky(q64.mT @ q64).mT, q64, upper=True, left=False)
    series_ms = median_ms(lambda: eb.series_pass(q_1, gram), device, repeats)
    cholesky_ms = median_ms(lambda: eb.cholesky_qr_pass(q_1, gram), device, repeats)
    by_series, by_cholesky = eb.series_pass(q_1, gram), eb.cholesky_qr_pass(q_1, gram)[0]
    print(
        f"k = {k}, {batch} warm factors: after the first pass ‖QᵀQ − I‖_F {norms[False]:.1e} (TF32 Gram), "
        f"{norms[True]:.1e} (split TF32; series where ≤ {eb.SERIES_DEFECT:.1e}); series pass {series_ms:.3f} ms, "
        f"Cholesky pass {cholesky_ms:.3f} ms; error {float((by_series.double() - want).abs().max()):.1e} and "
        f"{float((by_cholesky.double() - want).abs().max()):.1e}, defects {defect(by_series[0]):.1e} and "
        f"{defect(by_cholesky[0]):.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", type=int, nargs="+", default=[4096, 1024])
    parser.add_argument("--blocks", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="k = 128, blocks of 32 and 64, on CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    if args.quick:
        args.sides, args.blocks, args.repeats = [128], [32, 64], 3
    for k in args.sides:
        operations(k, device, args.repeats)
        replacements(k, device, args.repeats, [b for b in args.blocks if b < k])
        series(k, 1, device, args.repeats)
        series(k, 8 if k <= 1024 else 4, device, args.repeats)


if __name__ == "__main__":
    main()
