"""``momentum_dtype`` on one process: the formats against references written from their formulas, the momentum
step against the float32 one within the rounding each format allows, a short training against float32
momentum, checkpoints and the errors.

Bounds, from the arithmetic (``kernels/low_precision.py``'s formulas):
- int8: q = rint(fl(x/s)), s = fl(max|x|/127), so |fl(x/s) − x/s| ≤ 2⁻²⁴·127.5 and |fl(q·s) − q·s| ≤ 2⁻²⁴·127·s:
  |decode − x| ≤ s·(1/2 + 255·2⁻²⁴) < s·(1/2 + 2⁻¹⁵).
- bf16 stochastic rounding: the result is one of x's two bf16 neighbours, so |SR(x) − x| < their spacing; with
  the 16 dropped bits R and a noise r uniform on [0, 2¹⁶), P(up) = R/2¹⁶ exactly, so the mean of N roundings
  with independent noise is x in expectation, with standard deviation ≤ spacing/(2√N): the tests allow 5 of
  those.
- momentum: B' = lerp(B, g, 1 − μ) is a contraction by μ in B, so an encoding error δₜ at step t is μ-damped
  afterwards: |B_T − B_T(fp32)| ≤ Σₜ μ^(T−1−t)·(δₜ + 2⁻²³·(|Bₜ| + |gₜ|)), the last term the float32 lerps'
  roundings in the two runs.
"""

from __future__ import annotations

import struct

import pytest
import torch

import dtensor_muon
from dtensor_muon.kernels.low_precision import (
    INT8_BLOCK,
    decode_int8,
    encode_int8,
    momentum_bytes_per_element,
    round_bf16_stochastic,
)
from dtensor_muon.kernels.stored_momentum import stored_momentum_step

MASK = 0xFFFFFFFF


def bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def from_bits(value: int) -> float:
    return struct.unpack("<f", struct.pack("<I", value))[0]


def h(v: int) -> int:
    """The mixer of the formula, on Python integers."""
    v = (((v >> 16) ^ v) * 0x45D9F3B) & MASK
    v = (((v >> 16) ^ v) * 0x45D9F3B) & MASK
    return (v >> 16) ^ v


def reference_sr(x: float, key: float) -> float:
    """bf16 stochastic rounding from the formula: the top 16 bits of bits(x) + (h(bits(x) ⊕ h(bits(key))) mod 2¹⁶)."""
    noise = h(bits(x) ^ h(bits(key))) & 0xFFFF
    return from_bits(((bits(x) + noise) >> 16) << 16)


def f32(value: float) -> float:
    return from_bits(bits(value))


def reference_int8(row: list[float]) -> tuple[list[int], list[float]]:
    """int8 codes and scales of one row from the formula, blocks of INT8_BLOCK, every operation in float32."""
    codes, scales = [], []
    for start in range(0, len(row), INT8_BLOCK):
        block = row[start : start + INT8_BLOCK]
        s = f32(max(abs(v) for v in block) / 127.0)  # one float32 division: x/127 exact in double, rounded once
        scales.append(s)
        codes.extend(0 if s == 0 else max(-127, min(127, round(f32(v / s)))) for v in block)  # round: half to even
    return codes, scales


# ---------------------------------------------------------------- the formats
@pytest.mark.parametrize("shape", [(5, 300), (3, 128), (2, 7), (2, 3, 260)])
def test_int8_encoding_is_the_formula(shape):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[-1])
    x[0, ..., :INT8_BLOCK] = 0.0  # a zero block: scale 0, codes 0
    codes, scales = encode_int8(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert scales.shape == (*shape[:-1], -(-shape[-1] // INT8_BLOCK))
    for row, row_codes, row_scales in zip(x.reshape(-1, shape[-1]), codes.reshape(-1, shape[-1]),
                                          scales.reshape(-1, scales.shape[-1])):  # fmt: skip
        want_codes, want_scales = reference_int8(row.tolist())
        assert row_codes.tolist() == want_codes
        assert row_scales.tolist() == want_scales
    decoded = decode_int8(codes, scales)
    per_entry = scales.repeat_interleave(INT8_BLOCK, -1)[..., : shape[-1]]
    assert bool(((decoded - x).abs() <= per_entry * (0.5 + 2**-15)).all())
    assert torch.equal(decoded, codes.float() * per_entry)


def test_int8_non_finite_blocks_decode_to_nan_and_the_others_stay():
    x = torch.randn(2, 300)
    x[0, 5], x[1, 200] = float("nan"), float("inf")
    decoded = decode_int8(*encode_int8(x))
    bad = torch.zeros(2, 300, dtype=torch.bool)
    bad[0, :INT8_BLOCK], bad[1, INT8_BLOCK : 2 * INT8_BLOCK] = True, True  # the blocks of entries 5 and 200
    assert bool(decoded[bad].isnan().all()) and bool(decoded[~bad].isfinite().all())


def test_bf16_stochastic_rounding_is_the_formula():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2000, generator=gen) * 10.0 ** torch.randint(-20, 20, (2000,), generator=gen)
    key = torch.randn(2000, generator=gen)
    got = round_bf16_stochastic(x, key)
    assert got.dtype == torch.bfloat16
    assert got.float().tolist() == [reference_sr(a, k) for a, k in zip(x.tolist(), key.tolist())]


def test_bf16_stochastic_rounding_keeps_exact_values_and_non_finite_ones():
    exact = torch.randn(1000).bfloat16().float()
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0])
    for x in (exact, special):
        got = round_bf16_stochastic(x, torch.randn(x.shape)).float()
        assert torch.equal(got.isnan(), x.isnan()) and torch.equal(got[~x.isnan()], x[~x.isnan()])


@pytest.mark.parametrize("x", [1.0 + 0.3 * 2**-7, -3.7e-5, 1234.567, 2.0**-100 * 1.6])
def test_bf16_stochastic_rounding_is_unbiased_and_reaches_both_neighbours(x):
    n = 4096
    keys = torch.randn(n, generator=torch.Generator().manual_seed(3))
    value = torch.full((n,), x)
    rounded = round_bf16_stochastic(value, keys).double()
    down = value.bfloat16().double()  # round to nearest; the other neighbour is one bf16 step away
    low = from_bits((bits(f32(x)) >> 16) << 16)  # toward zero
    high = from_bits(((bits(f32(x)) >> 16) + 1) << 16)  # away from zero
    spacing = abs(high - low)
    assert set(rounded.tolist()) == {low, high}, (x, down[0].item())
    assert abs(float(rounded.mean()) - f32(x)) <= 5 * spacing / (2 * n**0.5)


def test_bf16_stochastic_rounding_has_no_bias_over_many_values():
    """Many values with one noise each: the mean error, in units of each value's spacing, is within 5σ of 0."""
    n = 1 << 16
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, generator=gen)
    rounded = round_bf16_stochastic(x, torch.randn(n, generator=gen)).double()
    low = (x.view(torch.int32) & -65536).view(torch.float32).double()
    high = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32).double()
    spacing = (high - low).abs()
    assert bool(((rounded == low) | (rounded == high)).all())
    assert abs(float(((rounded - x.double()) / spacing).mean())) <= 5 * 0.5 / n**0.5


def test_bytes_per_element():
    assert momentum_bytes_per_element("float32") == 4 and momentum_bytes_per_element("float32", torch.bfloat16) == 2
    assert momentum_bytes_per_element("bfloat16") == 2
    assert momentum_bytes_per_element("int8") == 1 + 4 / INT8_BLOCK
    with pytest.raises(ValueError, match="momentum_dtype"):
        momentum_bytes_per_element("fp8")


# ---------------------------------------------------------------- the momentum step
MU = 0.95


def stored_state(mode: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    if mode == "bfloat16":
        return b.bfloat16(), None
    return encode_int8(b)


def decoded(buffer: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    return buffer.float() if scales is None else decode_int8(buffer, scales)


def encoding_error_bound(mode: str, x: torch.Tensor) -> torch.Tensor:
    """Per entry: how far the stored value of float32 ``x`` may be from it (the module docstring)."""
    if mode == "bfloat16":
        low = (x.view(torch.int32) & -65536).view(torch.float32)
        high = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
        return (high - low).abs()
    _, scales = encode_int8(x)
    return scales.repeat_interleave(INT8_BLOCK, -1)[..., : x.shape[-1]] * (0.5 + 2**-15)


@pytest.mark.parametrize("mode", ["bfloat16", "int8"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_one_step_computes_u_from_the_float32_advance_and_stores_it_within_the_format(mode, nesterov):
    gen = torch.Generator().manual_seed(5)
    g, b = torch.randn(7, 300, generator=gen), torch.randn(7, 300, generator=gen)
    buffer, scales = stored_state(mode, b)
    start = decoded(buffer, scales)
    advanced = start.lerp(g, 1 - MU)  # the float32 B' of the formula
    want_u = g.lerp(advanced, MU) if nesterov else advanced
    kept = buffer.clone(), None if scales is None else scales.clone()
    u = stored_momentum_step(g, buffer, scales, MU, nesterov, write_buffer=False, want_input=True)
    assert torch.equal(u, want_u)
    assert torch.equal(buffer, kept[0]) and (scales is None or torch.equal(scales, kept[1]))  # prepare: no write
    u = stored_momentum_step(g, buffer, scales, MU, nesterov, write_buffer=True, want_input=True)
    assert torch.equal(u, want_u)
    assert bool(((decoded(buffer, scales) - advanced).abs() <= encoding_error_bound(mode, advanced)).all())
    again = kept[0].clone(), None if scales is None else kept[1].clone()
    assert stored_momentum_step(g, *again, MU, nesterov, write_buffer=True, want_input=False) is None
    assert torch.equal(again[0], buffer) and (scales is None or torch.equal(again[1], scales))  # advance alone


@pytest.mark.parametrize("mode", ["bfloat16", "int8"])
def test_many_steps_stay_within_the_damped_encoding_error_of_float32_momentum(mode):
    gen = torch.Generator().manual_seed(6)
    shape = (9, 260)
    exact = torch.zeros(shape)
    buffer, scales = stored_state(mode, torch.zeros(shape))
    bound = torch.zeros(shape)
    for _ in range(60):
        g = torch.randn(shape, generator=gen) * (1 + torch.rand(shape, generator=gen) * 10)
        held = decoded(buffer, scales)
        advanced = held.lerp(g, 1 - MU)
        exact = exact.lerp(g, 1 - MU)
        stored_momentum_step(g, buffer, scales, MU, False, write_buffer=True, want_input=False)
        lerp_rounding = 2**-23 * (held.abs() + exact.abs() + 2 * g.abs())
        bound = MU * bound + encoding_error_bound(mode, advanced) + lerp_rounding
    assert bool(((decoded(buffer, scales) - exact).abs() <= bound).all())


# ---------------------------------------------------------------- the optimizers
def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 300, bias=False), torch.nn.Tanh(), torch.nn.Linear(300, 8))


OPTIMIZERS = {"Muon": {}, "NorMuon": {}, "MOP": {"scale": "shape"}}


def train(name: str, momentum_dtype: str, steps: int, dtype: torch.dtype = torch.float32) -> tuple[list[float], object]:
    """A regression of a fixed random teacher by a 32→300→8 MLP (its hidden matrices on the matrix rule)."""
    model = mlp().to(dtype)
    groups = [
        {"params": [model[0].weight], "use_muon": True},
        {"params": list(model[2].parameters()), "use_muon": False},
    ]
    opt = getattr(dtensor_muon, name)(groups, lr=0.02, momentum_dtype=momentum_dtype, **OPTIMIZERS[name])
    gen = torch.Generator().manual_seed(7)
    teacher = torch.randn(32, 8, generator=gen)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 32, generator=gen).to(dtype)
        loss = (model(x).float() - x.float() @ teacher).square().mean()
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses, opt


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_training_with_low_precision_momentum_ends_near_float32_momentum(name):
    """Final loss (mean of the last 10 of 80 steps) within 5% of the loss float32 momentum removed from the
    start: the tolerance of a convergence study, stated, not derived (the buffers' encoding errors are bounded
    above, their effect on a training is not)."""
    reference, _ = train(name, "float32", 80)
    start, final = reference[0], sum(reference[-10:]) / 10
    for mode in ("bfloat16", "int8"):
        losses, _ = train(name, mode, 80)
        assert abs(sum(losses[-10:]) / 10 - final) <= 0.05 * (start - final), (mode, losses[-10:], reference[-10:])


def test_float32_is_todays_buffer_bit_for_bit():
    """The default keeps torch.optim.Muon's float32 buffer: the same parameters as the optimizer without the
    option given."""
    model_a, model_b = mlp(), mlp()
    for model, kwargs in ((model_a, {}), (model_b, {"momentum_dtype": "float32"})):
        opt = dtensor_muon.Muon([{"params": [model[0].weight], "use_muon": True}], lr=0.02, **kwargs)
        for step in range(3):
            model[0].weight.grad = torch.randn(300, 32, generator=torch.Generator().manual_seed(step))
            opt.step()
        assert set(opt.state[model[0].weight]) == {"momentum_buffer"}
    assert torch.equal(model_a[0].weight, model_b[0].weight)


@pytest.mark.parametrize("mode", ["bfloat16", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trips_the_stored_momentum_exactly(mode, dtype):
    _, opt = train("NorMuon", mode, 3, dtype)
    saved = opt.state_dict()
    p = opt.param_groups[0]["params"][0]
    held = {k: v.clone() for k, v in opt.state[p].items() if k != "owner_state"}
    if mode == "int8":  # codes under a key of their own: no other format's template takes them for a buffer
        assert set(held) == {"momentum_codes", "momentum_scale"} and held["momentum_codes"].dtype == torch.int8
    else:
        assert held["momentum_buffer"].dtype == torch.bfloat16
    if mode == "int8":
        assert held["momentum_scale"].dtype == torch.float32 and held["momentum_scale"].shape == (300, 1)
    _, fresh = train("NorMuon", mode, 1, dtype)
    fresh.load_state_dict(saved)
    q = fresh.param_groups[0]["params"][0]
    for key, value in held.items():
        assert fresh.state[q][key].dtype == value.dtype and torch.equal(fresh.state[q][key], value), key


@pytest.mark.parametrize(("saved", "loading"), [("int8", "bfloat16"), ("bfloat16", "float32"), ("float32", "int8")])
def test_loading_another_momentum_dtype_raises_naming_both(saved, loading):
    _, opt = train("Muon", saved, 2)
    state = opt.state_dict()
    _, other = train("Muon", loading, 1)
    with pytest.raises(ValueError, match=f"momentum_dtype='{saved}'.*momentum_dtype='{loading}'"):
        other.load_state_dict(state)
    for group in state["param_groups"]:  # a state dict whose groups do not say: the state's format decides
        assert ("momentum_dtype" in group) == (saved != "float32")  # float32 groups leave it out (old checkpoints)
        group.pop("momentum_dtype", None)
    if saved != "float32":
        with pytest.raises(ValueError, match=f"saved with momentum_dtype='{saved}', this optimizer has "
                           f"momentum_dtype='{loading}'"):  # fmt: skip
            other.load_state_dict(state)


def test_a_bad_momentum_dtype_and_a_change_after_the_state_exists_raise_naming_it():
    with pytest.raises(ValueError, match=r"momentum_dtype: expected one of \('float32', 'bfloat16', 'int8'\)"):
        dtensor_muon.Muon(mlp().parameters(), momentum_dtype="fp8")
    _, opt = train("Muon", "int8", 1)
    opt.param_groups[0]["momentum_dtype"] = "bfloat16"
    opt.param_groups[0]["params"][0].grad = torch.randn(300, 32)
    with pytest.raises(ValueError, match="momentum_dtype is 'bfloat16', but its momentum state was created as 'int8'"):
        opt.step()


@pytest.mark.parametrize("shape", [(0, 12), (0, 10, 260), (3, 0)])
def test_int8_of_an_empty_shard_is_empty(shape):
    codes, scales = encode_int8(torch.zeros(shape))
    assert codes.shape == shape and scales.shape == (*shape[:-1], -(-shape[-1] // INT8_BLOCK))
    assert decode_int8(codes, scales).shape == shape
