"""The arithmetic of Muon's element-wise passes on a block of entries, as Triton jit helpers shared by the
kernel over one shard (:mod:`.elementwise`) and the kernel over a list of shards (:mod:`.shard_lists`), so
both give the same bits (torch's: ``tests/test_elementwise_kernels.py``):

    momentum_entries:        B' = lerp(B, g, 1 − μ) rounded to B's dtype (stored when WRITE_BUFFER);
                             U = lerp(g, B', μ) (NESTEROV) or B', rounded to U's dtype (stored when WRITE_INPUT)
    decay_and_add_entries:   θ' = round(θ·d) + a·O, the product rounded to θ's dtype, then one fused
                             multiply-add in fp32 (as ``mul_`` then ``add_(alpha=)``); returns O in fp32

``lerp`` is ATen's (:mod:`.lerp`). Each helper loads and stores at ``offsets`` from its pointers where
``inside``.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without Triton; the kernels that would use these are not defined
    triton = None

if triton is not None:
    from .lerp import lerp

    @triton.jit
    def momentum_entries(
        g_ptr,
        b_ptr,
        u_ptr,
        offsets,
        inside,
        w_advance,
        one_minus_w_advance,
        w_nesterov,
        one_minus_w_nesterov,
        SMALL_ADVANCE: tl.constexpr,
        SMALL_NESTEROV: tl.constexpr,
        NESTEROV: tl.constexpr,
        WRITE_BUFFER: tl.constexpr,
        WRITE_INPUT: tl.constexpr,
    ):
        """B' = lerp(B, g, 1 − μ) into b (WRITE_BUFFER); U = lerp(g, B', μ) or B' into u (WRITE_INPUT)."""
        g = tl.load(g_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        advanced = lerp(b, g, w_advance, one_minus_w_advance, SMALL_ADVANCE).to(b_ptr.dtype.element_ty)
        if WRITE_BUFFER:
            tl.store(b_ptr + offsets, advanced, mask=inside)
        if WRITE_INPUT:
            u = advanced.to(tl.float32)
            if NESTEROV:
                u = lerp(g, u, w_nesterov, one_minus_w_nesterov, SMALL_NESTEROV)
            tl.store(u_ptr + offsets, u.to(u_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def decay_and_add_entries(p_ptr, o_ptr, offsets, inside, decay, alpha):
        """θ ← round(θ·decay) + alpha·O (one fused multiply-add); returns O in fp32 (0 outside)."""
        p = tl.load(p_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        decayed = (p * decay).to(p_ptr.dtype.element_ty).to(tl.float32)
        tl.store(p_ptr + offsets, tl.fma(o, alpha, decayed).to(p_ptr.dtype.element_ty), mask=inside)
        return o
