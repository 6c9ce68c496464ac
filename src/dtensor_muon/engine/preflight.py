"""The local checks of a step: every gradient fits its parameter, before any collective.

Anything wrong raises :class:`PreflightError` on the rank that found it; the engine's consensus then makes
every other rank raise too, naming the parameter and that rank, before any data moves.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..distributed.layout import box_shape, read_layout
from .context import Entry, local


class PreflightError(RuntimeError):
    """A parameter failed the local checks of a step (raised on the rank that found it)."""

    def __init__(self, entry: Entry, reason: str) -> None:
        super().__init__(f"parameter {entry.name!r}: {reason}")
        self.index = entry.index


def check_gradients(
    entries: list[Entry], local_shapes: dict[int, torch.Size]
) -> tuple[dict[int, Tensor | None], dict[int, str]]:
    """Local checks only (no collective): every gradient matches its parameter's type, dtype, device,
    layout and piece. Returns the gradients by entry index and, for those in other placements than their
    parameter's (to be redistributed after the consensus), the placements they came in.

    A DTensor gradient must have its parameter's global shape and placements (or ones DTensor can
    redistribute to them), and its local piece (and the parameter's) the shape of the box :mod:`..distributed.layout`
    computed for this rank (``local_shapes``). Raises :class:`PreflightError` naming the first parameter
    that fails.
    """
    grads: dict[int, Tensor | None] = {}
    redistributed: dict[int, str] = {}
    for e in entries:
        g = e.param.grad
        if g is not None:
            if g.is_sparse:
                raise PreflightError(e, "sparse gradients are not supported")
            if g.shape != e.param.shape:
                raise PreflightError(e, f"gradient shape {tuple(g.shape)} != {tuple(e.param.shape)}")
            if g.dtype != e.param.dtype:
                raise PreflightError(
                    e,
                    f"gradient dtype {g.dtype} != parameter dtype {e.param.dtype} (a param.grad_dtype or an "
                    "autocast that leaves the gradient in another dtype); cast the gradient to the "
                    "parameter's dtype before step()",
                )
            if local(g).device != local(e.param).device:
                raise PreflightError(
                    e, f"gradient device {local(g).device} != parameter device {local(e.param).device}"
                )
            if isinstance(e.param, DTensor) != isinstance(g, DTensor) or (
                isinstance(g, DTensor) and g.device_mesh != e.param.device_mesh
            ):
                raise PreflightError(e, "gradient is not a DTensor on the parameter's device mesh")
            if isinstance(g, DTensor) and tuple(g.placements) != tuple(e.param.placements):
                check_redistributable(e, g)
                redistributed[e.index] = str(tuple(g.placements))
                grads[e.index] = g
                continue
        expected = local_shapes.get(e.index)
        if expected is not None:  # _local_tensor: what to_local() returns, without its 2-3 us of checks
            if not same_piece(e.param._local_tensor.shape, expected):
                raise wrong_piece(e, "parameter", e.param)
            if g is not None and not same_piece(g._local_tensor.shape, expected):
                raise wrong_piece(e, "gradient", g)
        grads[e.index] = g
    return grads, redistributed


def check_redistributable(e: Entry, g: DTensor) -> None:
    """A gradient in other placements than its parameter's (tensor parallelism gives ``Partial`` gradients
    for replicated norms and a ``Replicate`` one for a row-sharded embedding) must be one that DTensor can
    redistribute, and its local piece must have the shape its own placements give this rank."""
    try:
        box = read_layout(e.name, g, partial_as_replicate=True).local_box
    except ValueError as exc:
        raise PreflightError(e, f"gradient placements {tuple(g.placements)}: {exc}") from None
    if g._local_tensor.shape != torch.Size(box_shape(box)):
        raise PreflightError(
            e,
            f"this rank's local piece of the gradient has shape {tuple(g._local_tensor.shape)}; its placements "
            f"{tuple(g.placements)} give it the box {box}, shape {box_shape(box)}",
        )


def same_piece(shape: torch.Size, expected: torch.Size) -> bool:
    """A local piece has the expected shape; every empty piece is a valid empty piece (FSDP2 gives the empty
    piece of an N×0 parameter the shape (0, 0))."""
    return shape == expected or (shape.numel() == 0 and expected.numel() == 0)


def wrong_piece(e: Entry, what: str, t: DTensor) -> PreflightError:
    return PreflightError(
        e,
        f"this rank's local piece of the {what} has shape {tuple(t.to_local().shape)}; the layout (global shape "
        f"{tuple(e.param.shape)}, placements {tuple(e.param.placements)}) gives mesh rank {e.layout.mesh_rank} "
        f"the box {e.layout.local_box}, shape {box_shape(e.layout.local_box)}",
    )
