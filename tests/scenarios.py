"""A model with awkward shapes, deterministic gradients, and the distributed runs the tests compare.

Shapes: dims not divisible by 3, 4 or 8; a 3×12 matrix (fewer rows than ranks: empty shards); a 3-D expert
parameter; a 4-D weight; an embedding and an output head, a norm and a bias (AdamW); a matrix that never
gets a gradient.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from dist_harness import full_tensor, one_thread, worker_device
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_muon import AttentionHeads, Muon

SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("tok_embeddings.weight", (50, 12)),
    ("layers.0.attention.wq", (20, 12)),
    ("layers.0.attention.tiny", (3, 12)),
    ("layers.0.moe.experts", (5, 12, 7)),
    ("layers.0.conv", (6, 2, 3, 3)),
    ("layers.0.norm.weight", (12,)),
    ("layers.0.bias", (20,)),
    ("layers.0.unused", (9, 10)),
    ("layers.1.attention.wq", (20, 12)),
    ("output.weight", (11, 12)),
]
NO_GRAD = {"layers.0.unused"}
OPTIONS: dict[str, Any] = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


def initial_params(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(name, torch.randn(shape, generator=g)) for name, shape in SHAPES]


def gradients(step: int) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(1000 + step)
    return {name: (None if name in NO_GRAD else torch.randn(shape, generator=g)) for name, shape in SHAPES}


def assert_same_run(names: list[str], got: dict, want: dict) -> None:
    """Two runs' ``{"params": [...], "state": [{key: tensor}, ...]}``, one entry per name, equal bit for bit (the
    state also in dtype)."""
    for name, a, b in zip(names, got["params"], want["params"]):
        assert torch.equal(a, b), f"{name}: max |Δ| {float((a - b).abs().max()):.3e}"
    for name, a, b in zip(names, got["state"], want["state"]):
        assert set(a) == set(b), name
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (name, key)


def reference_run(steps: int, device: str = "cpu", **options: Any) -> list[torch.Tensor]:
    """Single process, plain tensors on ``device`` (on the CPU on one thread, as the gloo workers run): the
    result every distributed run must reproduce; returned on the CPU."""
    with one_thread():
        params = [(n, p.to(device).requires_grad_()) for n, p in initial_params()]
        opt = Muon(params, **{**OPTIONS, **options})
        for step in range(steps):
            for (_, p), (_, g) in zip(params, gradients(step).items()):
                p.grad = None if g is None else g.to(device)
            opt.step()
    return [p.detach().cpu() for _, p in params]


def placements_for(kind: str, ndim: int) -> list:
    if kind == "shard0":
        return [Shard(0)]
    if kind == "shard1":
        return [Shard(1) if ndim >= 2 else Shard(0)]
    if kind == "replicate":
        return [Replicate()]
    if kind == "hsdp":  # 2-D mesh: replicate over dim 0, shard rows over dim 1
        return [Replicate(), Shard(0)]
    if kind == "2d":  # 2-D mesh: rows over dim 0, columns over dim 1
        return [Shard(0), Shard(1) if ndim >= 2 else Shard(0)]
    raise ValueError(kind)


def make_mesh(kind: str, world_size: int):
    """A mesh of this worker's device type (:func:`dist_harness.worker_device`)."""
    device_type = worker_device().type
    if kind in ("hsdp", "2d"):
        return init_device_mesh(device_type, (2, world_size // 2), mesh_dim_names=("a", "b"))
    return init_device_mesh(device_type, (world_size,))


class ParamHolder(nn.Module):
    """A module whose parameters are exactly the given (name, tensor) pairs (dots become '_')."""

    def __init__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        for name, p in params:
            self.register_parameter(name.replace(".", "__"), nn.Parameter(p))


def distributed_params(kind: str, world_size: int) -> list[tuple[str, nn.Parameter]]:
    if kind == "two_meshes":  # experts on sub-meshes of 2 ranks (rows split), the rest on all ranks
        dense = init_device_mesh(worker_device().type, (world_size,))
        experts = init_device_mesh(worker_device().type, (world_size // 2, 2), mesh_dim_names=("dp", "ep"))["ep"]
        return [
            (
                name,
                nn.Parameter(
                    distribute_tensor(p, experts, [Shard(1)])
                    if p.ndim == 3
                    else distribute_tensor(p, dense, [Shard(0)])
                ),
            )
            for name, p in initial_params()
        ]
    mesh = make_mesh(kind, world_size)
    return [
        (name, nn.Parameter(distribute_tensor(p, mesh, placements_for(kind, p.ndim)))) for name, p in initial_params()
    ]


def set_gradients(params: list[tuple[str, nn.Parameter]], step: int) -> None:
    for (_, p), g in zip(params, gradients(step).values()):
        p.grad = None if g is None else distribute_tensor(g, p.device_mesh, p.placements)


def train_steps(rank: int, world_size: int, kind: str, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """Run ``steps`` steps on DTensor parameters; return full parameters and the plan's imbalance."""
    params = distributed_params(kind, world_size)
    opt = Muon(params, **{**OPTIONS, **options})
    for step in range(steps):
        set_gradients(params, step)
        opt.step()
    from dtensor_muon.distributed.layout import read_layout

    layout_ok = []
    for name, p in params:
        box = read_layout(name, p).local_box
        layout_ok.append(torch.equal(p.to_local().cpu(), full_tensor(p)[tuple(slice(a, b) for a, b in box)]))
    return {
        "layout_ok": layout_ok,
        "params": [full_tensor(p) for _, p in params],
        "imbalance": [plan.imbalance for plan in opt.plans],
        "metrics": opt.metrics,
    }


def full_state(opt: Muon, params: list[tuple[str, nn.Parameter]]) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's optimizer state, gathered whole (DTensors) or copied (plain tensors)."""
    return {n: {k: full_tensor(v) for k, v in opt.state[p].items()} for n, p in params}


def nonfinite_step(rank: int, world_size: int) -> dict[str, Any]:
    """Step 0 normal; step 1 with a NaN in rank 1's shard only (skip_nonfinite); step 2 normal."""
    params = distributed_params("shard0", world_size)
    opt = Muon(params, skip_nonfinite=True, **OPTIONS)
    set_gradients(params, 0)
    opt.step()
    before = [full_tensor(p) for _, p in params]
    state_before = full_state(opt, params)
    set_gradients(params, 1)
    if rank == 1:
        params[1][1].grad.to_local().view(-1)[0] = float("nan")
    opt.step()
    after = [full_tensor(p) for _, p in params]
    state_after = full_state(opt, params)
    skipped = opt.skipped_steps
    set_gradients(params, 1)
    opt.step()
    return {
        "before": before,
        "after": after,
        "state_before": state_before,
        "state_after": state_after,
        "skipped": skipped,
        "final": [full_tensor(p) for _, p in params],
    }


def dcp_save(
    rank: int, world_size: int, path: str, steps: int, optimizer: type = Muon, options: dict[str, Any] | None = None
) -> None:
    """``steps`` steps of ``optimizer`` (Muon with OPTIONS by default) on Shard(0) parameters, then a DCP save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    params = distributed_params("shard0", world_size)
    model = ParamHolder(params)
    named = [(n, getattr(model, n.replace(".", "__"))) for n, _ in params]
    opt = optimizer(named, **(OPTIONS if options is None else options))
    for step in range(steps):
        set_gradients(named, step)
        opt.step()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    dist.barrier()


def dcp_resume(
    rank: int,
    world_size: int,
    path: str,
    start: int,
    steps: int,
    optimizer: type = Muon,
    options: dict[str, Any] | None = None,
) -> list[torch.Tensor]:
    """Fresh parameters and ``optimizer``, DCP load of :func:`dcp_save`'s checkpoint, steps ``start`` onwards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    mesh = make_mesh("shard0", world_size)
    params = [(n, nn.Parameter(distribute_tensor(torch.zeros_like(p), mesh, [Shard(0)]))) for n, p in initial_params()]
    model = ParamHolder(params)
    named = [(n, getattr(model, n.replace(".", "__"))) for n, _ in params]
    opt = optimizer(named, **(OPTIONS if options is None else options))
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for step in range(start, start + steps):
        set_gradients(named, step)
        opt.step()
    return [full_tensor(p) for _, p in named]


def shard(module: nn.Module, mesh) -> None:
    """``fully_shard(module, mesh=mesh)``; on CUDA workers FSDP2 reduces gradients with SUM and divides them
    itself, since gloo's reduce-scatter of CUDA tensors takes no ReduceOp.AVG."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=mesh)
    if worker_device().type == "cuda":
        module.set_force_sum_reduction_for_comms(True)


def shard_blocks_and_root(model: nn.Module, world_size: int, prefetch: bool) -> None:
    """:func:`shard` each of ``model.blocks``, then ``model``, over every rank; ``prefetch``: each block
    unshards the next one when it is entered (FSDP2's explicit forward prefetch)."""
    mesh = make_mesh("shard0", world_size)
    for block in model.blocks:
        shard(block, mesh)
    shard(model, mesh)
    if prefetch:
        for current, following in zip(model.blocks[:-1], model.blocks[1:]):
            current.set_modules_to_forward_prefetch([following])


def fsdp_training(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """A real ``fully_shard`` model; returns, per step, the full gradients fed to Muon and the full params."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(37, 10),
        nn.Linear(10, 13),
        nn.GELU(),
        nn.Linear(13, 3),
        nn.GELU(),
        nn.Linear(3, 10),
        nn.LayerNorm(10),
        nn.Linear(10, 37, bias=False),
    )
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    for layer in model:
        if any(p.requires_grad for p in layer.parameters()):
            shard(layer, make_mesh("shard0", world_size))
    shard(model, make_mesh("shard0", world_size))
    opt = Muon(model.named_parameters(), **OPTIONS)
    fed = []
    for step in range(steps):
        tokens = torch.randint(0, 37, (4, 6), generator=torch.Generator().manual_seed(100 * step + rank))
        tokens = tokens.to(worker_device())
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 37), tokens.roll(1, dims=1).reshape(-1))
        loss.backward()
        fed.append({n: full_tensor(p.grad) for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {
        "initial": initial,
        "grads": fed,
        "params": {n: full_tensor(p) for n, p in model.named_parameters()},
        "names": [n for n, _ in model.named_parameters()],
    }


def failure_cases(rank: int, world_size: int) -> dict[str, str]:
    """Errors that must be raised on every rank (or locally, before any collective), never hang."""
    from torch.distributed.tensor import DTensor, Partial

    out: dict[str, str] = {}
    mesh = make_mesh("shard0", world_size)
    partial = nn.Parameter(DTensor.from_local(torch.randn(4, 4, device=worker_device()), mesh, [Partial()]))
    try:
        Muon([("w_partial", partial)])
    except ValueError as exc:
        out["placement"] = str(exc)
    names = [f"rank{rank}.w" if rank == 1 else "w"]
    param = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    try:
        Muon(list(zip(names, [param])))
    except RuntimeError as exc:
        out["plan"] = str(exc)
    params = distributed_params("shard0", world_size)
    opt = Muon(params, **OPTIONS)
    set_gradients(params, 0)
    if rank == 0:  # a gradient in other placements on one rank only: redistributing it alone would hang
        p = params[1][1]
        p.grad = DTensor.from_local(
            torch.randn(p.shape, device=worker_device()), p.device_mesh, [Partial()], run_check=False
        )
    before = [full_tensor(p) for _, p in params]
    try:
        opt.step()
    except RuntimeError as exc:
        out["step"] = str(exc)
    out["unchanged"] = str(all(torch.equal(a, full_tensor(p)) for a, (_, p) in zip(before, params)))
    return out


class Blocks(nn.Module):
    """Embedding, four FSDP blocks of awkward widths, head; block 2 is skipped on odd steps."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(29, 10)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(10, 13), nn.GELU(), nn.Linear(13, 10)) for _ in range(4)])
        self.output = nn.Linear(10, 29, bias=False)
        self.skip_block = -1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for i, block in enumerate(self.blocks):
            if i != self.skip_block:
                h = h + block(h)
        return self.output(h)


def overlap_training(
    rank: int, world_size: int, overlap: bool, steps: int, path: str, prefetch: bool = False
) -> dict[str, Any]:
    """FSDP2 training with or without overlap; a DCP save after step 2; ordering observations per forward.

    With ``prefetch`` FSDP unshards block k+1 when entering block k (explicit forward prefetch).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    torch.manual_seed(0)
    model = Blocks()
    shard_blocks_and_root(model, world_size, prefetch)
    opt = Muon(model.named_parameters(), overlap=overlap, **OPTIONS)
    opt.attach(model)
    observations: list[dict[str, bool]] = []
    snapshot: dict[int, torch.Tensor] = {}

    def after_block(k: int):
        def hook(module, args, output) -> None:
            if snapshot and k + 1 < len(model.blocks):
                nxt = model.blocks[k + 1][0].weight.to_local()
                cur = model.blocks[k][0].weight.to_local()
                observations.append(
                    {
                        "step": current_step[0],
                        "block": k,
                        "next_pending": torch.equal(nxt, snapshot[k + 1]),
                        "this_applied": not torch.equal(cur, snapshot[k]),
                    }
                )

        return hook

    for k, block in enumerate(model.blocks):
        block.register_forward_hook(after_block(k))
    saved = None
    current_step = [0]
    for step in range(steps):
        current_step[0] = step
        model.skip_block = 2 if step % 2 == 1 else -1
        tokens = torch.randint(0, 29, (3, 5), generator=torch.Generator().manual_seed(100 * step + rank))
        tokens = tokens.to(worker_device())
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 29), tokens.roll(1, dims=1).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        snapshot = {k: b[0].weight.to_local().clone() for k, b in enumerate(model.blocks)}
        if step == 2:
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            saved = {k: full_tensor(v) for k, v in state["model"].items()}
            dcp.save(state, checkpoint_id=path)
    opt.flush()
    return {
        "params": {n: full_tensor(p) for n, p in model.named_parameters()},
        "saved": saved,
        "observations": observations,
    }


class ResidualMLP(nn.Module):
    """An embedding, three Linear→GELU→Linear residual blocks, a LayerNorm and a head. On a GPU the blocks are
    wide enough (256 → 1024 → 256) that a block's work takes longer than launching the next one, so an update not
    ordered before FSDP2's all-gather on its own stream shows in the results; the CPU has no such streams, and
    there the blocks are half as wide (128 → 512 → 128): the same modules, shards, hooks and optimizer options."""

    VOCAB = 512
    WIDTHS: ClassVar[dict[str, tuple[int, int]]] = {"cuda": (256, 1024), "cpu": (128, 512)}
    """(model width, hidden width of a block) on each device type."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        dim, hidden = self.WIDTHS[device_type]
        self.tok_embeddings = nn.Embedding(self.VOCAB, dim)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(3)]
        )
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, self.VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.output(self.norm(h))


def residual_mlp_batch(step: int, device: torch.device) -> torch.Tensor:
    """4×64 tokens, the same on every rank."""
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randint(0, ResidualMLP.VOCAB, (4, 64), generator=generator).to(device)


def residual_mlp_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, ResidualMLP.VOCAB), tokens.roll(1, dims=1).reshape(-1))


def residual_qk_clip(device_type: str) -> dict[str, Any]:
    """QK-clip on :class:`ResidualMLP`, two of its hidden-width weights (1024 rows on a GPU, 512 on the CPU)
    standing for an MHA layer's query and key of 8 heads."""
    hidden = ResidualMLP.WIDTHS[device_type][1]
    heads = AttentionHeads(q="blocks.0.0.weight", k="blocks.1.0.weight", n_heads=8, head_dim=hidden // 8)
    return dict(qk_clip_tau=50.0, qk_clip_heads={"block0": heads})


def residual_mlp_max_logits(step: int) -> torch.Tensor:
    """The per-head maxima the residual MLP's tests hand over at ``step``: some heads above τ = 50."""
    return torch.tensor([10.0, 80.0, 40.0, 50.0, 200.0, 3.0, 45.0, 60.0]) * (1 + step / 4)


def residual_mlp_one_process(steps: int, device: torch.device, qk_clip: bool = False) -> dict[str, Any]:
    """The reference: :class:`ResidualMLP` and ``Muon(lr=0.02)`` in one process on ``device`` (with
    :func:`residual_qk_clip` when ``qk_clip``)."""
    torch.manual_seed(0)
    model = ResidualMLP(device.type).to(device)
    opt = Muon(model.named_parameters(), lr=0.02, **(residual_qk_clip(device.type) if qk_clip else {}))
    losses = []
    for step in range(steps):
        loss = residual_mlp_loss(model, residual_mlp_batch(step, device))
        loss.backward()
        losses.append(loss.item())
        if qk_clip:
            opt.record_max_logits("block0", residual_mlp_max_logits(step))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach().cpu() for n, p in model.named_parameters()}}


def residual_mlp_fsdp(
    rank: int, world_size: int, steps: int, overlap: bool, prefetch: bool, qk_clip: bool = False
) -> dict[str, Any]:
    """:func:`residual_mlp_one_process` under FSDP2 (each block, then the root), the same batch on every rank,
    with or without overlap; ``prefetch``: each block unshards the next one (explicit forward prefetch)."""
    torch.manual_seed(0)
    model = ResidualMLP(worker_device().type)
    shard_blocks_and_root(model, world_size, prefetch)
    clip = residual_qk_clip(worker_device().type) if qk_clip else {}
    opt = Muon(model.named_parameters(), lr=0.02, overlap=overlap, **clip)
    opt.attach(model)
    losses = []
    for step in range(steps):
        loss = residual_mlp_loss(model, residual_mlp_batch(step, worker_device()))
        loss.backward()
        losses.append(loss.item())
        if qk_clip and rank == step % world_size:  # one rank saw the maxima: the all-reduce spreads them
            opt.record_max_logits("block0", residual_mlp_max_logits(step))
        opt.step()
        opt.zero_grad()
    opt.flush()
    # each rank's Shard(0) piece, joined by the test: full_tensor() (DTensor's functional all-gather) crashes
    # on gloo with CUDA tensors in torch 2.11
    return {"losses": losses, "pieces": {n: p.to_local() for n, p in model.named_parameters()}}
