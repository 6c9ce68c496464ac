"""Tensor- and expert-parallel models as torchtitan lays them out, trained in gloo processes next to a
single-process reference fed the same (gathered) gradients.

The dense model is a one-block transformer with every torchtitan tensor-parallel style: a row-parallel
embedding, sequence-parallel norms, column- and row-parallel projections and a column-parallel head. The
vocabulary (23) is uneven over any TP degree, and FSDP's shards of the TP pieces are uneven at TP 4 (hidden
20: TP pieces of 5 rows, FSDP halves of 3 and 2); activations stay even, as DTensor's tensor-parallel styles
need. FSDP (``fully_shard``) or HSDP goes over the
data-parallel mesh dims; the expert model has 3-D experts sharded over an ``ep`` mesh dim and FSDP over the
others, next to a dense matrix sharded over every rank, as torchtitan meshes them; with expert tensor
parallelism the experts are also split over ``tp``.

Every mesh, module and tensor of a worker is on :func:`dist_harness.worker_device`, and so is the one-process
reference each rank computes beside it (bitwise equality holds only device against the same device); whole
values come back on the CPU (:func:`dist_harness.full_tensor`). On CUDA workers (ranks sharing ``cuda:0``
over gloo) the gradients are synthetic, laid out as training leaves them (a ``Replicate`` norm's as
``Partial`` over ``tp``): the models' forward passes gather CUDA DTensors with DTensor's own all-gather
(sequence parallelism's ``Shard(1)`` → ``Replicate``, the experts' outputs), which crashes over gloo in torch 2.11.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import full_tensor, worker_device
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dtensor_muon import MatrixSplit, Muon, NorMuon
from dtensor_muon.distributed.layout import box_slices, read_layout, tensor_parallel_blocks

VOCAB, DIM, HIDDEN, EXPERTS = 23, 12, 20, 4
OPTIONS: dict[str, Any] = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block()])
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def apply_tensor_parallel(model: TinyTransformer, tp_mesh: DeviceMesh) -> None:
    """torchtitan's Llama plan: sequence parallel between the blocks, Colwise/Rowwise inside."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w3": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )


def on_device_gloo() -> bool:
    """Whether this worker's tensors are CUDA ones (ranks sharing ``cuda:0`` over gloo)."""
    return worker_device().type == "cuda"


def shard(module: nn.Module, mesh: DeviceMesh, **options: Any) -> None:
    """``fully_shard(module, mesh=mesh, **options)``; on CUDA workers FSDP2 reduces gradients with SUM and
    divides them itself, since gloo's reduce-scatter of CUDA tensors takes no ReduceOp.AVG."""
    fully_shard(module, mesh=mesh, **options)
    if on_device_gloo():
        module.set_force_sum_reduction_for_comms(True)


def build_dense(kind: str, world_size: int) -> TinyTransformer:
    """``kind``: "tp" (every rank one TP group), "fsdp_tp" (dp × tp = 2 × world/2), "hsdp_tp" (2 × 2 × 2),
    "fsdp" (FSDP alone over every rank). Initialized on the CPU (the same values on every device), then
    moved to this worker's device and laid out over meshes of that device."""
    torch.manual_seed(0)
    model = TinyTransformer().to(worker_device())
    device_type = worker_device().type
    if kind == "fsdp":
        mesh = init_device_mesh(device_type, (world_size,))
        for block in model.layers:
            shard(block, mesh)
        shard(model, mesh)
    elif kind == "tp":
        apply_tensor_parallel(model, init_device_mesh(device_type, (world_size,), mesh_dim_names=("tp",)))
    elif kind == "fsdp_tp":
        mesh = init_device_mesh(device_type, (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, mesh["tp"])
        for block in model.layers:
            shard(block, mesh["dp"])
        shard(model, mesh["dp"])
    elif kind == "hsdp_tp":
        mesh = init_device_mesh(device_type, (2, 2, world_size // 4), mesh_dim_names=("replicate", "shard", "tp"))
        apply_tensor_parallel(model, mesh["tp"])
        shard(model, mesh["replicate", "shard"])
    else:
        raise ValueError(kind)
    return model


def tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(100 + step))


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole of a CPU DTensor, differentiably (the models' losses; CPU workers only)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def on_cpu(t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``t``, detached, on the CPU (what the workers return)."""
    return full_tensor(t).detach()


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole value of ``t`` (a DTensor gathered, a ``Partial`` one summed), detached, on this worker's
    device: what the one-process reference beside the ranks is given."""
    return on_cpu(t).to(worker_device())


def _reference(
    params: dict[str, torch.Tensor], options: dict[str, Any], splits: dict[str, MatrixSplit] | None = None
) -> tuple[dict[str, nn.Parameter], Muon]:
    """One process on this worker's device: plain parameters equal to the whole distributed ones."""
    ref = {name: nn.Parameter(whole(p).clone()) for name, p in params.items()}
    return ref, Muon(list(ref.items()), **{**OPTIONS, **options}, matrix_splits=splits)


def tp_block_splits(params: dict[str, torch.Tensor]) -> dict[str, MatrixSplit]:
    """Each tensor-parallel matrix cut into its TP blocks: the per-block reference of ``tp_mode="blockwise"``."""
    out = {}
    for name, p in params.items():
        blocks = tensor_parallel_blocks(p)
        if blocks is not None and p.ndim == 2:
            out[name] = MatrixSplit(blocks[0], sizes=blocks[1])
    return out


def _step_both(params: dict[str, nn.Parameter], opt: Muon, ref: dict[str, nn.Parameter], ref_opt: Muon) -> None:
    for name, p in params.items():
        ref[name].grad = whole(p.grad) if p.grad is not None else None
    opt.step()
    ref_opt.step()
    opt.zero_grad()


def _differences(params: dict[str, nn.Parameter], ref: dict[str, nn.Parameter]) -> dict[str, float]:
    """Max |distributed − reference| per parameter (0.0 everywhere when bitwise equal), both computed on this
    worker's device and compared on the CPU."""
    return {name: (on_cpu(p) - ref[name].detach().cpu()).abs().max().item() for name, p in params.items()}


def dense_training(
    rank: int,
    world_size: int,
    kind: str,
    steps: int,
    options: dict[str, Any],
    tp_mode: str = "owned",
    synthetic: bool | None = None,
) -> dict[str, Any]:
    """Train the dense model ``steps`` steps with ``tp_mode``; per step, the max difference of each parameter
    to the one-process reference (per TP block for "blockwise"); each parameter's placements, and the whole
    parameters after the first step and at the end (on the CPU).

    The gradients come from the model's forward and backward, or with ``synthetic`` (the default on CUDA
    workers, whose forward cannot run over gloo) from :func:`set_synthetic_gradients`, the norms' ``Partial``
    over ``tp`` as sequence parallelism's backward leaves them."""
    if synthetic is None:
        synthetic = on_device_gloo()
    model = build_dense(kind, world_size)
    params = dict(model.named_parameters())
    ref, ref_opt = _reference(params, options, tp_block_splits(params) if tp_mode == "blockwise" else None)
    opt = Muon([{"params": list(params.items()), "tp_mode": tp_mode}], **{**OPTIONS, **options})
    history, first_step_params = [], None
    for step in range(steps):
        if synthetic:
            set_synthetic_gradients(params, step, partial_over_tp=True)
        else:
            logits = model(tokens(step))
            full(logits).float().logsumexp(-1).mean().backward()
        _step_both(params, opt, ref, ref_opt)
        history.append(_differences(params, ref))
        if step == 0:
            first_step_params = {n: on_cpu(p).clone() for n, p in params.items()}
    return {
        "history": history,
        "placements": {n: str(p.placements) for n, p in params.items()},
        "first_step_params": first_step_params,
        "params": {n: on_cpu(p) for n, p in params.items()},
    }


class Experts(nn.Module):
    """3-D experts ``w[e]`` (DIM × HIDDEN) applied to every token and summed (no routing: every expert gets a
    gradient)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(x.unsqueeze(0).expand(self.w.shape[0], -1, -1), self.w)


def expert_training(
    rank: int,
    world_size: int,
    expert_shard_dim: int,
    steps: int,
    options: dict[str, Any],
    synthetic: bool | None = None,
) -> dict[str, Any]:
    """Mesh (dp 2, ep world/2): experts Shard(0) over ep, FSDP over dp on ``expert_shard_dim`` (0 gives
    torchtitan's _StridedShard, 1 its Shard(1)); a dense matrix FSDP-sharded over all ranks. The gradients
    come from a forward and backward, or with ``synthetic`` (the default on CUDA workers: the forward gathers
    the experts' outputs with DTensor's all-gather) from :func:`set_synthetic_gradients`."""
    if synthetic is None:
        synthetic = on_device_gloo()
    torch.manual_seed(0)
    mesh = init_device_mesh(worker_device().type, (2, world_size // 2), mesh_dim_names=("dp", "ep"))
    experts_full = torch.randn(EXPERTS, DIM, HIDDEN)
    dense = nn.Linear(HIDDEN, DIM, bias=False).to(worker_device())
    experts = Experts(distribute_tensor(experts_full.to(worker_device()), mesh["ep"], [Shard(0)]))
    shard(experts, mesh["dp"], shard_placement_fn=lambda p: Shard(expert_shard_dim))
    shard(dense, mesh["dp", "ep"]._flatten("dp_ep"))
    params = {"layers.0.moe.experts.w": experts.w, "layers.0.w_dense.weight": dense.weight}
    ref, ref_opt = _reference(params, options)
    opt = Muon(list(params.items()), **{**OPTIONS, **options})
    ep_mesh = mesh["ep"]
    history = []
    for step in range(steps):
        if synthetic:
            set_synthetic_gradients(params, step)
        else:
            x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(200 + step))
            h = experts(DTensor.from_local(x, ep_mesh, [Replicate()]))  # (E, tokens, HIDDEN), Shard(0) over ep
            h = h.full_tensor().sum(0)
            dense(torch.tanh(h)).square().mean().backward()
        _step_both(params, opt, ref, ref_opt)
        history.append(_differences(params, ref))
    return {"history": history, "placements": {n: str(p.placements) for n, p in params.items()}}


def expert_tensor_parallel_training(rank: int, world_size: int, steps: int, tp_mode: str, fsdp: bool) -> dict[str, Any]:
    """torchtitan's expert tensor parallelism: experts ``Shard(0)`` over ``ep`` and ``Shard(1)`` (w1, w3) or
    ``Shard(2)`` (w2) over ``tp``; with ``fsdp``, FSDP2 over a ``dp`` dim in front (``_StridedShard(0)`` on top of
    the ``ep`` split). Synthetic whole gradients; per step the max difference to one process."""
    torch.manual_seed(0)
    dims = (2, 2, world_size // 4) if fsdp else (2, world_size // 2)
    names = ("dp", "ep", "tp") if fsdp else ("ep", "tp")
    mesh = init_device_mesh(worker_device().type, dims, mesh_dim_names=names)
    shapes = {"w1": (EXPERTS, HIDDEN, DIM), "w2": (EXPERTS, DIM, HIDDEN), "w3": (EXPERTS, HIDDEN, DIM)}
    tp_dim = {"w1": 1, "w2": 2, "w3": 1}
    holder = nn.Module()
    for name, shape in shapes.items():
        full_w = torch.randn(shape).to(worker_device())
        holder.register_parameter(
            name, nn.Parameter(distribute_tensor(full_w, mesh["ep", "tp"], [Shard(0), Shard(tp_dim[name])]))
        )
    if fsdp:
        shard(holder, mesh["dp"])
    params = {f"layers.0.moe.experts.{n}": p for n, p in holder.named_parameters()}
    ref, ref_opt = _reference(params, {})
    opt = Muon(list(params.items()), **OPTIONS, tp_mode=tp_mode)
    history = []
    for step in range(steps):
        set_synthetic_gradients(params, step)
        _step_both(params, opt, ref, ref_opt)
        history.append(_differences(params, ref))
    return {"history": history, "placements": {n: str(p.placements) for n, p in params.items()}}


def synthetic_gradients(params: dict[str, nn.Parameter], step: int) -> dict[str, torch.Tensor]:
    """Whole gradients that depend on the name and step only, the same in every layout (made on the CPU:
    the same values on every device)."""
    out = {}
    for k, (name, p) in enumerate(sorted(params.items())):
        out[name] = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + k))
    return out


def set_synthetic_gradients(params: dict[str, nn.Parameter], step: int, partial_over_tp: bool = False) -> None:
    """Each rank's piece of :func:`synthetic_gradients`, on this worker's device, in its parameter's placements;
    with ``partial_over_tp``, ``Partial`` where a parameter is ``Replicate`` over a mesh dim named ``tp`` (as
    sequence parallelism's backward leaves a norm's gradient: the optimizer sums it), the piece held by that
    dim's first rank and zeros by the others (summed, exactly the piece)."""
    for name, g in synthetic_gradients(params, step).items():
        p = params[name]
        piece = g[box_slices(read_layout(name, p).local_box)].to(worker_device())
        placements = list(p.placements)
        if partial_over_tp:
            names = p.device_mesh.mesh_dim_names or ()
            for dim, placement in enumerate(placements):
                if names[dim : dim + 1] == ("tp",) and isinstance(placement, Replicate):
                    placements[dim] = Partial()
                    if p.device_mesh.get_local_rank(dim) != 0:
                        piece = torch.zeros_like(piece)
        p.grad = DTensor.from_local(piece, p.device_mesh, placements, shape=p.shape, stride=p.stride())


OPTIMIZERS: dict[str, type] = {"Muon": Muon, "NorMuon": NorMuon}


def synthetic_reference(steps: int, optimizer: str = "Muon", device: str = "cpu") -> dict[str, torch.Tensor]:
    """One process, plain tensors on ``device``: the dense model's parameters after ``steps`` synthetic steps,
    returned on the CPU."""
    torch.manual_seed(0)
    params = {name: nn.Parameter(p.detach().clone().to(device)) for name, p in TinyTransformer().named_parameters()}
    opt = OPTIMIZERS[optimizer](list(params.items()), **OPTIONS)
    for step in range(steps):
        for name, g in synthetic_gradients(params, step).items():
            params[name].grad = g.to(device)
        opt.step()
    return {name: p.detach().cpu() for name, p in params.items()}


def dense_dcp_save(
    rank: int, world_size: int, kind: str, path: str, steps: int, optimizer: str = "Muon", tp_mode: str = "owned"
) -> None:
    """``steps`` synthetic steps of the dense model laid out as ``kind``, then a DCP save of model and optimizer."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = build_dense(kind, world_size)
    params = dict(model.named_parameters())
    opt = OPTIMIZERS[optimizer](list(params.items()), **OPTIONS, tp_mode=tp_mode)
    for step in range(steps):
        set_synthetic_gradients(params, step)
        opt.step()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    dist.barrier()


def dense_dcp_resume(
    rank: int, world_size: int, kind: str, path: str, start: int, steps: int, optimizer: str = "Muon"
) -> dict[str, torch.Tensor]:
    """A fresh dense model laid out as ``kind`` loads :func:`dense_dcp_save`'s checkpoint and runs steps
    ``start`` onwards; returns the whole parameters."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = build_dense(kind, world_size)
    params = dict(model.named_parameters())
    opt = OPTIMIZERS[optimizer](list(params.items()), **OPTIONS)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    for step in range(start, start + steps):
        set_synthetic_gradients(params, step)
        opt.step()
    return {name: on_cpu(p) for name, p in params.items()}
