"""Muon's momentum pass with the buffer B kept in a low-precision format (``momentum_dtype``,
:mod:`.low_precision`), one Triton kernel per format on the GPU:

    stored_momentum_step:
        B decoded to fp32 (bf16 widened, or int8 codes q times their block's scale s), B' = lerp(B, g, 1 − μ) and
        U = lerp(g, B', μ) (Nesterov) or B' in fp32, B' encoded back (bf16 stochastic rounding with noise
        hashed from B' and g, or int8 with s' = max|B'|/127 per block and q' = round_half_even(B'/s')), U rounded
        once to the gradient's dtype

``lerp`` is ATen's (:mod:`.lerp`). The kernels run where :func:`_stored_kernel_applies` says (CUDA,
contiguous, of any size) and give the torch operations' bits: integer operations, IEEE divisions (``div_rn``),
the same lerp, and no multiply-add contracted that torch rounds twice; elsewhere the torch operations run. Unlike
float32 momentum, whose small shards share one launch (:func:`.elementwise.momentum_steps`), a stored format
takes a launch per shard at every size, small shards included (a Qwen3-30B-A3B expert shard at 64 ranks holds
3.1 M entries, below :data:`.elementwise.MIN_KERNEL_NUMEL`): its torch operations are about twenty launches per
shard, with no multi-tensor form in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .elementwise import BLOCK
from .lerp import lerp_weights
from .low_precision import HASH_MULTIPLIER, INT8_BLOCK, decode_int8, encode_int8, round_bf16_stochastic

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without Triton; every call then takes the torch operations
    triton = None

INT8_ROWS = 16
"""Rows of one int8 momentum program (each ``INT8_BLOCK`` entries of its rows: one scale per row)."""

if triton is not None:
    from .lerp import lerp

    _HASH_MULTIPLIER: tl.constexpr = tl.constexpr(HASH_MULTIPLIER)

    @triton.jit
    def _mix32(v):
        """The noise mixer h of :mod:`.low_precision` on uint32 (products wrap mod 2³²)."""
        v = ((v >> 16) ^ v) * _HASH_MULTIPLIER
        v = ((v >> 16) ^ v) * _HASH_MULTIPLIER
        return (v >> 16) ^ v

    @triton.jit
    def _stochastic_bf16(x, key):
        """fp32 ``x`` stochastically rounded to bf16 with the noise of fp32 ``key`` (:mod:`.low_precision`)."""
        bits = x.to(tl.uint32, bitcast=True)
        noise = _mix32(bits ^ _mix32(key.to(tl.uint32, bitcast=True))) & 0xFFFF
        rounded = ((bits + noise) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(x != x, x.to(tl.bfloat16), rounded)

    @triton.jit
    def _stochastic_momentum_kernel(
        g_ptr,
        b_ptr,
        u_ptr,
        N,
        w_advance,
        one_minus_w_advance,
        w_nesterov,
        one_minus_w_nesterov,
        SMALL_ADVANCE: tl.constexpr,
        SMALL_NESTEROV: tl.constexpr,
        NESTEROV: tl.constexpr,
        WRITE_BUFFER: tl.constexpr,
        WRITE_INPUT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """B' = lerp(B, g, 1 − μ) in fp32 from the bf16 b, stored stochastically rounded (WRITE_BUFFER);
        U = lerp(g, B', μ) or B' from the fp32 B' into u (WRITE_INPUT)."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < N
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        advanced = lerp(b, g, w_advance, one_minus_w_advance, SMALL_ADVANCE)
        if WRITE_BUFFER:
            tl.store(b_ptr + offsets, _stochastic_bf16(advanced, g), mask=inside)
        if WRITE_INPUT:
            u = advanced
            if NESTEROV:
                u = lerp(g, u, w_nesterov, one_minus_w_nesterov, SMALL_NESTEROV)
            tl.store(u_ptr + offsets, u.to(u_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _int8_momentum_kernel(
        g_ptr,
        q_ptr,
        s_ptr,
        u_ptr,
        ROWS,
        COLUMNS,
        SCALES,
        w_advance,
        one_minus_w_advance,
        w_nesterov,
        one_minus_w_nesterov,
        SMALL_ADVANCE: tl.constexpr,
        SMALL_NESTEROV: tl.constexpr,
        NESTEROV: tl.constexpr,
        WRITE_BUFFER: tl.constexpr,
        WRITE_INPUT: tl.constexpr,
        ROWS_PER_PROGRAM: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """On block program_id(1) of ROWS_PER_PROGRAM rows of a [ROWS, COLUMNS] shard: B = q·s decoded, B' =
        lerp(B, g, 1 − μ) in fp32, stored as s' = max|B'|/127 and q' = round_half_even(B'/s') (WRITE_BUFFER);
        U = lerp(g, B', μ) or B' from the fp32 B' into u (WRITE_INPUT)."""
        rows = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
        block = tl.program_id(1).to(tl.int64)
        columns = block * BLOCK + tl.arange(0, BLOCK)
        row_inside = rows < ROWS
        inside = row_inside[:, None] & (columns < COLUMNS)[None, :]
        offsets = rows[:, None] * COLUMNS + columns[None, :]
        scale_offsets = rows * SCALES + block
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + offsets, mask=inside, other=0).to(tl.float32)
        s = tl.load(s_ptr + scale_offsets, mask=row_inside, other=0.0)
        advanced = lerp(q * s[:, None], g, w_advance, one_minus_w_advance, SMALL_ADVANCE)
        if WRITE_BUFFER:
            new_s = tl.div_rn(tl.max(tl.where(inside, tl.abs(advanced), 0.0), axis=1), 127.0)
            quotient = tl.div_rn(advanced, new_s[:, None])
            finite = tl.abs(quotient) < float("inf")  # false for NaN too
            # round half to even: adding and removing 1.5·2²³ leaves |y| < 2²² rounded to an integer
            codes = tl.where(finite, (quotient + 12582912.0) - 12582912.0, 0.0)
            codes = tl.minimum(tl.maximum(codes, -127.0), 127.0)
            tl.store(q_ptr + offsets, codes.to(tl.int8), mask=inside)
            tl.store(s_ptr + scale_offsets, new_s, mask=row_inside)
        if WRITE_INPUT:
            u = advanced
            if NESTEROV:
                u = lerp(g, u, w_nesterov, one_minus_w_nesterov, SMALL_NESTEROV)
            tl.store(u_ptr + offsets, u.to(u_ptr.dtype.element_ty), mask=inside)


def stored_momentum_step(
    grad: Tensor,
    buffer: Tensor,
    scales: Tensor | None,
    momentum: float,
    nesterov: bool,
    *,
    write_buffer: bool,
    want_input: bool,
) -> Tensor | None:
    """The momentum pass on a buffer kept in a low-precision format (module formula): ``buffer`` bf16 (stochastic
    rounding, ``scales`` None) or int8 codes with their float32 ``scales`` (one per :data:`INT8_BLOCK` entries
    of the last dimension). B' and U are computed in fp32 from the decoded B; B' is encoded back into ``buffer``
    (and ``scales``) in place when ``write_buffer``; U (a new tensor of the gradient's dtype) is returned when
    ``want_input``, else None. One Triton kernel where it applies (:func:`_stored_kernel_applies`), else torch
    operations with the same bits."""
    if not (write_buffer or want_input):
        raise ValueError("stored_momentum_step: nothing to write (write_buffer and want_input are both False)")
    if (buffer.dtype == torch.int8) != (scales is not None) or buffer.dtype not in (torch.int8, torch.bfloat16):
        raise ValueError(
            f"stored_momentum_step: expected a bfloat16 buffer without scales or int8 codes with scales, got "
            f"{buffer.dtype} {'with' if scales is not None else 'without'} scales"
        )
    if not _stored_kernel_applies(grad, buffer, scales):
        return _stored_momentum_step_torch(grad, buffer, scales, momentum, nesterov, write_buffer, want_input)
    u = torch.empty_like(grad) if want_input else grad
    with torch.cuda.device(buffer.device):
        _launch_stored_momentum(grad, buffer, scales, u, momentum, nesterov, write_buffer, want_input)
    return u if want_input else None


def _stored_kernel_applies(grad: Tensor, buffer: Tensor, scales: Tensor | None) -> bool:
    """Whether the stored-momentum kernels take these tensors: Triton present, one CUDA device, one shape, a
    floating gradient, all contiguous, at least one entry (any size above: module docstring; an empty shard, a
    rank's piece of an unevenly sharded parameter, takes the torch operations, which do nothing to it)."""
    tensors = (grad, buffer) if scales is None else (grad, buffer, scales)
    return (
        triton is not None
        and grad.is_cuda
        and grad.numel() > 0
        and grad.is_floating_point()
        and grad.shape == buffer.shape
        and all(t.is_contiguous() and t.device == grad.device for t in tensors)
    )


def _stored_momentum_step_torch(
    grad: Tensor,
    buffer: Tensor,
    scales: Tensor | None,
    momentum: float,
    nesterov: bool,
    write_buffer: bool,
    want_input: bool,
) -> Tensor | None:
    g = grad.to(torch.float32)
    b = buffer.to(torch.float32) if scales is None else decode_int8(buffer, scales)
    advanced = b.lerp(g, 1 - momentum)
    if write_buffer:
        if scales is None:
            buffer.copy_(round_bf16_stochastic(advanced, g))
        else:
            codes, new_scales = encode_int8(advanced)
            buffer.copy_(codes)
            scales.copy_(new_scales)
    if not want_input:
        return None
    u = g.lerp(advanced, momentum) if nesterov else advanced
    return u.to(grad.dtype)


def _launch_stored_momentum(
    grad: Tensor,
    buffer: Tensor,
    scales: Tensor | None,
    u: Tensor,
    momentum: float,
    nesterov: bool,
    write_buffer: bool,
    write_input: bool,
) -> None:
    """The stored-momentum kernel of ``buffer``'s format (any device the running Triton serves)."""
    w_advance, one_minus_advance, small_advance = lerp_weights(1 - momentum)
    w_nesterov, one_minus_nesterov, small_nesterov = lerp_weights(momentum)
    weights = (w_advance, one_minus_advance, w_nesterov, one_minus_nesterov)
    flags = dict(
        SMALL_ADVANCE=small_advance,
        SMALL_NESTEROV=small_nesterov,
        NESTEROV=nesterov,
        WRITE_BUFFER=write_buffer,
        WRITE_INPUT=write_input,
    )
    if scales is None:
        n = buffer.numel()
        _stochastic_momentum_kernel[(triton.cdiv(n, BLOCK),)](
            grad, buffer, u, n, *weights, **flags, BLOCK=BLOCK, num_warps=4
        )
        return
    columns = buffer.shape[-1]
    rows = buffer.numel() // columns
    blocks = scales.shape[-1]
    _int8_momentum_kernel[(triton.cdiv(rows, INT8_ROWS), blocks)](
        grad,
        buffer,
        scales,
        u,
        rows,
        columns,
        blocks,
        *weights,
        **flags,
        ROWS_PER_PROGRAM=INT8_ROWS,
        BLOCK=INT8_BLOCK,
        num_warps=4,
        enable_fp_fusion=False,  # q·s stays a product rounded once, as torch's decode
    )
