"""ATen's ``lerp`` as the element-wise kernels compute it, and the fp32 scalars they receive:

    lerp(a, b, w) = a + w·(b − a)            for |w| < 0.5
                  = b − (b − a)·(1 − w)      otherwise

each as one fused multiply-add in fp32 (ATen's formula for a scalar weight, so a kernel that uses it gives
``torch.lerp``'s bits on the GPU).
"""

from __future__ import annotations

import struct

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without Triton; the kernels that would use lerp are not defined
    triton = None


def as_fp32(value: float) -> float:
    """``value`` as the fp32 number a kernel receives (Python's double rounded to nearest)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def fp32_bits(value: float) -> int:
    """The bits of ``value`` as fp32 (:func:`as_fp32`), as a signed 32-bit integer (for a kernel's int64 table,
    read back with ``.to(tl.int32).to(tl.float32, bitcast=True)``)."""
    return struct.unpack("i", struct.pack("f", value))[0]


def lerp_weights(weight: float) -> tuple[float, float, bool]:
    """(w, 1 − w, |w| < 0.5) in fp32, as ATen's lerp computes them for a scalar weight (1 − w: the fp32
    difference, exact in double and rounded once)."""
    w = as_fp32(weight)
    return w, as_fp32(1.0 - w), abs(w) < 0.5


if triton is not None:

    @triton.jit
    def lerp(start, end, weight, one_minus_weight, SMALL: tl.constexpr):
        """ATen's lerp in fp32: start + w·(end − start) for a small w, else end − (end − start)·(1 − w)."""
        if SMALL:
            return tl.fma(end - start, weight, start)
        return tl.fma(-(end - start), one_minus_weight, end)
