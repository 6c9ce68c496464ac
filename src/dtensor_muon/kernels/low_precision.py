"""Low-precision storage of the momentum buffer (``momentum_dtype``): the formats, as torch operations.

Each format stores a float32 value x (the advanced buffer B') in fewer bytes and gives back a float32 value:

- ``"bfloat16"``, stochastic rounding with element-local noise: with b the 32 bits of x and k the 32 bits of
  the gradient element (float32), the noise is r = h(b ⊕ h(k)) mod 2¹⁶, h the 32-bit mixer

      h(v) = ((v ≫ 16) ⊕ v)·c mod 2³² twice, then (v ≫ 16) ⊕ v,   c = 0x45D9F3B

  and the stored value is the top 16 bits of b + r (x's magnitude is rounded up, away from zero, exactly when
  the 16 bits dropped plus r carry into the 17th). For a uniform r the rounding is unbiased:
  P(up) = (x − ⌊x⌋)/(⌈x⌉ − ⌊x⌋), ⌊x⌋ and ⌈x⌉ the bf16 neighbours of x toward and away from zero. The noise is
  a function of the element's own values, not of its index or rank, so the stored bits are the same however
  the matrix is sharded. A NaN stays NaN.
- ``"int8"``, blockwise absmax: the last dimension is cut into blocks of :data:`INT8_BLOCK` entries (the last
  one shorter); per block s = max|x| / 127 (float32), q = round_half_even(x / s) (0 where s = 0), stored as
  int8 codes and float32 scales; decoding gives q·s. Every code is within s/2 of x.

The momentum step (:mod:`.elementwise`) decodes, advances and encodes in float32; its Triton kernels use the
same formulas (:mod:`.stored_momentum`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

MOMENTUM_DTYPES = ("float32", "bfloat16", "int8")
"""``momentum_dtype`` values: "float32" keeps the buffer in the parameter's dtype (float32 for float32
parameters; torch.optim.Muon's buffer), "bfloat16" and "int8" the formats of the module docstring."""

INT8_BLOCK = 128
"""Entries of the last dimension sharing one int8 scale: 4 bytes per 128 codes, 3% over 1 byte per entry.
A power of two, so that tensor-parallel splits of the usual widths fall on block boundaries."""

HASH_MULTIPLIER = 0x45D9F3B
"""The multiplier of the noise mixer h (Thomas Mueller's 32-bit integer hash)."""

_MASK32 = 0xFFFFFFFF
_INT8_MAX = 127.0


def momentum_bytes_per_element(momentum_dtype: str, param_dtype: torch.dtype = torch.float32) -> float:
    """Bytes of momentum state per parameter entry: the parameter's element size for "float32", 2 for
    "bfloat16", 1 + 4/:data:`INT8_BLOCK` for "int8" (a row whose last dimension is not a multiple of the
    block holds one more, partial block)."""
    if momentum_dtype == "float32":
        return float(torch.empty((), dtype=param_dtype).element_size())
    if momentum_dtype == "bfloat16":
        return 2.0
    if momentum_dtype == "int8":
        return 1.0 + 4.0 / INT8_BLOCK
    raise ValueError(f"momentum_dtype: expected one of {MOMENTUM_DTYPES}, got {momentum_dtype!r}")


def int8_blocks(columns: int) -> int:
    """Scales of one row of ``columns`` entries: ⌈columns / INT8_BLOCK⌉."""
    return math.ceil(columns / INT8_BLOCK)


def _unsigned_bits(x: Tensor) -> Tensor:
    """The 32 bits of float32 ``x`` as int64 values in [0, 2³²)."""
    return x.view(torch.int32).to(torch.int64) & _MASK32


def _mix32(v: Tensor) -> Tensor:
    """h of the module docstring on int64 values in [0, 2³²) (each product < 2⁵⁹: no overflow)."""
    v = ((v >> 16) ^ v) * HASH_MULTIPLIER & _MASK32
    v = ((v >> 16) ^ v) * HASH_MULTIPLIER & _MASK32
    return (v >> 16) ^ v


def stochastic_noise(x: Tensor, key: Tensor) -> Tensor:
    """r = h(bits(x) ⊕ h(bits(key))) mod 2¹⁶ (int64), float32 ``x`` and ``key`` of one shape."""
    return _mix32(_unsigned_bits(x) ^ _mix32(_unsigned_bits(key))) & 0xFFFF


def round_bf16_stochastic(x: Tensor, key: Tensor) -> Tensor:
    """``x`` (float32) stochastically rounded to bfloat16 with the noise of ``key`` (float32, x's shape): the
    top 16 bits of bits(x) + r (module docstring); NaN stays NaN."""
    top = ((_unsigned_bits(x) + stochastic_noise(x, key)) >> 16) & 0xFFFF
    signed = (top - ((top >> 15) << 16)).to(torch.int16)  # as two's complement, the int16 of bf16's bits
    rounded = signed.view(torch.bfloat16)
    return torch.where(torch.isnan(x), x.to(torch.bfloat16), rounded)


def _blocked(x: Tensor) -> Tensor:
    """``x`` [..., n] zero-padded to [..., ⌈n/B⌉, B], B = :data:`INT8_BLOCK`."""
    n = x.shape[-1]
    pad = int8_blocks(n) * INT8_BLOCK - n
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    return padded.reshape(*x.shape[:-1], int8_blocks(n), INT8_BLOCK)


def encode_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(codes int8 [..., n], scales float32 [..., ⌈n/B⌉]) of float32 ``x`` [..., n]: s = max|x|/127 per block,
    q = round_half_even(x / s), 0 where s is 0 (or x/s is not finite: a non-finite block decodes to NaN)."""
    blocks = _blocked(x)
    absmax = blocks.abs().amax(-1)
    # a tensor divisor: CUDA divides by a Python number as a product with its rounded reciprocal, not IEEE x/127
    scales = absmax / torch.full_like(absmax, _INT8_MAX)
    quotient = blocks / scales.unsqueeze(-1)
    codes = torch.where(torch.isfinite(quotient), torch.round(quotient), 0.0).clamp(-_INT8_MAX, _INT8_MAX)
    n = x.shape[-1]
    return codes.reshape(*x.shape[:-1], blocks.shape[-2] * INT8_BLOCK)[..., :n].to(torch.int8), scales


def decode_int8(codes: Tensor, scales: Tensor) -> Tensor:
    """q·s in float32: each code times its block's scale."""
    n = codes.shape[-1]
    blocks = _blocked(codes.to(torch.float32)) * scales.unsqueeze(-1)
    return blocks.reshape(*codes.shape[:-1], blocks.shape[-2] * INT8_BLOCK)[..., :n]
