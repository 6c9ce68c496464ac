"""Muon's element-wise passes on the GPU, one Triton kernel each (every tensor read once, written once):

    momentum_step:    B' = lerp(B, g, 1 − μ),  U = lerp(g, B', μ) (Nesterov) or B'
                      writes B' when asked (the step's advance) and U when asked (the direction's input)
                      (with B in a low-precision format: :mod:`.stored_momentum`)
    decay_and_add_:   θ ← θ·(1 − γλ) − γ'·O
    decay_and_add_with_norms_:
                      the same, and ‖O_b‖_F = √(Σ O_b²) (fp32) of each matrix b of O in the same pass

``lerp(a, b, w)`` is ATen's: a + w·(b − a) for |w| < 0.5, else b − (b − a)·(1 − w), each as one fused
multiply-add, in fp32, rounded to the tensor's dtype; ``decay_and_add_`` rounds θ·(1 − γλ) to θ's dtype, then
adds −γ'·O with one fused multiply-add, as ``mul_`` then ``add_(alpha=)`` do. torch runs the same steps as
two or three kernels: on the Qwen3-30B-A3B shapes that is 24 + 18 bytes per fp32 element for momentum and
apply, against 16 (14 with U written in bf16, 12 without the buffer write) and 10 here.
``decay_and_add_with_norms_`` gives the step's metrics the norm of each matrix it applies (a unit of stacked
experts: one launch instead of a norm's and the apply's); it ends in the norms as normalize.py's kernel ends in
its scale, the last program of a matrix adding the block sums in a fixed order
(:func:`.ordered_sum.store_partial_and_total`), so the norms are the same from launch to launch.

On CUDA the kernels run on tensors of at least :data:`MIN_KERNEL_NUMEL` entries; of a rank's smaller shards,
the largest, as many as hold :data:`.shard_lists.MIN_LIST_MEAN_NUMEL` entries a shard on average, take one
launch for the list (:mod:`.shard_lists`, the same arithmetic: :mod:`.entrywise`), the rest torch's
multi-tensor operations. All give the same bits there (``tests/test_elementwise_kernels.py`` checks it on the
GPU), so the step stays bitwise the same at every world size, whatever size each rank's shards have. Off CUDA
(and for a tensor lr, a non-contiguous region, or without Triton) the torch operations run, which on CPU keeps
the step bitwise equal to ``torch.optim.Muon``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .counters import ticket_counters
from .lerp import as_fp32, lerp_weights
from .shard_lists import decay_and_add_list, list_layout, momentum_list

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without Triton; every call then takes the torch operations
    triton = None

BLOCK = 2048
CHUNK = 1024
"""Block sums the last program of a matrix adds per iteration, in order (:func:`decay_and_add_with_norms_`)."""
MAX_NORM_MATRICES = 65535
"""Most matrices :func:`decay_and_add_with_norms_` takes in one launch (the grid's second dimension)."""
MIN_KERNEL_NUMEL = 1 << 22
"""Below this many entries the torch operations run: a Triton launch costs the host several times a torch
launch, more than the traffic it saves on a small shard.
Chosen by measurement: BENCHMARKS.md "Whole optimizer step", the shard-size rule (re-measure: bench/elementwise.py)."""

if triton is not None:
    from .entrywise import decay_and_add_entries, momentum_entries
    from .ordered_sum import store_partial_and_total

    @triton.jit
    def _momentum_kernel(
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
        """B' = lerp(B, g, 1 − μ) into b (WRITE_BUFFER); U = lerp(g, B', μ) or B' into u (WRITE_INPUT)."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        momentum_entries(
            g_ptr,
            b_ptr,
            u_ptr,
            offsets,
            offsets < N,
            w_advance,
            one_minus_w_advance,
            w_nesterov,
            one_minus_w_nesterov,
            SMALL_ADVANCE,
            SMALL_NESTEROV,
            NESTEROV,
            WRITE_BUFFER,
            WRITE_INPUT,
        )

    @triton.jit
    def _decay_and_add_kernel(p_ptr, o_ptr, N, decay, alpha, BLOCK: tl.constexpr):
        """θ ← round(θ·decay) + alpha·O (one fused multiply-add)."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        decay_and_add_entries(p_ptr, o_ptr, offsets, offsets < N, decay, alpha)

    @triton.jit
    def _decay_and_add_norms_kernel(
        p_ptr, o_ptr, partial_ptr, counter_ptr, norms_ptr, N, decay, alpha, BLOCK: tl.constexpr, CHUNK: tl.constexpr
    ):
        """θ ← round(θ·decay) + alpha·O as :func:`_decay_and_add_kernel` on the N entries of matrix
        b = program_id(1), and partial[b, block] = Σ O² (fp32) over the block's entries; the last program of
        matrix b to finish writes norms[b] = √Σ_j partial[b, j], summed chunk by chunk in a fixed order, and
        zeroes counter[b] (module docstring)."""
        matrix = tl.program_id(1).to(tl.int64)
        block = tl.program_id(0)
        blocks = tl.num_programs(0)
        offsets = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < N
        o = decay_and_add_entries(p_ptr, o_ptr, matrix * N + offsets, inside, decay, alpha)
        last, total = store_partial_and_total(
            partial_ptr, counter_ptr, matrix, block, blocks, tl.sum(o * o, axis=0), CHUNK
        )
        if last:
            tl.store(norms_ptr + matrix, tl.sqrt(total))


def _kernel_applies(*tensors: Tensor, any_layout: int = 0) -> bool:
    """Whether the kernels can take these tensors: Triton present, all on one CUDA device, of one shape, at
    least :data:`MIN_KERNEL_NUMEL` entries, floating, and contiguous (but for the last ``any_layout`` of them,
    which the caller makes so)."""
    first = tensors[0]
    return (
        triton is not None
        and first.is_cuda
        and first.numel() >= MIN_KERNEL_NUMEL
        and all(
            (i >= len(tensors) - any_layout or t.is_contiguous())
            and t.shape == first.shape
            and t.device == first.device
            and t.is_floating_point()
            for i, t in enumerate(tensors)
        )
    )


def momentum_step(
    grad: Tensor,
    buffer: Tensor,
    momentum: float,
    nesterov: bool,
    *,
    write_buffer: bool,
    want_input: bool,
    input_dtype: torch.dtype | None = None,
) -> Tensor | None:
    """The momentum pass (module formula) in one kernel: advances ``buffer`` in place when ``write_buffer``,
    returns U when ``want_input``, else None. A new U is written in ``input_dtype`` (default: ``buffer``'s),
    rounded once to nearest even from the fp32 value, as the first cast of the direction that reads it would
    round it: for Newton–Schulz in bf16, 2 bytes an entry written here and read there instead of 4, the same
    bits. Without the kernel (:func:`_kernel_applies`) it runs the same steps as torch operations, and U keeps
    ``buffer``'s dtype (a cast there would be a launch more), as it does where U is B' itself (no Nesterov)."""
    if not (write_buffer or want_input):
        raise ValueError("momentum_step: nothing to write (write_buffer and want_input are both False)")
    if not _kernel_applies(grad, buffer):
        return _momentum_step_torch(grad, buffer, momentum, nesterov, write_buffer, want_input)
    if write_buffer and not nesterov:  # U is B' itself
        result = buffer if want_input else None
        want_input = False
    else:
        result = None
    u = torch.empty_like(buffer, dtype=input_dtype or buffer.dtype) if want_input else buffer
    with torch.cuda.device(buffer.device):
        _launch_momentum(grad, buffer, u, momentum, nesterov, write_buffer, want_input)
    return u if want_input else result


def momentum_steps(
    grads: list[Tensor],
    buffers: list[Tensor],
    momentum: float,
    nesterov: bool,
    *,
    write_buffer: bool,
    want_input: bool,
    input_dtype: torch.dtype | None = None,
) -> list[Tensor | None]:
    """:func:`momentum_step` on each (grad, buffer) pair (U in ``input_dtype`` where a kernel runs). The pairs
    the one-shard kernel does not take (below :data:`MIN_KERNEL_NUMEL`) run together: those a list launch takes
    (:func:`.shard_lists.listed_shards`: the largest) as one launch (:func:`.shard_lists.momentum_list`), the rest
    as torch's multi-tensor (``_foreach_``) lerps, a few launches for all of them: the same lerps, so the same
    bits (on CPU torch's own loop of ``lerp``; on the GPU ``tests/test_elementwise_kernels.py`` compares them)."""
    if not (write_buffer or want_input):
        raise ValueError("momentum_steps: nothing to write (write_buffer and want_input are both False)")
    out: list[Tensor | None] = [None] * len(grads)
    small = []
    for i, (g, b) in enumerate(zip(grads, buffers)):
        if _kernel_applies(g, b) or g.shape != b.shape or g.dtype != b.dtype or g.device != b.device:
            out[i] = momentum_step(
                g, b, momentum, nesterov, write_buffer=write_buffer, want_input=want_input, input_dtype=input_dtype
            )
        else:
            small.append(i)
    if not small:
        return out
    split = list_layout([grads[i] for i in small], [buffers[i] for i in small])
    if split is not None:
        taken = [small[j] for j in split[0]]
        lists = momentum_list(
            [grads[i] for i in taken],
            [buffers[i] for i in taken],
            momentum,
            nesterov,
            write_buffer=write_buffer,
            want_input=want_input,
            input_dtype=input_dtype,
            layout=split[1],
        )
        for i, u in zip(taken, lists):
            out[i] = u
        small = sorted(set(small).difference(taken))
        if not small:
            return out
    g_small, b_small = [grads[i] for i in small], [buffers[i] for i in small]
    if write_buffer:
        torch._foreach_lerp_(b_small, g_small, 1 - momentum)
        advanced = b_small
    else:
        advanced = torch._foreach_lerp(b_small, g_small, 1 - momentum)
    if want_input:
        inputs = torch._foreach_lerp(g_small, advanced, momentum) if nesterov else advanced
        for i, u in zip(small, inputs):
            out[i] = u
    return out


def _launch_momentum(
    grad: Tensor, buffer: Tensor, u: Tensor, momentum: float, nesterov: bool, write_buffer: bool, write_input: bool
) -> None:
    """The momentum kernel over ``buffer.numel()`` entries (any device the running Triton serves)."""
    w_advance, one_minus_advance, small_advance = lerp_weights(1 - momentum)
    w_nesterov, one_minus_nesterov, small_nesterov = lerp_weights(momentum)
    n = buffer.numel()
    _momentum_kernel[(triton.cdiv(n, BLOCK),)](
        grad,
        buffer,
        u,
        n,
        w_advance,
        one_minus_advance,
        w_nesterov,
        one_minus_nesterov,
        SMALL_ADVANCE=small_advance,
        SMALL_NESTEROV=small_nesterov,
        NESTEROV=nesterov,
        WRITE_BUFFER=write_buffer,
        WRITE_INPUT=write_input,
        BLOCK=BLOCK,
        num_warps=4,
    )


def _momentum_step_torch(
    grad: Tensor, buffer: Tensor, momentum: float, nesterov: bool, write_buffer: bool, want_input: bool
) -> Tensor | None:
    advanced = buffer.lerp_(grad, 1 - momentum) if write_buffer else buffer.lerp(grad, 1 - momentum)
    if not want_input:
        return None
    return grad.lerp(advanced, momentum) if nesterov else advanced


def _apply_kernel_takes(param: Tensor, update: Tensor, decay: float | Tensor, alpha: float | Tensor) -> bool:
    """Whether the decay-and-add kernels run on (θ, O): float factors (a Tensor lr takes torch's operations) and
    tensors :func:`_kernel_applies` takes (``update`` in any layout: the caller makes it contiguous)."""
    return (
        not isinstance(decay, Tensor) and not isinstance(alpha, Tensor) and _kernel_applies(param, update, any_layout=1)
    )


def decay_and_add_(param: Tensor, update: Tensor, decay: float | Tensor, alpha: float | Tensor) -> None:
    """θ ← θ·decay + alpha·O in place (decay = 1 − γλ, alpha = −γ'): one kernel where it applies (``update``
    in any layout: copied to a contiguous one first), else ``mul_`` then ``add_(alpha=)``; a Tensor ``decay``
    or ``alpha`` (a Tensor lr) takes the torch operations."""
    if not _apply_kernel_takes(param, update, decay, alpha):
        param.mul_(decay)
        param.add_(update, alpha=alpha)
        return
    update = update.contiguous()  # O of a tall matrix arrives as a transposed view: one copy, the same kernel
    with torch.cuda.device(param.device):
        _launch_decay_and_add(param, update, decay, alpha)


def decay_and_add_with_norms_(
    param: Tensor, update: Tensor, decay: float | Tensor, alpha: float | Tensor, matrices: int
) -> Tensor | None:
    """θ ← θ·decay + alpha·O in place with :func:`decay_and_add_`'s bits, and where its kernel applies, in the
    same pass, ‖O_b‖_F = √(Σ O_b²) summed in fp32 for each of O's ``matrices`` matrices (its entries in
    order, ``numel / matrices`` each: the matrices of a ``[B, m, n]`` or ``[m, n]`` update): returned as a
    float32 tensor of ``matrices`` entries, the same from launch to launch (module docstring). Elsewhere
    (:func:`decay_and_add_`'s torch operations, or more than :data:`MAX_NORM_MATRICES` matrices) it applies
    as :func:`decay_and_add_` does and returns None: the caller takes the norms itself."""
    if matrices < 1 or param.numel() % matrices:
        raise ValueError(f"decay_and_add_with_norms_: {param.numel()} entries are not {matrices} matrices of one size")
    if matrices > MAX_NORM_MATRICES or not _apply_kernel_takes(param, update, decay, alpha):
        decay_and_add_(param, update, decay, alpha)
        return None
    update = update.contiguous()  # as in decay_and_add_: a transposed view is copied once
    norms = torch.empty(matrices, dtype=torch.float32, device=param.device)
    with torch.cuda.device(param.device):
        _launch_decay_and_add_with_norms(param, update, decay, alpha, norms)
    return norms


def decay_and_add_many(
    params: list[Tensor], updates: list[Tensor], decays: list[float | Tensor], alphas: list[float | Tensor]
) -> None:
    """:func:`decay_and_add_` on each (θ, O, decay, alpha). The pairs the one-shard kernel does not take run
    together: those of one (θ dtype, O dtype) that a list launch takes (:func:`.shard_lists.listed_shards`) as
    one launch (:func:`.shard_lists.decay_and_add_list`), the rest grouped by (decay, alpha) as torch's multi-tensor
    ``_foreach_mul_`` and ``_foreach_add_(alpha=)``: the same operations, so the same bits (on CPU torch's own
    loop of ``mul_`` and ``add_``; on the GPU ``tests/test_elementwise_kernels.py`` compares them)."""
    listed: dict[tuple[torch.dtype, torch.dtype, torch.device], list[int]] = {}
    for i, (p, o, decay, alpha) in enumerate(zip(params, updates, decays, alphas)):
        if isinstance(decay, Tensor) or isinstance(alpha, Tensor) or _apply_kernel_takes(p, o, decay, alpha):
            decay_and_add_(p, o, decay, alpha)
        else:
            listed.setdefault((p.dtype, o.dtype, p.device), []).append(i)
    small: dict[tuple[float, float, torch.device], list[int]] = {}
    for indices in listed.values():
        split = list_layout([params[i] for i in indices], [updates[i] for i in indices])
        if split is not None:
            taken = [indices[j] for j in split[0]]
            roles = ([params[i] for i in taken], [updates[i] for i in taken])
            factors = [decays[i] for i in taken], [alphas[i] for i in taken]
            decay_and_add_list(*roles, *factors, layout=split[1])  # type: ignore[arg-type]
            indices = sorted(set(indices).difference(taken))
        for i in indices:
            small.setdefault((decays[i], alphas[i], params[i].device), []).append(i)  # type: ignore[index]
    for (decay, alpha, _), indices in small.items():
        targets = [params[i] for i in indices]
        torch._foreach_mul_(targets, decay)
        torch._foreach_add_(targets, [updates[i] for i in indices], alpha=alpha)


def _launch_decay_and_add(param: Tensor, update: Tensor, decay: float, alpha: float) -> None:
    """The decay-and-add kernel over ``param.numel()`` entries (any device the running Triton serves)."""
    n = param.numel()
    _decay_and_add_kernel[(triton.cdiv(n, BLOCK),)](
        param, update, n, as_fp32(decay), as_fp32(alpha), BLOCK=BLOCK, num_warps=4
    )


def _launch_decay_and_add_with_norms(param: Tensor, update: Tensor, decay: float, alpha: float, norms: Tensor) -> None:
    """The decay-and-add kernel with the norms of ``norms.numel()`` matrices (any device the running Triton
    serves)."""
    matrices = norms.numel()
    per_matrix = param.numel() // matrices
    blocks = triton.cdiv(per_matrix, BLOCK)
    partials = torch.empty(matrices, blocks, dtype=torch.float32, device=param.device)
    _decay_and_add_norms_kernel[(blocks, matrices)](
        param,
        update,
        partials,
        ticket_counters(param.device, matrices),
        norms,
        per_matrix,
        as_fp32(decay),
        as_fp32(alpha),
        BLOCK=BLOCK,
        CHUNK=CHUNK,
        num_warps=4,
    )
