"""Triton kernel for products known to be symmetric (SYRK, and GEMMT-style X·Yᵀ), 2-D and batched.

    out = s_b^p·(alpha·X·Yᵀ + beta·C + d·I)     X, Y: [m, k] or [B, m, k] (bf16/fp16), Y = X by default
                                                (SYRK), C: [.., m, m] symmetric, s: an optional fp32
                                                scale per matrix b, p = 1 or 2

Accumulation is in fp32. Only the tiles that touch the lower triangle are computed; each is stored twice,
as itself (its part on or below the diagonal) and transposed into the upper triangle, so the result is
exactly symmetric and costs about m²k instead of 2m²k FLOPs. Newton–Schulz uses it for ``A = X·Xᵀ``
(alpha = 1, no C) and ``P = a·I + b·A + c·A·A`` (A symmetric, so A·A = A·Aᵀ: X = C = A); Gram
Newton–Schulz also for products of commuting symmetric matrices (R·Z = R·Zᵀ, symmetric in exact arithmetic),
where the lower triangle stands for the whole.

Tiles are BLOCK_M × BLOCK_N with BLOCK_M = RATIO·BLOCK_N (RATIO 1 or 2: 256×128 tiles keep Hopper's
tensor cores busier than 128×128 ones). Tile row I (BLOCK_M rows) holds the RATIO·(I + 1) column tiles
that reach the diagonal, so the tiles before row I number S(I) = RATIO·I·(I + 1)/2, inverted in the kernel.

Tiles are read through pointers (any strides, any size; masks at the edges) or, on Hopper and newer when
the strides allow it, through tensor-memory descriptors (TMA): built once on the host over the whole batch
read as one stacked matrix where its layout allows, else built per program on the device. A matrix whose rows are not
contiguous but whose columns are (a transposed view of a contiguous tall matrix) is read in its own
layout: the kernel loads Xᵀ tiles and transposes them in registers/shared memory, never in global memory.
With host descriptors the epilogue goes through descriptors too (faster than masked pointer stores:
docs/kernels.md "Measured constants"): C's tiles are loaded whole, tiles strictly below the diagonal and
inside the matrix are stored whole (the mirror image as one transposed tile store), square tiles on the
diagonal as one whole tile with their lower part mirrored into the upper; edge tiles through masked pointer
stores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .normalize import require_scale
from .shapes import decision_count

# The autotuner's candidates, (RATIO, BLOCK_N, BLOCK_K, num_warps, num_stages, maxnreg).
# Chosen by measurement: docs/kernels.md "Measured constants" (re-measure: tools/kernels/syrk_configs.py)
SYRK_SHAPES: tuple[tuple[int, int, int, int, int, int | None], ...] = (
    (1, 128, 64, 8, 3, None),
    (1, 128, 64, 8, 5, None),
    (1, 128, 64, 8, 3, 128),
    (1, 128, 64, 4, 3, None),
    (2, 128, 64, 8, 4, None),
)


def _set_host_blocks(nargs: dict) -> None:
    """Autotuning pre-hook: host-built descriptors take the block shape of the config being run."""
    if nargs["host_desc_a"] is None:
        return
    block_m, block_n, block_k = nargs["RATIO"] * nargs["BLOCK_N"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    transposed = nargs["TRANSPOSED"]
    nargs["host_desc_a"].block_shape = [block_k, block_m] if transposed else [block_m, block_k]
    if nargs["host_desc_b"] is not None:
        nargs["host_desc_b"].block_shape = [block_k, block_n] if transposed else [block_n, block_k]
    if nargs["host_desc_out"] is not None:
        nargs["host_desc_out"].block_shape = [block_m, block_n]
    if nargs["host_desc_out_t"] is not None:
        nargs["host_desc_out_t"].block_shape = [block_n, block_m]
    if nargs["host_desc_c"] is not None:
        nargs["host_desc_c"].block_shape = [block_m, block_n]


def _configs() -> list[triton.Config]:
    return [
        triton.Config(
            {"RATIO": r, "BLOCK_N": bn, "BLOCK_K": bk},
            num_warps=w,
            num_stages=s,
            maxnreg=regs,
            pre_hook=_set_host_blocks,
        )
        for r, bn, bk, w, s, regs in SYRK_SHAPES
    ]


def lower_tile_count(m: int, block_n: int, ratio: int) -> int:
    """Tiles of BLOCK_M = ratio·block_n rows and block_n columns that touch the lower triangle of m×m."""
    rows = triton.cdiv(m, ratio * block_n)
    return ratio * rows * (rows + 1) // 2


@triton.jit
def _store_lower_and_mirror(out_base, result, row0, col0, M, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Masked pointer stores: the tile's part on or below the diagonal, and its mirror image above."""
    rows = row0 + tl.arange(0, BLOCK_M)[:, None]
    cols = col0 + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out_base + rows * stride_om + cols, result, mask=(rows < M) & (cols < M) & (rows >= cols))
    mirror_rows = col0 + tl.arange(0, BLOCK_N)[:, None]
    mirror_cols = row0 + tl.arange(0, BLOCK_M)[None, :]
    tl.store(
        out_base + mirror_rows * stride_om + mirror_cols,
        tl.trans(result),
        mask=(mirror_rows < M) & (mirror_cols < M) & (mirror_rows < mirror_cols),
    )


@triton.jit
def _syrk_kernel(
    x_ptr,
    y_ptr,  # the right factor (Y = X for SYRK); same shape and strides as X
    host_desc_a,  # TMA_MODE 2: descriptors built on the host over the batch flattened into rows
    host_desc_b,  # unused (may be None) where X's descriptor serves: Y = X and square tiles
    host_desc_out,  # TMA_EPILOGUE: the output flattened into rows, tile and transposed-tile blocks
    host_desc_out_t,  # unused (may be None) with square tiles: host_desc_out serves
    host_desc_c,  # TMA_EPILOGUE and HAS_C: C flattened into rows
    c_ptr,
    scale_ptr,  # SCALE_POWER > 0: fp32, one entry per matrix of the batch
    out_ptr,
    M,
    K,
    BATCH,  # only an autotuning key: the batch index is program_id(1)
    stride_xb,
    stride_xm,
    stride_xk,
    stride_cb,
    stride_cm,
    stride_ob,
    stride_om,
    alpha,
    beta,
    diag,
    Y_IS_X: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    TMA_MODE: tl.constexpr,
    TMA_EPILOGUE: tl.constexpr,
    HAS_C: tl.constexpr,
    HAS_DIAG: tl.constexpr,
    SCALE_POWER: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    BLOCK_M: tl.constexpr = RATIO * BLOCK_N
    # Tile t: row I is the largest with S(I) = RATIO·I(I+1)/2 <= t (float estimate, then exact fix-ups).
    t = tl.program_id(0)
    batch = tl.program_id(1)
    ti = ((tl.sqrt((8 * t // RATIO + 1).to(tl.float32)) - 1.0) * 0.5).to(tl.int32)
    ti = tl.where(RATIO * (ti + 1) * (ti + 2) // 2 <= t, ti + 1, ti)
    ti = tl.where(RATIO * ti * (ti + 1) // 2 > t, ti - 1, ti)
    tj = t - RATIO * ti * (ti + 1) // 2
    row0 = ti * BLOCK_M
    col0 = tj * BLOCK_N
    if col0 >= M:  # the last tile row's columns past the matrix (m not a multiple of BLOCK_M)
        return

    x_base = x_ptr + batch.to(tl.int64) * stride_xb
    y_base = y_ptr + batch.to(tl.int64) * stride_xb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # With square tiles, X's row tiles and Y's column tiles (Y = X), and the output's tiles and transposed
    # tiles, have one block shape: one host descriptor serves both (fewer descriptors to encode per launch).
    desc_b = host_desc_a if Y_IS_X and RATIO == 1 else host_desc_b
    desc_out_t = host_desc_out if RATIO == 1 else host_desc_out_t
    if TMA_MODE == 2:
        if TRANSPOSED:  # rows of the flattened [B·K, M] storage: batch b's Xᵀ starts at row b·K
            for k0 in range(0, K, BLOCK_K):
                a_t = host_desc_a.load([batch * K + k0, row0])
                b_t = desc_b.load([batch * K + k0, col0])
                acc = tl.dot(tl.trans(a_t), b_t, acc)
        else:  # rows of the flattened [B·M, K] matrix; rows past M only reach masked outputs
            for k0 in range(0, K, BLOCK_K):
                a = host_desc_a.load([batch * M + row0, k0])
                b = desc_b.load([batch * M + col0, k0])
                acc = tl.dot(a, tl.trans(b), acc)
    elif TMA_MODE == 1:
        if TRANSPOSED:
            # Xᵀ is a contiguous [K, M] matrix: load [BLOCK_K, BLOCK] tiles of it.
            desc_a = tl.make_tensor_descriptor(
                x_base, shape=[K, M], strides=[stride_xk, 1], block_shape=[BLOCK_K, BLOCK_M]
            )
            desc_b = tl.make_tensor_descriptor(
                y_base, shape=[K, M], strides=[stride_xk, 1], block_shape=[BLOCK_K, BLOCK_N]
            )
            for k0 in range(0, K, BLOCK_K):
                a_t = desc_a.load([k0, row0])
                b_t = desc_b.load([k0, col0])
                acc = tl.dot(tl.trans(a_t), b_t, acc)
        else:
            desc_a = tl.make_tensor_descriptor(
                x_base, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K]
            )
            desc_b = tl.make_tensor_descriptor(
                y_base, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_N, BLOCK_K]
            )
            for k0 in range(0, K, BLOCK_K):
                a = desc_a.load([row0, k0])
                b = desc_b.load([col0, k0])
                acc = tl.dot(a, tl.trans(b), acc)
    else:
        rows_a = row0 + tl.arange(0, BLOCK_M)
        rows_b = col0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = x_base + rows_a[:, None] * stride_xm + ks[None, :] * stride_xk
        b_ptrs = y_base + rows_b[:, None] * stride_xm + ks[None, :] * stride_xk
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks)[None, :] < K
            a = tl.load(a_ptrs, mask=(rows_a[:, None] < M) & k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=(rows_b[:, None] < M) & k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BLOCK_K * stride_xk
            b_ptrs += BLOCK_K * stride_xk

    rows = row0 + tl.arange(0, BLOCK_M)[:, None]
    cols = col0 + tl.arange(0, BLOCK_N)[None, :]
    result = acc * alpha
    if HAS_C:
        if TMA_EPILOGUE:  # rows past M (edge tiles) read the next matrix's rows: never stored
            c_tile = host_desc_c.load([batch * M + row0, col0])
        else:
            c_tile = tl.load(
                c_ptr + batch.to(tl.int64) * stride_cb + rows * stride_cm + cols,
                mask=(rows < M) & (cols < M),
                other=0.0,
            )
        result += beta * c_tile.to(tl.float32)
    if HAS_DIAG:
        result += tl.where(rows == cols, diag, 0.0)
    if SCALE_POWER > 0:
        scale = tl.load(scale_ptr + batch)
        if SCALE_POWER == 2:
            scale = scale * scale
        result = result * scale
    result = result.to(out_ptr.dtype.element_ty)
    out_base = out_ptr + batch.to(tl.int64) * stride_ob
    if TMA_EPILOGUE:
        inside = row0 + BLOCK_M <= M
        if (col0 + BLOCK_N <= row0) & inside:
            # Strictly below the diagonal: two whole-tile stores, no masks.
            host_desc_out.store([batch * M + row0, col0], result)
            desc_out_t.store([batch * M + col0, row0], tl.trans(result))
        elif RATIO == 1:
            if (col0 == row0) & inside:
                # A square tile on the diagonal: its lower part mirrored into its upper part, one store.
                host_desc_out.store([batch * M + row0, col0], tl.where(rows >= cols, result, tl.trans(result)))
            else:
                _store_lower_and_mirror(out_base, result, row0, col0, M, stride_om, BLOCK_M, BLOCK_N)
        else:
            _store_lower_and_mirror(out_base, result, row0, col0, M, stride_om, BLOCK_M, BLOCK_N)
    else:
        _store_lower_and_mirror(out_base, result, row0, col0, M, stride_om, BLOCK_M, BLOCK_N)


def _time_config(kernel_call, quantiles: tuple[float, ...]) -> list[float]:
    """The autotuner's timing of one config: launches replayed from a CUDA graph. Timed launch by launch,
    a product at m = 4096 takes no longer on the GPU than its launch through Triton takes on the host
    (docs/kernels.md "Measured constants"), so the host's speed, not the config, would decide the choice.

    The graph runs on a stream of its own, so the device is synchronized before (the output buffer may be
    memory that work still queued on the caller's stream uses: a race that showed as a corrupted result of
    the previous computation) and after (no replay may still write it when the caller goes on)."""
    torch.cuda.synchronize()
    times = triton.testing.do_bench_cudagraph(kernel_call, rep=50, quantiles=quantiles)
    torch.cuda.synchronize()
    return times


# The config the autotuner chose, by the autotuner's key (see _launch).
_TUNED: dict[tuple, dict] = {}

_syrk_tuned = triton.autotune(
    configs=_configs(),
    key=["M", "K", "BATCH", "TRANSPOSED", "TMA_MODE", "TMA_EPILOGUE", "HAS_C"],
    do_bench=_time_config,
)(_syrk_kernel)

# Under the Triton interpreter (CPU tensors) there is nothing to tune: one small tile.
_INTERPRETER_CONFIG = {"RATIO": 1, "BLOCK_N": 32, "BLOCK_K": 32}


def _tma_allocator(size: int, alignment: int, stream: int | None) -> Tensor:
    """Global scratch for device-side tensor descriptors (Triton asks for it per launch)."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def tma_aligned(x: Tensor, transposed: bool) -> bool:
    """TMA needs a 16-byte aligned base and 16-byte aligned strides (elements are 2 bytes)."""
    strides = [x.stride(-1) if transposed else x.stride(-2)]
    if x.ndim == 3:
        strides.append(x.stride(0))
    return x.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides)


def is_transposed_view(x: Tensor) -> bool:
    """Columns contiguous (stride 1 along m) and rows not: x is Gᵀ for a row-major tall G."""
    return x.stride(-2) == 1 and x.stride(-1) != 1


TMA_MODES = ("off", "device", "host")


@functools.cache
def capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def on_hopper(x: Tensor) -> bool:
    """Whether ``x`` lives on a CUDA device of compute capability 9.0 or newer (TMA available)."""
    return x.device.type == "cuda" and capability_major(x.device.index or 0) >= 9


def _flattens(x3: Tensor, transposed: bool) -> bool:
    """Whether the batch can be read as one 2-D matrix of stacked rows ([B·M, K], or [B·K, M] storage for a
    transposed view) by a host-built descriptor: batches adjacent in memory, and for the transposed layout
    K a multiple of every BLOCK_K (its rows past K would belong to the next matrix)."""
    batch, m, k = x3.shape
    if batch == 1:
        return True
    if transposed:
        return x3.stride(0) == k * x3.stride(2) and k % 128 == 0
    return x3.stride(0) == m * x3.stride(1)


def tma_mode_for(x3: Tensor, tma: str | None) -> int:
    """0 pointers, 1 descriptors built per program on the device, 2 descriptors built on the host.

    ``tma`` None picks host descriptors on Hopper and newer where the layout allows, else device ones where
    the strides allow, else pointers; "off", "device" or "host" ask for one (falling back to pointers
    where the strides do not allow it)."""
    if tma is not None and tma not in TMA_MODES:
        raise ValueError(f"syrk: tma must be None or one of {TMA_MODES}, got {tma!r}")
    transposed = is_transposed_view(x3)
    if tma == "off" or not tma_aligned(x3, transposed) or (tma is None and not on_hopper(x3)):
        return 0
    if tma == "device" or not _flattens(x3, transposed):
        if x3.device.type == "cuda":
            triton.set_allocator(_tma_allocator)
        return 1
    return 2


def _flat_rows(t3: Tensor, transposed: bool) -> Tensor:
    """The batch as one stacked 2-D matrix: [B·M, K], or for a transposed view its [B·K, M] storage."""
    batch, m, k = t3.shape
    return t3.mT.reshape(batch * k, m) if transposed else t3.reshape(batch * m, k)


def _host_descriptors(
    x3: Tensor,
    y3: Tensor | None,
    out: Tensor,
    c3: Tensor | None,
    transposed: bool,
    epilogue: bool,
    config: dict | None,
) -> tuple[object, ...]:
    """Descriptors over the stacked batch: X's row tiles, Y's column tiles, and (``epilogue``) the output's
    tiles and transposed tiles and C's tiles (None where not used). With a known config of square tiles the
    kernel reads Y (``y3`` None: Y = X) and stores transposed tiles through X's and the output's
    descriptors, so those two are not built (each costs host time at every launch)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    # Placeholder blocks; the config (explicit here, or the autotuner's pre-hook) sets the real ones.
    def over(t: Tensor) -> object:
        return TensorDescriptor.from_tensor(t, [16, 16])

    square = config is not None and config["RATIO"] == 1
    flat_x = _flat_rows(x3, transposed)
    flat_out = out.reshape(-1, out.size(-1))
    descs = (
        over(flat_x),
        None if square and y3 is None else over(flat_x if y3 is None else _flat_rows(y3, transposed)),
        over(flat_out) if epilogue else None,
        over(flat_out) if epilogue and not square else None,
        over(c3.reshape(-1, c3.size(-1))) if epilogue and c3 is not None else None,
    )
    if config is not None:
        names = ("host_desc_a", "host_desc_b", "host_desc_out", "host_desc_out_t", "host_desc_c")
        _set_host_blocks({**dict(zip(names, descs)), "TRANSPOSED": transposed, **config})
    return descs


def _as_batch(t: Tensor, what: str) -> Tensor:
    if t.ndim not in (2, 3):
        raise ValueError(f"{what} must be a 2-D or 3-D tensor, got shape {tuple(t.shape)}")
    t3 = t if t.ndim == 3 else t.unsqueeze(0)
    return t3 if t3.stride(-1) == 1 or t3.stride(-2) == 1 else t3.contiguous()


def _launch(
    x: Tensor,
    y: Tensor | None,
    alpha: float,
    beta: float,
    c: Tensor | None,
    diag: float,
    tma: str | None,
    config: dict | None,
    scale: Tensor | None = None,
    scale_power: int = 1,
) -> Tensor:
    """``s^p·(alpha·X·Yᵀ + beta·C + diag·I)`` (Y = X when None; s = ``scale`` per matrix, p = ``scale_power``,
    or 1), lower tiles computed and mirrored."""
    x3 = _as_batch(x, "X")
    batch, m, k = x3.shape
    if scale is not None:
        require_scale(scale, batch, x.device, "syrk")
        if scale_power not in (1, 2):
            raise ValueError(f"syrk: scale_power must be 1 or 2, got {scale_power}")
    if y is None:
        y3 = x3
    else:
        y3 = _as_batch(y, "Y")
        if y3.shape != x3.shape or y3.stride() != x3.stride() or y3.dtype != x3.dtype:
            raise ValueError(
                f"symmetric_product: Y must match X in shape, strides and dtype, got {tuple(y.shape)} "
                f"{y.stride()} {y.dtype} against {tuple(x.shape)} {x.stride()} {x.dtype}"
            )
    transposed = is_transposed_view(x3)
    out = torch.empty((batch, m, m), device=x.device, dtype=x.dtype)
    if c is not None:
        c3 = c if c.ndim == 3 else c.unsqueeze(0)
        if c3.shape != out.shape or c3.stride(-1) != 1:
            raise ValueError(f"syrk: C must be [.., {m}, {m}] with contiguous rows, got {tuple(c.shape)}")
    else:
        c3 = out
    mode = tma_mode_for(x3, tma)
    if mode != 0 and not tma_aligned(y3, transposed):  # Y's base is not 16-byte aligned: read by pointers
        mode = 0

    def grid(meta: dict) -> tuple[int, int]:
        return (lower_tile_count(m, meta["BLOCK_N"], meta["RATIO"]), batch)

    if config is None and x.device.type == "cpu":
        config = _INTERPRETER_CONFIG
    launch_options = dict(config or {})
    # The epilogue through descriptors needs host descriptors, 16-byte aligned rows and a contiguous C; a
    # config may turn it off (benchmarks compare both).
    epilogue = (
        bool(launch_options.pop("TMA_EPILOGUE", True))
        and mode == 2
        and m % 8 == 0
        and (c is None or (c3.is_contiguous() and c3.data_ptr() % 16 == 0))
    )
    tuning_key = None
    if config is None:
        # The autotuner's own key, the batch counted as the dispatch counts it (a stack of units takes the
        # config of one unit: the same per-matrix arithmetic); once it has chosen, launch its choice directly
        # (its dispatch costs host time at every launch).
        tuning_key = (m, k, decision_count(x3), transposed, mode, epilogue, c is not None, x.dtype, x.device)
        launch_options = dict(_TUNED.get(tuning_key, {}))
    known = bool(launch_options)
    descs = (
        _host_descriptors(
            x3,
            y3 if y is not None else None,
            out,
            c3 if c is not None else None,
            transposed,
            epilogue,
            launch_options if known else None,
        )
        if mode == 2
        else (None,) * 5
    )
    kernel = _syrk_kernel if known else _syrk_tuned
    kernel[grid](
        x3,
        y3,
        *descs,
        c3,
        out if scale is None else scale,
        out,
        m,
        k,
        batch,
        x3.stride(0),
        x3.stride(1),
        x3.stride(2),
        c3.stride(0),
        c3.stride(1),
        out.stride(0),
        out.stride(1),
        float(alpha),
        float(beta),
        float(diag),
        Y_IS_X=y is None,
        TRANSPOSED=transposed,
        TMA_MODE=mode,
        TMA_EPILOGUE=epilogue,
        HAS_C=c is not None,
        HAS_DIAG=diag != 0.0,
        SCALE_POWER=0 if scale is None else scale_power,
        **launch_options,
    )
    if not known:
        _TUNED[tuning_key] = _syrk_tuned.best_config.all_kwargs()
    return out if x.ndim == 3 else out.squeeze(0)


def syrk(
    x: Tensor,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: Tensor | None = None,
    diag: float = 0.0,
    tma: str | None = None,
    config: dict | None = None,
    scale: Tensor | None = None,
    scale_power: int = 1,
) -> Tensor:
    """``alpha·X·Xᵀ + beta·C + diag·I`` for X [m, k] or [B, m, k]; C (optional) symmetric [.., m, m], rows
    contiguous; times s_b^scale_power per matrix b where ``scale`` (fp32, one entry per matrix) is given.

    Returns a new contiguous, exactly symmetric [.., m, m] tensor in x's dtype (fp32 accumulation).
    ``tma``: how tiles are read (see :func:`tma_mode_for`). ``config``: fixed tile parameters (RATIO,
    BLOCK_N, BLOCK_K, and optionally num_warps, num_stages, maxnreg, TMA_EPILOGUE) instead of autotuning; on
    CPU (the interpreter) a 32×32 tile.
    """
    return _launch(x, None, alpha, beta, c, diag, tma, config, scale, scale_power)


def symmetric_product(
    x: Tensor, y: Tensor, tma: str | None = None, config: dict | None = None, scale: Tensor | None = None
) -> Tensor:
    """X·Yᵀ for a product the caller knows to be symmetric (e.g. R·Z with R, Z symmetric and commuting):
    its lower triangle, computed in about half the FLOPs, mirrored into the upper one; times s_b per matrix
    b where ``scale`` is given.

    X and Y: [m, m] or [B, m, m] with the same shape, strides and dtype. Returns a new contiguous, exactly
    symmetric tensor; ``tma``, ``config`` and ``scale`` as for :func:`syrk`.
    """
    return _launch(x, y, 1.0, 0.0, None, 0.0, tma, config, scale)
