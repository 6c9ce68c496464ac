"""Before any data moves: the local checks of a step, then the one flag all-reduce that tells every rank.

:func:`check_gradients` checks every gradient against its parameter without a collective; anything wrong
raises :class:`PreflightError` on the rank that found it. :func:`agree` then runs one small all-reduce per
mesh (:class:`ConsensusGroup`) that carries which parameters have gradients, non-finite gradients, a failed
check, and whether the ranks' gradient placements and hyperparameters agree, so that every other rank raises
too, naming the parameter and that rank, before any data moves.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..distributed import consensus
from ..distributed.exchange import MeshGroup
from ..distributed.layout import box_shape, local, read_layout
from ..distributed.side_streams import CONSENSUS, beside_queued_work
from .context import Entry


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
            if g.device != e.param.device:  # a DTensor's device is its local piece's
                raise PreflightError(e, f"gradient device {g.device} != parameter device {e.param.device}")
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


class ConsensusGroup:
    """The DTensor parameters (matrix-rule and AdamW) of one mesh with more than one rank, and its group."""

    def __init__(self, entries: list[Entry], comm: MeshGroup) -> None:
        self.entries = entries
        self.comm = comm


def groups_of(entries: list[Entry]) -> list[dict[str, Any]]:
    """The param groups of ``entries``, in order of first appearance."""
    return list({id(e.group): e.group for e in entries}.values())


def agree(
    groups: list[ConsensusGroup],
    entries: list[Entry],
    grads: dict[int, Tensor | None],
    failure: PreflightError | None,
    redistributed: dict[int, str],
    skip_nonfinite: bool,
) -> tuple[set[int], bool, tuple[int, int] | None]:
    """Which parameters got a gradient on any rank, whether any rank saw inf/NaN, and which parameter
    (index, global rank) failed the local checks on some rank (None when none did).

    One small all-reduce (MAX) per mesh of [has-grad flags…, s, −s, h, −h, mismatch flags ×2, non-finite
    flag, failure code], meshes in increasing size so the last (largest) carries every flag to every rank;
    s digests which gradients this rank redistributes from which placements, and max(s) ≠ min(s) means the
    ranks differ (they would run different collectives): every rank then raises instead. h digests the
    mesh's param groups' current hyperparameters (:func:`consensus.describe_groups`: a scheduler may have
    changed ``lr`` on one rank only); when they differ every rank raises naming the option and its values.
    The failure code is
    ``(index + 1)·2³² + global rank`` of a failing rank's parameter (0: none), so every rank can name it.
    A rank whose local checks failed still joins, so the others learn of it instead of waiting in the
    exchange.
    """
    nonfinite = False
    if skip_nonfinite and failure is None:
        local_grads = [local(g) for g in grads.values() if g is not None]
        if local_grads:
            finite = torch.stack([torch.isfinite(g).all() for g in local_grads]).all()
            nonfinite = not bool(finite)
    code = 0
    if failure is not None:
        code = ((failure.index + 1) << 32) + (dist.get_rank() if dist.is_initialized() else 0)
    active = {i for i, g in grads.items() if g is not None}
    mismatch = hyper_mismatch = 0
    for group in groups:
        members = group.entries
        signature = redistribution_signature(members, redistributed) if failure is None else 0
        hyper = consensus.digest(consensus.describe_groups(groups_of(members)))
        flags = torch.tensor(
            [int(e.index in active) for e in members]
            + [signature, -signature, hyper, -hyper, mismatch, hyper_mismatch, int(nonfinite), code],
            dtype=torch.int64,
        )
        device = local(members[0].param).device
        with beside_queued_work(device, CONSENSUS):  # host values: no wait for the kernels queued on the device
            flags = flags.to(device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.comm.group)
            flags = flags.cpu()
        for e, flag in zip(members, flags[:-8].tolist()):
            if flag:
                active.add(e.index)
        highest, negated_lowest, hyper_highest, hyper_negated_lowest = (int(x) for x in flags[-8:-4])
        mismatch = int(bool(flags[-4]) or highest != -negated_lowest)
        hyper_mismatch = int(bool(flags[-3]) or hyper_highest != -hyper_negated_lowest)
        nonfinite, code = bool(flags[-2]), int(flags[-1])
    failed = ((code >> 32) - 1, code & 0xFFFFFFFF) if code else None
    if hyper_mismatch and failed is None:
        group = groups[-1]
        consensus.raise_difference(
            consensus.describe_groups(groups_of(entries)),
            group.comm.group,
            "the param groups' hyperparameters differ across ranks at this step",
        )
    if mismatch and failed is None:
        mine = [entries[i].name for i in redistributed]
        raise RuntimeError(
            "gradient placements differ across ranks: every rank must give a parameter's gradient the same "
            f"placements (this rank's gradients in other placements than their parameter's: "
            f"{', '.join(repr(n) for n in mine[:3]) or 'none'}{', …' if len(mine) > 3 else ''}); no rank "
            "changed anything"
        )
    return active, nonfinite, failed


def redistribution_signature(entries: list[Entry], redistributed: dict[int, str]) -> int:
    """A 62-bit digest of which of ``entries`` have gradients to redistribute, and from which placements
    (0: none); the consensus compares its maximum and minimum across ranks."""
    items = [(e.index, redistributed[e.index]) for e in entries if e.index in redistributed]
    if not items:
        return 0
    return int(hashlib.sha256(repr(items).encode()).hexdigest()[:15], 16) + 1
