"""The end of a kernel that reduces each matrix to one number in its own launch: the programs of matrix b each
store their block's partial sum, then take a ticket from b's counter (an atomic add with acquire-release
order); the program that draws the last ticket adds b's partial sums in a fixed order, chunk by chunk (so the
total is the same from launch to launch, whichever program finishes last), and sets the counter back to zero
for the next launch (:func:`.counters.ticket_counters`). Used by :mod:`.normalize` and :mod:`.elementwise`.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without Triton; its kernels are then never launched
    triton = None

if triton is not None:

    @triton.jit
    def store_partial_and_total(partial_ptr, counter_ptr, matrix, block, blocks, partial, CHUNK: tl.constexpr):
        """partial_ptr[matrix, block] = ``partial``, then the ticket; returns (last, total): whether this program
        drew the matrix's last ticket and, for that program, Σ_j partial_ptr[matrix, j] in the fixed order
        (0 for the others), after which it zeroes counter_ptr[matrix]."""
        tl.store(partial_ptr + matrix * blocks + block, partial)
        ticket = tl.atomic_add(counter_ptr + matrix, 1, sem="acq_rel")
        last = ticket == blocks - 1
        total = tl.zeros((CHUNK,), dtype=tl.float32)
        if last:
            for start in range(0, blocks, CHUNK):
                index = start + tl.arange(0, CHUNK)
                total += tl.load(partial_ptr + matrix * blocks + index, mask=index < blocks, other=0.0, volatile=True)
            tl.store(counter_ptr + matrix, 0)
        return last, tl.sum(total, axis=0)
