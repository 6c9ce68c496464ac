"""Optimizer state kept in host memory while its parameters live on an accelerator.

A DTensor whose local tensor is on the host keeps its mesh, placements and global shape: it is built from its
:class:`DTensorSpec` directly (as FSDP2's CPU offload keeps its sharded parameters), because
``DTensor.from_local`` moves a local tensor to the mesh's device type. torch.distributed.checkpoint saves and
loads such DTensors like any other (it reads and fills their local tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def on_host(t: Tensor) -> bool:
    """Whether the values of ``t`` (a DTensor's local tensor) are in host memory."""
    return (t.to_local() if isinstance(t, DTensor) else t).device.type == "cpu"


def in_place(t: Tensor) -> bool:
    """Whether ``t``'s values are in host memory, and pinned there where an accelerator is present."""
    values = t.to_local() if isinstance(t, DTensor) else t
    return values.device.type == "cpu" and (values.is_pinned() or not torch.cuda.is_available())


def pinned_empty_like(t: Tensor) -> Tensor:
    """An uninitialized host tensor with ``t``'s shape, strides and dtype, page-locked where an accelerator is
    present (so that copies to and from it run asynchronously)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=torch.cuda.is_available())


def to_host(t: Tensor) -> Tensor:
    """``t`` with its values in host memory, pinned where an accelerator is present: a DTensor keeps its mesh,
    placements, global shape and strides, with its local tensor copied; ``t`` itself where its values are there
    already."""
    if in_place(t):
        return t
    if isinstance(t, DTensor):
        host = pinned_empty_like(t.to_local())
        host.copy_(t.to_local())
        return DTensor(host, t._spec, requires_grad=False)
    host = pinned_empty_like(t)
    host.copy_(t)
    return host


def swap_storage(a: Tensor, b: Tensor) -> None:
    """Exchange the values of two tensors of one shape, strides and dtype without copying them: each takes the
    other's storage (so a DTensor holding ``a`` as its local tensor now reads ``b``'s former values)."""
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        raise ValueError(
            f"swap_storage: tensors differ: {tuple(a.shape)} {a.stride()} {a.dtype} and "
            f"{tuple(b.shape)} {b.stride()} {b.dtype}"
        )
    held = (a.untyped_storage(), a.storage_offset(), a.size(), a.stride())
    a.set_(b.untyped_storage(), b.storage_offset(), b.size(), b.stride())
    b.set_(*held)
