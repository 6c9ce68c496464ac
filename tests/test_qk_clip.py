"""QK-clip (MuonClip) against a reference written from the formula (Kimi K2's report; GQA as Megatron-Core):

    γ_h = min(1, τ / S_h); MHA/GQA: γ_g = min(1, τ / max_{h∈g} S_h), query rows of group g × γ_g^α, key rows × γ_g^(1−α);
    MLA: query NoPE rows × γ_h^α, query RoPE rows × γ_h, wkv_b's NoPE key rows × γ_h^(1−α), value rows untouched.

One process: the clip after the update equals the reference applied to the unclipped step's weights, bitwise;
heads at or below τ and the momentum untouched. Distributed (gloo): FSDP with uneven shards and FSDP over tensor
parallelism (``_StridedShard``) equal one process bitwise, with ranks that saw different maxima (the global max
wins), a rank that recorded nothing, and one all-reduce added per step.
"""

import copy
import math
from collections.abc import Callable

import pytest
import scenarios
import torch
from dist_harness import DEVICES, full_tensor, one_thread, run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import dtensor_muon
from dtensor_muon import AttentionHeads
from dtensor_muon.distributed.consensus import OptionMismatchError
from dtensor_muon.distributed.layout import box_slices, layout_boxes

TAU, ALPHA = 5.0, 0.5

GQA = AttentionHeads(q="attn.wq.weight", k="attn.wk.weight", n_heads=4, head_dim=3, n_kv_heads=2)
MHA = AttentionHeads(q="attn.wq.weight", k="attn.wk.weight", n_heads=3, head_dim=4)
MLA = AttentionHeads(
    q="attn.wq.weight", k="attn.wkv_b.weight", n_heads=3, qk_nope_head_dim=2, qk_rope_head_dim=1, v_head_dim=2
)
MAXIMA = {"GQA": [1.0, 20.0, 3.0, 5.0], "MHA": [40.0, 5.0, 2.0], "MLA": [7.5, 1.0, 80.0]}
"""Per-head maxima: some heads above τ, one exactly at τ (untouched)."""


def reference_factors(heads: AttentionHeads, maxima: list[float]) -> dict[str, list[float]]:
    """Each row's factor, written out head by head from the formula in the module docstring."""
    gamma = [min(1.0, TAU / s) if s > TAU else 1.0 for s in maxima]
    if heads.is_mla:
        q, k = [], []
        for h in range(heads.n_heads):
            q += [gamma[h] ** ALPHA] * heads.qk_nope_head_dim + [gamma[h]] * heads.qk_rope_head_dim
            k += [gamma[h] ** (1 - ALPHA)] * heads.qk_nope_head_dim + [1.0] * heads.v_head_dim
        return {heads.q: q, heads.k: k}
    per_group = heads.n_heads // heads.kv_heads
    group_gamma = [
        min(1.0, TAU / max(maxima[g * per_group : (g + 1) * per_group]))
        if max(maxima[g * per_group : (g + 1) * per_group]) > TAU
        else 1.0
        for g in range(heads.kv_heads)
    ]
    q = [group_gamma[h // per_group] ** ALPHA for h in range(heads.n_heads) for _ in range(heads.head_dim)]
    k = [group_gamma[g] ** (1 - ALPHA) for g in range(heads.kv_heads) for _ in range(heads.head_dim)]
    return {heads.q: q, heads.k: k}


def weights(heads: AttentionHeads) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    shapes = {name: (rows, 6) for name, rows in heads.row_counts().items()}
    shapes["mlp.w.weight"] = (6, 5)  # a matrix QK-clip leaves alone
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def gradient(shape: tuple[int, ...], step: int, index: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * step + index))


def optimizer(params, heads: AttentionHeads | None, **kwargs):
    clip = dict(qk_clip_tau=TAU, qk_clip_alpha=ALPHA, qk_clip_heads={"layer0": heads}) if heads else {}
    return dtensor_muon.Muon(params, lr=0.02, weight_decay=0.1, **clip, **kwargs)


def one_process(heads: AttentionHeads, maxima: list[float], clip: bool, steps: int = 2) -> dict[str, torch.Tensor]:
    with one_thread():
        params = {n: torch.nn.Parameter(w.clone()) for n, w in weights(heads).items()}
        opt = optimizer(list(params.items()), heads if clip else None)
        for step in range(steps):
            for i, p in enumerate(params.values()):
                p.grad = gradient(p.shape, step, i)
            if clip:
                opt.record_max_logits("layer0", torch.tensor(maxima))
            opt.step()
        out = {n: p.detach().clone() for n, p in params.items()}
        out.update({f"{n}/momentum": opt.state[p]["momentum_buffer"].clone() for n, p in params.items()})
        return out


@pytest.mark.parametrize("kind", ["GQA", "MHA", "MLA"])
def test_one_step_clip_equals_the_formula_applied_after_the_update(kind):
    heads, maxima = {"GQA": GQA, "MHA": MHA, "MLA": MLA}[kind], MAXIMA[kind]
    plain = one_process(heads, maxima, clip=False, steps=1)
    clipped = one_process(heads, maxima, clip=True, steps=1)
    for name, factors in reference_factors(heads, maxima).items():
        expected = plain[name] * torch.tensor(factors, dtype=torch.float64).float()[:, None]
        assert torch.equal(clipped[name], expected), name
        untouched = [r for r, f in enumerate(factors) if f == 1.0]
        assert untouched and torch.equal(clipped[name][untouched], plain[name][untouched]), name
        assert any(f < 1.0 for f in factors)
    assert torch.equal(clipped["mlp.w.weight"], plain["mlp.w.weight"])
    for name in weights(heads):  # the optimizer state is not rescaled
        assert torch.equal(clipped[f"{name}/momentum"], plain[f"{name}/momentum"])


def test_heads_at_or_below_tau_leave_every_weight_bitwise_unchanged():
    plain = one_process(GQA, [5.0, 5.0, 1.0, -math.inf], clip=False)
    clipped = one_process(GQA, [5.0, 5.0, 1.0, -math.inf], clip=True)
    assert all(torch.equal(clipped[n], plain[n]) for n in plain)


def test_metrics_report_the_largest_logit_and_the_heads_clipped():
    params = {n: torch.nn.Parameter(w) for n, w in weights(GQA).items()}
    opt = optimizer(list(params.items()), GQA)
    for i, p in enumerate(params.values()):
        p.grad = gradient(p.shape, 0, i)
    opt.record_max_logits("layer0", torch.tensor([1.0, 2.0, 3.0, 4.0]))
    opt.record_max_logits("layer0", torch.tensor([9.0, 2.0, 3.0, 4.0]))  # a second micro-batch: the max is kept
    opt.step()
    assert opt.metrics["muon/qk_clip/max_logit"] == 9.0 and opt.metrics["muon/qk_clip/heads_clipped"] == 1.0


@pytest.mark.parametrize("kind", ["GQA", "MHA", "MLA", "fused"])
def test_factors_are_made_on_the_device_of_the_maxima(kind):
    """The factors never leave the maxima's device (a GPU step does not wait for the device to read them):
    on the meta device, which holds no values, every factor tensor stays there, and on the CPU they equal the
    formula, all 1 for heads at or below τ."""
    from dtensor_muon.rules.qk_clip import row_factors

    heads = {"GQA": GQA, "MHA": MHA, "MLA": MLA, "fused": AttentionHeads.grouped_qkv("attn.wqkv.weight", 4, 2, 3)}[kind]
    maxima = MAXIMA.get(kind, MAXIMA["GQA"])
    on_meta = row_factors(heads, torch.tensor(maxima, device="meta"), TAU, ALPHA)
    assert {f.device.type for f in on_meta.values()} == {"meta"}
    below = row_factors(heads, torch.full((heads.n_heads,), TAU), TAU, ALPHA)
    assert all(torch.equal(f, torch.ones_like(f)) for f in below.values())
    if kind != "fused":
        on_cpu = row_factors(heads, torch.tensor(maxima), TAU, ALPHA)
        for name, factors in reference_factors(heads, maxima).items():
            torch.testing.assert_close(on_cpu[name], torch.tensor(factors, dtype=torch.float64), rtol=1e-15, atol=0)


def test_bad_settings_raise_naming_the_option():
    params = [(n, torch.nn.Parameter(w)) for n, w in weights(GQA).items()]
    with pytest.raises(ValueError, match="qk_clip_heads"):
        dtensor_muon.Muon(params, qk_clip_tau=100.0)
    with pytest.raises(ValueError, match="qk_clip_alpha"):
        dtensor_muon.Muon(params, qk_clip_tau=100.0, qk_clip_alpha=1.5, qk_clip_heads={"l": GQA})
    wrong = AttentionHeads(q="attn.wq.weight", k="attn.wk.weight", n_heads=4, head_dim=4, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"'attn.wq.weight' of shape \(12, 6\) .* 16 rows"):
        dtensor_muon.Muon(params, qk_clip_tau=100.0, qk_clip_heads={"l": wrong})
    with pytest.raises(ValueError, match="qk_clip_heads is given but qk_clip_tau is 0"):
        dtensor_muon.Muon(params, qk_clip_heads={"l": GQA})
    with pytest.raises(ValueError, match="n_kv_heads must divide"):
        AttentionHeads(q="a", k="b", n_heads=4, head_dim=2, n_kv_heads=3)
    opt = dtensor_muon.Muon(params)
    with pytest.raises(RuntimeError, match="QK-clip is off"):
        opt.record_max_logits("l", torch.ones(4))


# ---------------------------------------------------------------------------------------------------------------
# Distributed: every rank's pieces together equal one process.


def place(name: str, w: torch.Tensor, mesh, placements) -> DTensor:
    """``w`` laid out as ``placements`` say: this rank's box of it (the library's layout of the placements, which
    the test's final ``full_tensor`` checks through torch's own redistribution)."""
    box = layout_boxes(name, tuple(w.shape), tuple(mesh.shape), placements)[mesh.get_rank()]
    return DTensor.from_local(w[box_slices(box)].contiguous(), mesh, placements, shape=w.shape, stride=w.stride())


def all_reduces_of(call: Callable[[], object]) -> int:
    """How many times ``call()`` calls torch.distributed.all_reduce (each call goes through to the real one)."""
    real, calls = torch.distributed.all_reduce, 0

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    torch.distributed.all_reduce = counted
    try:
        call()
    finally:
        torch.distributed.all_reduce = real
    return calls


def sharded(rank: int, world_size: int, kind: str, layout: str) -> tuple[dict[str, torch.Tensor], int]:
    heads, maxima = {"GQA": GQA, "MLA": MLA}[kind], MAXIMA[kind]
    if layout == "fsdp":
        mesh, placements = init_device_mesh("cpu", (world_size,)), (Shard(0),)
    else:  # FSDP over tensor parallelism: rows split by tp, then each tp piece by dp
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        placements = (_StridedShard(0, split_factor=world_size // 2), Shard(0))
    params = {name: torch.nn.Parameter(place(name, w, mesh, placements)) for name, w in weights(heads).items()}
    opt = optimizer(list(params.items()), heads)
    name_of = list(params)
    calls = 0
    for step in range(2):
        for i, p in enumerate(params.values()):
            p.grad = place(name_of[i], gradient(p.shape, step, i), mesh, placements)
        # rank 0 saw only small logits, the last rank the large ones, a middle rank nothing at all
        if rank == world_size - 1:
            opt.record_max_logits("layer0", torch.tensor(maxima))
        elif rank == 0:
            opt.record_max_logits("layer0", torch.tensor(maxima).clamp(max=TAU / 2))
        calls += all_reduces_of(opt.step)
    return {n: full_tensor(p) for n, p in params.items()}, calls


def calls_without_clip(rank: int, world_size: int) -> int:
    mesh = init_device_mesh("cpu", (world_size,))
    params = {n: torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for n, w in weights(GQA).items()}
    opt = optimizer(list(params.items()), None)
    calls = 0
    for step in range(2):
        for i, p in enumerate(params.values()):
            p.grad = distribute_tensor(gradient(p.shape, step, i), mesh, [Shard(0)])
        calls += all_reduces_of(opt.step)
    return calls


@pytest.mark.parametrize(
    "kind, layout, world_size", [("GQA", "fsdp", 5), ("MLA", "fsdp", 2), ("GQA", "fsdp_over_tp", 4)]
)
def test_distributed_clip_equals_one_process_bitwise(kind, layout, world_size):
    want = one_process({"GQA": GQA, "MLA": MLA}[kind], MAXIMA[kind], clip=True)
    results = run_distributed(sharded, world_size, kind, layout)
    for got, _ in results:
        for name in weights({"GQA": GQA, "MLA": MLA}[kind]):
            assert torch.equal(got[name], want[name]), name


def test_the_clip_adds_one_all_reduce_per_step():
    with_clip = [calls for _, calls in run_distributed(sharded, 3, "GQA", "fsdp")]
    without = run_distributed(calls_without_clip, 3)
    assert [a - b for a, b in zip(with_clip, without)] == [2, 2, 2]  # two steps, one each


def test_a_copied_optimizer_clips_as_the_original():
    params = {n: torch.nn.Parameter(w) for n, w in weights(GQA).items()}
    opt = optimizer(list(params.items()), GQA)
    twin_params, twin = copy.deepcopy((params, opt))
    for pair, o in ((params, opt), (twin_params, twin)):
        for i, p in enumerate(pair.values()):
            p.grad = gradient(p.shape, 0, i)
        o.record_max_logits("layer0", torch.tensor(MAXIMA["GQA"]))
        o.step()
    assert all(torch.equal(params[n], twin_params[n]) for n in params)
    assert twin.metrics["muon/qk_clip/heads_clipped"] == 1.0  # head 1 (20 > τ); its group mate is scaled with it


@pytest.mark.parametrize("device", DEVICES)
def test_overlap_clips_each_weight_before_its_next_forward(device):
    """FSDP2 on 2 ranks with overlap: each clipped weight is scaled in the hook that lands its update, so every
    forward, hence every loss, and the final weights equal overlap=False's and one process's."""
    with one_thread():
        reference = scenarios.residual_mlp_one_process(4, torch.device(device), qk_clip=True)
        plain = scenarios.residual_mlp_one_process(4, torch.device(device))
    assert reference["losses"][2:] != plain["losses"][2:]  # the clip changes the training
    for overlap in (False, True):
        results = run_distributed(scenarios.residual_mlp_fsdp, 2, 4, overlap, False, True, device=device)
        for result in results:
            assert result["losses"] == reference["losses"], (overlap, result["losses"], reference["losses"])
        for name, want in reference["params"].items():
            assert torch.equal(torch.cat([r["pieces"][name] for r in results]), want), (overlap, name)


def different_tau(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (world_size,))
    params = [(n, torch.nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))) for n, w in weights(GQA).items()]
    try:
        dtensor_muon.Muon(params, qk_clip_tau=100.0 + rank, qk_clip_heads={"layer0": GQA})
    except OptionMismatchError as error:
        return str(error)
    return "constructed"


def test_ranks_with_different_qk_clip_settings_all_raise_naming_the_option():
    messages = run_distributed(different_tau, 2)
    assert all("qk_clip_tau differs across ranks (rank 0: 100.0, rank 1: 101.0)" in m for m in messages), messages


def interleaved(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A fused QKV weight interleaved by key group: per group its query rows, its key rows, its value rows."""
    parts = [w.reshape(kv_heads, -1, w.shape[-1]) for w in (wq, wk, wv)]
    return torch.cat(parts, dim=1).reshape(-1, wq.shape[-1])


def test_a_fused_qkv_weight_is_clipped_as_its_separate_projections():
    g = torch.Generator().manual_seed(3)
    separate = {name: torch.randn(rows, 6, generator=g) for name, rows in (("wq", 12), ("wk", 6), ("wv", 6))}
    a = {n: torch.nn.Parameter(w.clone()) for n, w in separate.items()}
    heads = AttentionHeads(q="wq", k="wk", n_heads=4, head_dim=3, n_kv_heads=2)
    opt_a = dtensor_muon.Muon(list(a.items()), lr=0.02, qk_clip_tau=TAU, qk_clip_heads={"l": heads})
    fused = torch.nn.Parameter(interleaved(*separate.values(), kv_heads=2))
    opt_b = dtensor_muon.Muon(
        [("wqkv", fused)],
        lr=0.02,
        matrix_splits={"wqkv": dtensor_muon.MatrixSplit.grouped_qkv(4, 2, 3)},  # each projection updated alone
        qk_clip_tau=TAU,
        qk_clip_heads={"l": AttentionHeads.grouped_qkv("wqkv", n_heads=4, n_kv_heads=2, head_dim=3)},
    )
    for step in range(2):
        grads = {n: gradient(p.shape, step, i) for i, (n, p) in enumerate(a.items())}
        for n, p in a.items():
            p.grad = grads[n]
        fused.grad = interleaved(*grads.values(), kv_heads=2)
        for opt in (opt_a, opt_b):
            opt.record_max_logits("l", torch.tensor(MAXIMA["GQA"]))
            opt.step()
    assert torch.equal(fused.detach(), interleaved(*(p.detach() for p in a.values()), kv_heads=2))
