"""A fused QKV weight whose rows interleave by KV group (torchtitan 0.3's ``wqkv``): per KV group its h query
heads, one key head, one value head, each d rows. ``MatrixSplit.grouped_qkv`` cuts it into W_q, W_k, W_v
(``per="projection"``) or into its heads (``per="head"``); either way each matrix takes exactly the update of
a separate parameter holding the same rows.

The reference here is written from the layout alone: rows g·(h + 2)·d + j·d + i of the fused weight are row
(g·h + j)·d + i of W_q for j < h, row g·d + i of W_k for j = h and of W_v for j = h + 1. Separate
``nn.Parameter`` s for W_q, W_k, W_v (or for each head) with those rows, stepped on one process, must give the
fused weight's new rows bit for bit, on one process and under FSDP2 and tensor parallelism on 2 gloo
processes. 9 query heads over 3 KV groups of 2-row heads make 30 rows, so the 2-rank shard boundary (row 15)
falls inside group 1's query rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_harness import one_thread, run_distributed
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from dtensor_muon import MOP, SOAP, MatrixSplit, Muon, NorMuon, grouped_qkv_splits

N_HEADS, N_KV, HEAD_DIM, DIM = 9, 3, 2, 8
PER_KV = N_HEADS // N_KV
ROWS = N_KV * (PER_KV + 2) * HEAD_DIM
STEPS = 3
NAME = "layers.0.attention.qkv_linear.wqkv.weight"
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {
    # "original": γ·√max(1, rows/cols) tells W_q (18×8) from W_k (6×8) and from the whole (30×8)
    "muon": (Muon, dict(lr=0.02, weight_decay=0.1)),
    # owner state: v has one entry per row of the whole W_q
    "normuon": (NorMuon, dict(lr=0.02, weight_decay=0.1, beta2=0.9, adjust_lr_fn="match_rms_adamw")),
}
ONE_PROCESS: dict[str, tuple[type, dict[str, Any]]] = {
    **OPTIMIZERS,
    # owner state of the whole matrix (factors, bases, moments), and an SVD's polar factor with Muon's γ'
    "soap": (SOAP, dict(lr=0.01)),
    "mop": (MOP, dict(lr=0.01, scale="shape", adjust_lr_fn="original")),
}


def projection_rows() -> list[list[int]]:
    """The fused rows of W_q, W_k, W_v, each in its own row order."""
    group = (PER_KV + 2) * HEAD_DIM
    q = [g * group + j * HEAD_DIM + i for g in range(N_KV) for j in range(PER_KV) for i in range(HEAD_DIM)]
    k = [g * group + PER_KV * HEAD_DIM + i for g in range(N_KV) for i in range(HEAD_DIM)]
    v = [g * group + (PER_KV + 1) * HEAD_DIM + i for g in range(N_KV) for i in range(HEAD_DIM)]
    return [q, k, v]


def head_rows() -> list[list[int]]:
    """The fused rows of every head (query, key and value heads alike), in fused order."""
    return [list(range(start, start + HEAD_DIM)) for start in range(0, ROWS, HEAD_DIM)]


def rows_of(per: str) -> list[list[int]]:
    return projection_rows() if per == "projection" else head_rows()


def init() -> Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))


def grad(step: int) -> Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(100 + step))


def separate_reference(optimizer: type, options: dict[str, Any], per: str) -> Tensor:
    """One process, one parameter per matrix (the rows ``rows_of(per)`` picks), gathered back into fused order."""
    rows = rows_of(per)
    w = init()
    params = [nn.Parameter(w[r].clone()) for r in rows]
    opt = optimizer([(f"layers.0.attention.w{i}.weight", p) for i, p in enumerate(params)], **options)
    for step in range(STEPS):
        g = grad(step)
        for p, r in zip(params, rows):
            p.grad = g[r].clone()
        opt.step()
    out = torch.empty(ROWS, DIM)
    for p, r in zip(params, rows):
        out[r] = p.detach()
    return out


def fused_one_process(optimizer: type, options: dict[str, Any], split: MatrixSplit | None) -> Tensor:
    param = nn.Parameter(init())
    opt = optimizer([{"params": [(NAME, param)], "matrix_split": split}], **options)
    for step in range(STEPS):
        param.grad = grad(step)
        opt.step()
    return param.detach()


def test_rows_cover_the_weight_once():
    """The reference's row maps are a partition of the fused rows (W_q 18, W_k 6, W_v 6 rows)."""
    q, k, v = projection_rows()
    assert (len(q), len(k), len(v)) == (N_HEADS * HEAD_DIM, N_KV * HEAD_DIM, N_KV * HEAD_DIM)
    assert sorted(q + k + v) == list(range(ROWS))


def test_grouped_qkv_builds_the_split():
    assert MatrixSplit.grouped_qkv(N_HEADS, N_KV, HEAD_DIM) == MatrixSplit(0, sizes=(6, 2, 2), groups=3)
    assert MatrixSplit.grouped_qkv(N_HEADS, N_KV, HEAD_DIM, per="head") == MatrixSplit(0, block=2)
    with pytest.raises(ValueError, match="does not divide"):
        MatrixSplit.grouped_qkv(9, 2, 2)
    with pytest.raises(ValueError, match="per must be"):
        MatrixSplit.grouped_qkv(9, 3, 2, per="group")


def test_grouped_split_needs_the_matrix_rows():
    """A grouped split joins parts along the matrix's rows; along columns, or with rows that do not add up,
    the optimizer refuses it at construction, naming the parameter."""
    param = nn.Parameter(torch.zeros(ROWS, DIM))
    with pytest.raises(ValueError, match=r"wqkv.*split dim 0"):
        Muon([{"params": [(NAME, param)], "matrix_split": MatrixSplit(1, sizes=(2, 2), groups=2)}])
    with pytest.raises(ValueError, match=r"wqkv.*3 × \(6, 2, 1\)"):
        Muon([{"params": [(NAME, param)], "matrix_split": MatrixSplit(0, sizes=(6, 2, 1), groups=3)}])
    with pytest.raises(ValueError, match="block"):
        MatrixSplit(0, block=2, groups=3)


@pytest.mark.parametrize("per", ["projection", "head"])
@pytest.mark.parametrize("optimizer_key", list(ONE_PROCESS))
def test_grouped_split_equals_separate_parameters_one_process(optimizer_key, per):
    optimizer, options = ONE_PROCESS[optimizer_key]
    want = separate_reference(optimizer, options, per)
    got = fused_one_process(optimizer, options, MatrixSplit.grouped_qkv(N_HEADS, N_KV, HEAD_DIM, per=per))
    assert torch.equal(got, want), f"max diff {(got - want).abs().max().item()}"


def test_whole_wqkv_and_per_projection_are_different_optimizers():
    """The fused weight as one matrix, or cut per head, is not the per-projection update (by far more than
    rounding)."""
    optimizer, options = OPTIMIZERS["muon"]
    projection = separate_reference(optimizer, options, "projection")
    for other in (fused_one_process(optimizer, options, None), separate_reference(optimizer, options, "head")):
        assert (other - projection).abs().max() > 1e-3


def test_grouped_split_plans_one_unit_per_projection():
    """The plan computes three matrices (W_q, W_k, W_v), each one unit of its 3 parts, named once each."""
    param = nn.Parameter(init())
    opt = Muon([(NAME, param)], lr=0.02, matrix_splits={"*.wqkv.weight": MatrixSplit.grouped_qkv(9, 3, 2)})
    plan = opt.plans[0]
    assert [len(unit.members) for unit in plan.units] == [3, 3, 3]
    assert [plan.routes[unit.members[0]].spec.name for unit in plan.units] == [f"{NAME}/{j}" for j in range(3)]
    assert [plan.routes[unit.members[0]].spec.whole_shape for unit in plan.units] == [(18, 8), (6, 8), (6, 8)]


def fused_distributed(rank: int, world_size: int) -> dict[str, Tensor]:
    """The fused weight as an nn.Linear under FSDP2 (``fully_shard``) and under ``ColwiseParallel`` (Shard(0)
    on a mesh dim named "tp": every tp_mode), each optimizer and split; its full value after STEPS steps."""
    out = {}
    for key, (optimizer, options) in OPTIMIZERS.items():
        for layout, tp_mode, per in [
            ("fsdp", "owned", "projection"),
            ("fsdp", "owned", "head"),
            ("tp", "owned", "projection"),
            ("tp", "duplicated", "projection"),
            ("tp", "distributed", "projection"),
        ]:
            if tp_mode == "distributed" and optimizer is not Muon:
                continue
            torch.manual_seed(0)
            holder = nn.Module()
            holder.wqkv = nn.Linear(DIM, ROWS, bias=False)
            with torch.no_grad():
                holder.wqkv.weight.copy_(init())
            if layout == "fsdp":
                mesh = init_device_mesh("cpu", (world_size,))
                fully_shard(holder.wqkv, mesh=mesh)
            else:
                mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
                parallelize_module(holder, mesh, {"wqkv": ColwiseParallel()})
            param = holder.wqkv.weight
            assert param.placements == (Shard(0),)
            split = MatrixSplit.grouped_qkv(N_HEADS, N_KV, HEAD_DIM, per=per)
            opt = optimizer([(NAME, param)], **options, tp_mode=tp_mode, matrix_splits={"layers.*.wqkv.weight": split})
            for step in range(STEPS):
                param.grad = distribute_tensor(grad(step), mesh, [Shard(0)])
                opt.step()
            out[f"{key}/{layout}/{tp_mode}/{per}"] = param.full_tensor().detach()
    return out


@pytest.mark.slow
def test_grouped_split_under_fsdp_and_tensor_parallel_equals_separate_parameters():
    """2 gloo processes, rows sharded 15/15 (inside group 1's query rows): FSDP2 and TP (owned, duplicated,
    and distributed, which computes a grouped matrix duplicated) equal separate parameters on one process."""
    results = run_distributed(fused_distributed, 2)
    with one_thread():
        want = {
            (key, per): separate_reference(*OPTIMIZERS[key], per)
            for key in OPTIMIZERS
            for per in ("projection", "head")
        }
    assert len(results[0]) == 9
    for rank, result in enumerate(results):
        for label, got in result.items():
            key, _, _, per = label.split("/")
            expected = want[(key, per)]
            assert torch.equal(got, expected), f"rank {rank}, {label}: max diff {(got - expected).abs().max().item()}"


class FusedQKV(nn.Module):
    """The attributes torchtitan 0.3's FusedQKVLinear has: ``wqkv``, ``heads_per_kv``, ``head_dim``."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, ROWS, bias=False)
        self.heads_per_kv, self.head_dim = PER_KV, HEAD_DIM


def test_grouped_qkv_splits_finds_every_fused_weight_of_a_model():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module(), nn.Module()])
    for layer in model.layers:
        layer.attention = nn.Module()
        layer.attention.qkv_linear = FusedQKV()
        layer.attention.wo = nn.Linear(N_HEADS * HEAD_DIM, DIM, bias=False)
    split = MatrixSplit.grouped_qkv(N_HEADS, N_KV, HEAD_DIM)
    assert grouped_qkv_splits(model) == {f"layers.{i}.attention.qkv_linear.wqkv.weight": split for i in (0, 1)}
    assert set(grouped_qkv_splits(model, per="head").values()) == {MatrixSplit(0, block=HEAD_DIM)}
    model.layers[1].attention.qkv_linear.head_dim = 4  # 30 rows are not groups of 4 heads of 4 rows
    with pytest.raises(ValueError, match=r"layers\.1\.attention\.qkv_linear\.wqkv\.weight"):
        grouped_qkv_splits(model)
