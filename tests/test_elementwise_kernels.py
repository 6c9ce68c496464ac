"""Muon's fused element-wise kernels (dtensor_muon.kernels.elementwise) against torch's own operations.

Under the Triton interpreter (a child process started with ``TRITON_INTERPRET=1``, as in test_kernels.py) the
kernels run on the CPU; the interpreter rounds a fused multiply-add twice, so there they agree with torch's
``lerp_``/``lerp``/``mul_``/``add_`` within two fp32 roundings per entry. On a GPU they must give torch's
bits exactly (the GPU tests below), and the step's entry points take them only there. The apply that also
returns each matrix's norm (``decay_and_add_with_norms_``) must give ``decay_and_add_``'s bits and
``torch.linalg.vector_norm``'s norms within fp32 summation error, the same ones at every launch.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_kernels import interpreted

from dtensor_muon.kernels import shard_lists
from dtensor_muon.kernels.elementwise import (
    MIN_KERNEL_NUMEL,
    _kernel_applies,
    decay_and_add_,
    decay_and_add_many,
    decay_and_add_with_norms_,
    momentum_step,
    momentum_steps,
)
from dtensor_muon.kernels.shard_lists import MIN_LIST_MEAN_NUMEL, layout_of, list_layout, listed_shards

MOMENTUM_CASES = [(0.95, True), (0.95, False), (0.3, True)]  # 0.3: the large-weight branch of the first lerp


def torch_momentum(grad, buffer, momentum, nesterov):
    """B' and U by torch's operations, as torch.optim.Muon computes them."""
    advanced = buffer.lerp(grad, 1 - momentum)
    return advanced, grad.lerp(advanced, momentum) if nesterov else advanced


def torch_apply(param, update, decay, alpha):
    out = param.clone()
    out.mul_(decay)
    out.add_(update, alpha=alpha)
    return out


def _inputs(dtype: torch.dtype, device: str, n: int = 5000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    g, b, o = (torch.randn(n, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    return g, b, o


def _interpreter_checks() -> dict[str, float]:
    """Largest difference from torch's operations of each kernel, per entry relative to the largest of the
    result and the inputs of that entry (a difference of roundings, not of cancellation), in units of the
    dtype's epsilon."""
    from test_kernels import _patch_interpreter_bf16

    from dtensor_muon.kernels.counters import _COUNTERS
    from dtensor_muon.kernels.elementwise import (
        _launch_decay_and_add,
        _launch_decay_and_add_with_norms,
        _launch_momentum,
    )

    _patch_interpreter_bf16()  # the interpreter truncates fp32 → bf16; the GPU rounds to nearest even
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        g, b, o = _inputs(dtype, "cpu")
        eps = torch.finfo(dtype).eps

        scale = torch.stack([g.double().abs(), b.double().abs(), o.double().abs()]).amax(0)

        def ulps(x: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor = scale, eps: float = eps) -> float:
            size = torch.maximum(ref.double().abs(), scale)
            return float(((x.double() - ref.double()).abs() / size).max() / eps)

        for momentum, nesterov in MOMENTUM_CASES:
            ref_b, ref_u = torch_momentum(g, b, momentum, nesterov)
            buffer, u = b.clone(), torch.empty_like(b)
            _launch_momentum(g, buffer, u, momentum, nesterov, True, True)
            key = f"{dtype}_{momentum}_{nesterov}"
            out[f"buffer_{key}"] = ulps(buffer, ref_b)
            out[f"input_{key}"] = ulps(u, ref_u)
            untouched = b.clone()
            _launch_momentum(g, untouched, u, momentum, nesterov, False, True)
            out[f"buffer_kept_{key}"] = float((untouched != b).sum())
            if dtype == torch.float32:  # U written in bf16 from fp32 state: torch's U rounded once to bf16
                u16 = torch.empty_like(b, dtype=torch.bfloat16)
                _launch_momentum(g, b.clone(), u16, momentum, nesterov, True, True)
                bf16_eps = torch.finfo(torch.bfloat16).eps
                out[f"input_bf16_{key}"] = ulps(u16, ref_u.to(torch.bfloat16), eps=bf16_eps)
        for decay, alpha in ((0.998, -0.02), (1.0, -3e-3)):
            p = b.clone()
            _launch_decay_and_add(p, o.to(torch.bfloat16), decay, alpha)
            out[f"apply_{dtype}_{decay}"] = ulps(p, torch_apply(b, o.to(torch.bfloat16), decay, alpha))
        # the apply with each matrix's norm: 50×90 matrices are 3 blocks each, the last one partial
        gen = torch.Generator().manual_seed(1)
        for matrices in (1, 3):
            start = torch.randn(matrices, 50, 90, generator=gen).to(dtype)
            update = torch.randn(matrices, 50, 90, generator=gen).to(torch.bfloat16)
            launches = []
            for _ in range(2):
                p, norms = start.clone(), torch.empty(matrices)
                _launch_decay_and_add_with_norms(p, update, 0.998, -0.02, norms)
                launches.append((p, norms))
            (p, norms), (p_again, norms_again) = launches
            key = f"{dtype}_{matrices}"
            size = torch.maximum(start.double().abs(), update.double().abs())
            out[f"norms_apply_{key}"] = ulps(p, torch_apply(start, update, 0.998, -0.02), size)
            exact = torch.linalg.vector_norm(update.double(), dim=(-2, -1))
            out[f"norms_rel_{key}"] = float((norms.double() / exact - 1).abs().max())
            out[f"norms_repeat_differ_{key}"] = float((norms != norms_again).sum() + (p != p_again).sum())
    out["norms_counters_left_zero"] = float(all(int(c.abs().sum()) == 0 for c in _COUNTERS.values()))
    out.update(_list_checks())
    return out


LIST_SIZES = [5000, 0, 1, 3 * 16384 + 5, 777] + [40] * 30
"""A list of shards for the list launches: an empty one, a single entry, one of several programs whose last
chunk is partial, and enough rows (35, 34 of them non-empty) for six halvings of the binary search."""


def _shard_views(
    sizes: list[int], dtype: torch.dtype, gen: torch.Generator, skew: int, device: str = "cpu"
) -> list[torch.Tensor]:
    """Shards of these sizes as contiguous views of one storage on ``device``, ``skew`` entries apart (odd: not
    16-byte aligned), in reversed order (the first shard is not the lowest address)."""
    flat = torch.randn(sum(sizes) + skew * (len(sizes) + 1), generator=gen).to(device=device, dtype=dtype)
    views, at = [], skew
    for n in reversed(sizes):
        views.append(flat[at : at + n])
        at += n + skew
    return views[::-1]


def _list_checks() -> dict[str, float]:
    """Entries where the list launches (shard_lists.py) differ from the one-shard kernels on each shard, both
    under the interpreter: the same arithmetic must give the same bits, in every momentum mode, with U in bf16,
    per-shard factors, and shards that are views at unaligned distances."""
    from dtensor_muon.kernels.elementwise import _launch_decay_and_add, _launch_momentum
    from dtensor_muon.kernels.shard_lists import decay_and_add_list, momentum_list

    gen = torch.Generator().manual_seed(2)
    out = {}
    for skew in (0, 3):
        grads = _shard_views(LIST_SIZES, torch.float32, gen, skew)
        bufs = _shard_views(LIST_SIZES, torch.float32, gen, skew)
        for momentum, nesterov in MOMENTUM_CASES:
            for write_buffer, want_input, u_dtype in ((True, True, torch.float32), (False, True, torch.bfloat16),
                                                      (True, True, torch.bfloat16), (True, False, None)):  # fmt: skip
                buffers = [b.clone() for b in bufs]
                inputs = momentum_list(
                    grads, buffers, momentum, nesterov, write_buffer=write_buffer, want_input=want_input,
                    input_dtype=u_dtype,
                )  # fmt: skip
                differ = 0
                for g, b, kept, u in zip(grads, bufs, buffers, inputs):
                    ref_b = b.clone()
                    ref_u = torch.empty_like(b, dtype=u_dtype) if want_input else ref_b
                    if write_buffer and not nesterov and want_input:
                        ref_u = ref_b  # U is B' itself
                    _launch_momentum(g, ref_b, ref_u, momentum, nesterov, write_buffer, ref_u is not ref_b)
                    differ += int((kept != (ref_b if write_buffer else b)).sum())
                    if want_input:
                        differ += int((u != ref_u).sum()) + int(u.dtype != ref_u.dtype)
                    else:
                        differ += int(u is not None)
                out[f"list_momentum_differ_{skew}_{momentum}_{nesterov}_{write_buffer}_{want_input}_{u_dtype}"] = differ
        params = _shard_views(LIST_SIZES, torch.float32, gen, skew)
        updates = _shard_views(LIST_SIZES, torch.bfloat16, gen, skew)
        decays = [0.998 if i % 3 else 1.0 for i in range(len(LIST_SIZES))]
        alphas = [-0.02 if i % 2 else -3e-3 for i in range(len(LIST_SIZES))]
        applied = [p.clone() for p in params]
        decay_and_add_list(applied, updates, decays, alphas)
        differ = 0
        for p, o, got, decay, alpha in zip(params, updates, applied, decays, alphas):
            ref = p.clone()
            _launch_decay_and_add(ref, o, decay, alpha)
            differ += int((got != ref).sum())
        out[f"list_apply_differ_{skew}"] = differ
    return out


@pytest.fixture(scope="module")
def interp() -> dict[str, float]:
    return interpreted(__file__, timeout=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum,nesterov", MOMENTUM_CASES)
def test_momentum_kernel_matches_torch_within_two_roundings(interp, dtype, momentum, nesterov) -> None:
    key = f"{dtype}_{momentum}_{nesterov}"
    assert interp[f"buffer_{key}"] <= 2 and interp[f"input_{key}"] <= 2
    if dtype == torch.float32:
        # the fp32 U within two fp32 roundings of torch's, then rounded to bf16: at most one bf16 step apart
        assert interp[f"input_bf16_{key}"] <= 1
    assert interp[f"buffer_kept_{key}"] == 0  # U alone leaves the buffer as it was


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decay", [0.998, 1.0])
def test_decay_and_add_kernel_matches_torch_within_two_roundings(interp, dtype, decay) -> None:
    assert interp[f"apply_{dtype}_{decay}"] <= 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("matrices", [1, 3])
def test_apply_with_norms_kernel_matches_torch_and_repeats_itself(interp, dtype, matrices) -> None:
    """The parameter within two roundings of torch's mul_ and add_, each matrix's norm within fp32 summation
    error of the exact one, the same bits from a second launch, and the ticket counters left zero."""
    key = f"{dtype}_{matrices}"
    assert interp[f"norms_apply_{key}"] <= 2
    assert interp[f"norms_rel_{key}"] <= 1e-6
    assert interp[f"norms_repeat_differ_{key}"] == 0
    assert interp["norms_counters_left_zero"] == 1


def test_list_launches_give_the_one_shard_kernels_bits_on_every_shard(interp) -> None:
    """shard_lists.py's launches against the one-shard kernels under the interpreter (same arithmetic, so no
    rounding may differ): every momentum mode, U in fp32 and bf16, per-shard factors, unaligned views."""
    listed = {key: value for key, value in interp.items() if key.startswith("list_")}
    assert len(listed) == 2 * (4 * len(MOMENTUM_CASES) + 1)
    assert all(value == 0 for value in listed.values()), {k: v for k, v in listed.items() if v}


def test_a_list_layout_addresses_views_and_refuses_what_one_launch_cannot() -> None:
    """layout_of: each tensor's distance in elements from its role's first non-empty tensor (views of one
    storage: their storage offsets' differences); None for a non-contiguous tensor, a second dtype in a role,
    shards of different sizes across roles, or integer tensors. list_layout takes no CPU list."""
    flat = torch.zeros(100)
    views = [flat[40:40], flat[50:60], flat[10:13], flat[70:90]]
    other = [torch.zeros(n) for n in (0, 10, 3, 20)]
    layout = layout_of([views, other])
    assert layout is not None and layout.entries == [0, 10, 3, 20]
    assert layout.offsets[0][1:] == [0, -40, 20] and layout.bases[0] is views[1]
    step = other[2].element_size()
    assert layout.offsets[1][1:] == [(t.data_ptr() - other[1].data_ptr()) // step for t in other[1:]]
    square = torch.zeros(4, 4)
    assert layout_of([[square.mT], [square]]) is None  # not contiguous
    assert layout_of([[flat[:4], square[0].to(torch.bfloat16)], [flat[:4], flat[:4]]]) is None  # two dtypes
    assert layout_of([[flat[:4]], [flat[:5]]]) is None  # shard 0: 4 entries and 5
    assert layout_of([[torch.zeros(4, dtype=torch.int32)]]) is None
    assert list_layout(views, other) is None  # CPU tensors: torch's multi-tensor passes


def test_off_gpu_the_entry_points_are_torchs_operations() -> None:
    g, b, o = _inputs(torch.float32, "cpu")
    for momentum, nesterov in MOMENTUM_CASES:
        ref_b, ref_u = torch_momentum(g, b, momentum, nesterov)
        buffer = b.clone()
        u = momentum_step(g, buffer, momentum, nesterov, write_buffer=True, want_input=True)
        assert torch.equal(buffer, ref_b) and torch.equal(u, ref_u)
    p = b.clone()
    decay_and_add_(p, o, 0.998, -0.02)
    assert torch.equal(p, torch_apply(b, o, 0.998, -0.02))
    p = b.clone()
    assert decay_and_add_with_norms_(p, o, 0.998, -0.02, 2) is None  # applied; the caller takes the norms
    assert torch.equal(p, torch_apply(b, o, 0.998, -0.02))
    with pytest.raises(ValueError, match="nothing to write"):
        momentum_step(g, b, 0.9, True, write_buffer=False, want_input=False)
    with pytest.raises(ValueError, match="not 3 matrices"):
        decay_and_add_with_norms_(b.clone(), o, 0.998, -0.02, 3)


def check_many_equal_torch(device: str, sizes: list[int], skew: int | None = None) -> None:
    """momentum_steps over shards of these sizes = torch's lerps on each, bit for bit, in every mode (U in fp32
    and, where a kernel writes it, torch's U rounded once to bf16); and decay_and_add_many = torch's mul_ and
    add_ on each. ``skew``: the shards are views of one storage that far apart (:func:`_shard_views`)."""
    gen = torch.Generator().manual_seed(3)
    if skew is None:
        grads = [torch.randn(n, generator=gen).to(device) for n in sizes]
        bufs = [torch.randn(n, generator=gen).to(device) for n in sizes]
    else:
        grads, bufs = (_shard_views(sizes, torch.float32, gen, skew, device) for _ in range(2))
    for momentum, nesterov in MOMENTUM_CASES:
        for write_buffer in (True, False):
            for u_dtype in (None, torch.bfloat16):
                buffers = [b.clone() for b in bufs]
                inputs = momentum_steps(
                    grads, buffers, momentum, nesterov, write_buffer=write_buffer, want_input=True, input_dtype=u_dtype
                )
                for g, b, kept, u in zip(grads, bufs, buffers, inputs):
                    ref_b, ref_u = torch_momentum(g, b, momentum, nesterov)
                    if u.dtype != ref_u.dtype:  # written by a kernel in bf16: torch's U rounded once
                        assert u_dtype == torch.bfloat16 and not (write_buffer and not nesterov)
                        ref_u = ref_u.to(u_dtype)
                    assert torch.equal(u, ref_u), (momentum, nesterov, write_buffer, u_dtype, g.numel())
                    assert torch.equal(kept, ref_b if write_buffer else b)
        advanced = [b.clone() for b in bufs]  # the advance alone (a transactional step's commit)
        assert momentum_steps(grads, advanced, momentum, False, write_buffer=True, want_input=False) == [None] * len(
            bufs
        )
        for g, b, kept in zip(grads, bufs, advanced):
            assert torch.equal(kept, torch_momentum(g, b, momentum, False)[0])
    # the apply of every shard at once, two (decay, alpha) pairs mixed and bf16 updates among fp32 ones
    updates = [g.to(torch.bfloat16) if i % 2 else g for i, g in enumerate(grads)]
    factors = [((0.998, -0.02) if i % 3 else (1.0, -3e-3)) for i in range(len(sizes))]
    params = [b.clone() for b in bufs]
    decay_and_add_many(params, updates, [d for d, _ in factors], [a for _, a in factors])
    for p, b, o, (decay, alpha) in zip(params, bufs, updates, factors):
        assert torch.equal(p, torch_apply(b, o, decay, alpha)), (p.numel(), decay)


def test_many_shards_at_once_equal_torchs_lerps_on_each() -> None:
    check_many_equal_torch("cpu", [5000, 1, 0, 777])
    with pytest.raises(ValueError, match="nothing to write"):
        momentum_steps([torch.ones(2)], [torch.ones(2)], 0.9, True, write_buffer=False, want_input=False)


LISTED_SIZES = [MIN_KERNEL_NUMEL, 3 << 20, 1 << 20, 4097, 1, 0, 3 << 20]
"""A rank's shards at a high world size: one for the one-shard kernel, the rest below it holding more than
MIN_LIST_MEAN_NUMEL entries a shard on average (one list launch per pass)."""

SPLIT_SIZES = [90_112] * 20 + [3 << 20] + [90_112] * 20 + [3 << 20]
"""Two expert shards among many small ones (DeepSeek-V3-16B's at 64 ranks, scaled down): fewer than
MIN_LIST_MEAN_NUMEL entries a shard on average, so the list launch takes the two and the next four."""


def largest_with_mean(entries: list[int], mean: int) -> list[int]:
    """Reference: the sizes of the most shards, taken largest first, that average at least ``mean`` entries."""
    ordered = sorted(entries, reverse=True)
    count = max(k for k in range(len(ordered) + 1) if k == 0 or sum(ordered[:k]) >= mean * k)
    return ordered[:count]


@pytest.mark.parametrize(
    "entries",
    [
        LISTED_SIZES[1:],  # above the mean as a whole: every shard
        SPLIT_SIZES,
        [1 << 20, 4097, 1],  # one shard of the mean: it alone
        [1 << 18] * 64,  # none
        [21 * 2_883_584 + 2 * 350_208, 0],  # two shards, the second empty: both, as the whole list averages enough
        [2_883_584] * 21 + [350_208] * 3 + [90_112] * 21 + [98_304] * 8 + [65_536, 32_768, 18_432] * 8 + [2048] * 7,
    ],
)
def test_a_list_launch_takes_the_largest_shards_that_average_the_threshold(entries, monkeypatch) -> None:
    """listed_shards: the taken shards (indices, ascending) are the largest ones, as many as the reference
    finds; every shard of at least 2 M entries among them (the last list: the busiest rank's shards of
    DeepSeek-V3-16B, 8 layers, at 64 ranks)."""
    taken = listed_shards(tuple(entries))
    assert list(taken) == sorted(taken) and len(set(taken)) == len(taken)
    assert sorted((entries[i] for i in taken), reverse=True) == largest_with_mean(entries, MIN_LIST_MEAN_NUMEL)
    assert {i for i, n in enumerate(entries) if n >= 2 * MIN_LIST_MEAN_NUMEL} <= set(taken)
    whole = sum(entries) >= MIN_LIST_MEAN_NUMEL * len(entries)
    if whole:
        assert len(taken) == len(entries)
    with monkeypatch.context() as patch:  # the whole list or none
        patch.setattr(shard_lists, "SPLIT_LISTS", 0)
        assert listed_shards(tuple(entries)) == (tuple(range(len(entries))) if whole else ())
    assert listed_shards(tuple(entries)) == taken


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_many_shards_at_once_give_torchs_bits() -> None:
    """The one-shard kernel with torch's multi-tensor passes, then with the list launches, alone and beside
    torch's passes over the shards they leave (separate tensors, and unaligned views of one storage), give torch's
    bits on every shard."""
    tiny = [4097, 1]
    assert listed_shards(tuple(tiny)) == ()  # shards too small for a list launch: torch's passes
    check_many_equal_torch("cuda", [MIN_KERNEL_NUMEL, *tiny])
    listed = [torch.empty(n, device="cuda") for n in LISTED_SIZES if n < MIN_KERNEL_NUMEL]
    taken, _ = list_layout(listed, listed)
    assert taken == tuple(range(len(listed)))
    assert list_layout(listed, [t.cpu() for t in listed]) is None  # a role on another device: not one launch
    split = [torch.empty(n, device="cuda") for n in SPLIT_SIZES]
    taken, layout = list_layout(split, split)
    assert sorted((SPLIT_SIZES[i] for i in taken), reverse=True) == [3 << 20] * 2 + [90_112] * 4
    assert layout.entries == [SPLIT_SIZES[i] for i in taken]
    for skew in (None, 3):
        check_many_equal_torch("cuda", LISTED_SIZES, skew)
        check_many_equal_torch("cuda", [MIN_KERNEL_NUMEL, 1 << 20, 4097, 1], skew)  # a list launch and torch's
        check_many_equal_torch("cuda", SPLIT_SIZES, skew)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_the_kernels_give_torchs_bits(dtype) -> None:
    g, b, o = _inputs(dtype, "cuda", n=MIN_KERNEL_NUMEL)
    assert _kernel_applies(g, b) and not _kernel_applies(g[:-1], b[:-1])  # the kernels run here, not below
    for momentum, nesterov in MOMENTUM_CASES:
        ref_b, ref_u = torch_momentum(g, b, momentum, nesterov)
        buffer = b.clone()
        u = momentum_step(g, buffer, momentum, nesterov, write_buffer=True, want_input=True)
        assert torch.equal(buffer, ref_b), (momentum, nesterov)
        assert torch.equal(u, ref_u), (momentum, nesterov)
        assert torch.equal(momentum_step(g, b.clone(), momentum, nesterov, write_buffer=False, want_input=True), ref_u)
        for write_buffer in (True, False):  # U in bf16: torch's fp32 U rounded once, the buffer as in fp32
            buffer = b.clone()
            u = momentum_step(
                g, buffer, momentum, nesterov, write_buffer=write_buffer, want_input=True, input_dtype=torch.bfloat16
            )
            assert torch.equal(buffer, ref_b if write_buffer else b)
            expected = ref_b if write_buffer and not nesterov else ref_u.to(torch.bfloat16)  # U = B' itself there
            assert u.dtype == expected.dtype and torch.equal(u, expected), (momentum, nesterov, write_buffer)
    update = o.to(torch.bfloat16)
    for decay, alpha in ((0.998, -0.02), (1.0, -3e-3)):
        p = b.clone()
        decay_and_add_(p, update, decay, alpha)
        assert torch.equal(p, torch_apply(b, update, decay, alpha)), decay
    side = int(MIN_KERNEL_NUMEL**0.5)
    square, transposed = b.reshape(side, side), update.reshape(side, side).mT  # O of a tall matrix: a view
    p = square.clone()
    decay_and_add_(p, transposed, 0.998, -0.02)
    assert torch.equal(p, torch_apply(square, transposed, 0.998, -0.02))


NORM_SHAPES = [
    (2048, 2048),  # one matrix of MIN_KERNEL_NUMEL entries
    (1531, 2900),  # one matrix above it, its last block partial
    (8, 512, 1024),  # eight matrices of MIN_KERNEL_NUMEL entries in all
    (8, 768, 2048),  # a unit of Qwen3-30B-A3B's experts
    (8, 700, 1001),  # eight matrices whose last blocks are partial
]
NORM_DTYPES = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("param_dtype,update_dtype", NORM_DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_on_the_gpu_the_apply_with_norms_gives_decay_and_add_s_bits_and_the_norms(
    shape, param_dtype, update_dtype
) -> None:
    """decay_and_add_with_norms_ on a [m, n] or [B, m, n] region at and above the kernel's threshold: the
    parameter bit for bit decay_and_add_'s, each matrix's norm within 1e-6 of torch.linalg.vector_norm of
    O in fp32 (and of the exact norm), and a second launch gives the same norms and parameter bits."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = torch.randn(shape, generator=gen, device="cuda").to(param_dtype)
    update = torch.randn(shape, generator=gen, device="cuda").to(update_dtype)
    matrices = shape[0] if len(shape) == 3 else 1
    assert _kernel_applies(start, update) and start.numel() >= MIN_KERNEL_NUMEL
    expected = start.clone()
    decay_and_add_(expected, update, 0.998, -0.02)
    launches = []
    for _ in range(2):
        p = start.clone()
        norms = decay_and_add_with_norms_(p, update, 0.998, -0.02, matrices)
        assert norms is not None and norms.dtype == torch.float32 and norms.shape == (matrices,)
        launches.append((p, norms))
    (p, norms), (p_again, norms_again) = launches
    assert torch.equal(p, expected) and torch.equal(p_again, expected)
    assert torch.equal(norms, norms_again)  # the block sums are added in one order whichever program ends
    reference = torch.linalg.vector_norm(update.float(), dim=(-2, -1)).reshape(-1)
    assert float((norms / reference - 1).abs().max()) <= 1e-6
    exact = torch.linalg.vector_norm(update.double(), dim=(-2, -1)).reshape(-1)
    assert float((norms.double() / exact - 1).abs().max()) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_apply_with_norms_takes_a_transposed_update_and_leaves_the_rest_to_torch() -> None:
    """O of a tall matrix (a transposed view) is copied once and gives the same bits and norm; a Tensor
    factor (a Tensor lr) and a region below the kernel's threshold take decay_and_add_ and return None."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    start, o = (torch.randn(2048, 2048, generator=gen, device="cuda") for _ in range(2))
    transposed = o.to(torch.bfloat16).mT
    p = start.clone()
    norms = decay_and_add_with_norms_(p, transposed, 0.998, -0.02, 1)
    assert norms is not None and torch.equal(p, torch_apply(start, transposed, 0.998, -0.02))
    assert float((norms / torch.linalg.vector_norm(transposed.float()) - 1).abs().max()) <= 1e-6
    small = start.reshape(8, 512, 1024)[:, :, :-1].contiguous()
    for region, update, decay, alpha in (
        (start, o, torch.tensor(0.998, device="cuda"), -0.02),
        (small, small.flip(0), 0.998, -0.02),
    ):
        p = region.clone()
        assert decay_and_add_with_norms_(p, update, decay, alpha, 8) is None
        expected = region.clone()
        decay_and_add_(expected, update, decay, alpha)
        assert torch.equal(p, expected)


if __name__ == "__main__":
    print(json.dumps(_interpreter_checks()))
