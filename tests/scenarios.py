"""A model with awkward shapes, deterministic gradients, and the distributed runs the tests compare.

Shapes: dims not divisible by 3, 4 or 8; a 3×12 matrix (fewer rows than ranks: empty shards); a 3-D expert
parameter; a 4-D weight; an embedding and an output head, a norm and a bias (AdamW); a matrix that never
gets a gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_muon import Muon

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


def reference_run(steps: int, **options: Any) -> list[torch.Tensor]:
    """Single process, plain tensors: the result every distributed run must reproduce."""
    params = [(n, p.clone().requires_grad_()) for n, p in initial_params()]
    opt = Muon(params, **{**OPTIONS, **options})
    for step in range(steps):
        for (name, p), (_, g) in zip(params, gradients(step).items()):
            p.grad = g
        opt.step()
    return [p.detach() for _, p in params]


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
    if kind in ("hsdp", "2d"):
        return init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("a", "b"))
    return init_device_mesh("cpu", (world_size,))


class ParamHolder(nn.Module):
    """A module whose parameters are exactly the given (name, tensor) pairs (dots become '_')."""

    def __init__(self, params: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        for name, p in params:
            self.register_parameter(name.replace(".", "__"), nn.Parameter(p))


def distributed_params(kind: str, world_size: int) -> list[tuple[str, nn.Parameter]]:
    mesh = make_mesh(kind, world_size)
    return [
        (name, nn.Parameter(distribute_tensor(p, mesh, placements_for(kind, p.ndim))))
        for name, p in initial_params()
    ]


def set_gradients(params: list[tuple[str, nn.Parameter]], step: int) -> None:
    for (name, p), g in zip(params, gradients(step).values()):
        p.grad = None if g is None else distribute_tensor(g, p.device_mesh, p.placements)


def train_steps(rank: int, world_size: int, kind: str, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """Run ``steps`` steps on DTensor parameters; return full parameters and the plan's imbalance."""
    params = distributed_params(kind, world_size)
    opt = Muon(params, **{**OPTIONS, **options})
    for step in range(steps):
        set_gradients(params, step)
        opt.step()
    return {
        "params": [p.full_tensor() for _, p in params],
        "imbalance": [plan.imbalance for plan in opt.plans],
        "metrics": opt.metrics,
    }


def nonfinite_step(rank: int, world_size: int) -> dict[str, Any]:
    """Step 0 normal; step 1 with a NaN in rank 1's shard only (skip_nonfinite); step 2 normal."""
    params = distributed_params("shard0", world_size)
    opt = Muon(params, skip_nonfinite=True, **OPTIONS)
    set_gradients(params, 0)
    opt.step()
    before = [p.full_tensor() for _, p in params]
    state_before = {n: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v.clone()) for k, v in opt.state[p].items()}
                    for n, p in params}
    set_gradients(params, 1)
    if rank == 1:
        params[1][1].grad.to_local().view(-1)[0] = float("nan")
    opt.step()
    after = [p.full_tensor() for _, p in params]
    state_after = {n: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v.clone()) for k, v in opt.state[p].items()}
                   for n, p in params}
    skipped = opt.skipped_steps
    set_gradients(params, 1)
    opt.step()
    return {"before": before, "after": after, "state_before": state_before, "state_after": state_after,
            "skipped": skipped, "final": [p.full_tensor() for _, p in params]}


def dcp_save(rank: int, world_size: int, path: str, steps: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, get_model_state_dict

    params = distributed_params("shard0", world_size)
    model = ParamHolder(params)
    named = [(n, getattr(model, n.replace(".", "__"))) for n, _ in params]
    opt = Muon(named, **OPTIONS)
    for step in range(steps):
        set_gradients(named, step)
        opt.step()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    dist.barrier()


def dcp_resume(rank: int, world_size: int, path: str, start: int, steps: int) -> list[torch.Tensor]:
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
    opt = Muon(named, **OPTIONS)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for step in range(start, start + steps):
        set_gradients(named, step)
        opt.step()
    return [p.full_tensor() for _, p in named]
