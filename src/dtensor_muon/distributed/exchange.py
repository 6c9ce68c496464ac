"""Variable-size all-to-all over a device mesh: the all_gatherv-equivalent that moves matrix pieces.

Each bucket does one ``all_to_all_single`` out (every source rank's pieces to their owners) and one back
(each owner's update pieces to every rank that holds part of the matrix). Split sizes are exact element
counts, so empty shards send nothing and nothing is padded. Buffers are laid out in process-group rank
order; :class:`MeshGroup` maps mesh ranks (flat index in ``mesh.mesh``) to group ranks.

An exchange is packed (its pieces copied into one send buffer, :func:`pack_all_to_all`) and then launched
(:meth:`PackedExchange.start`). Packed to be launched later, on CUDA it records an event after its packing and
is launched from the :data:`~.side_streams.LAUNCHES` side stream after that event: so a step can pack each
return exchange as soon as its directions are computed, agree on the outcome, and only then send, without the
sends waiting for the directions computed in between.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .side_streams import LAUNCHES, beside_queued_work


@dataclass
class MeshGroup:
    """The process group spanning every rank of a mesh, and the mesh-rank ↔ group-rank maps."""

    group: dist.ProcessGroup | None
    mesh_rank: int
    group_rank_of_mesh_rank: list[int]

    @property
    def world_size(self) -> int:
        return len(self.group_rank_of_mesh_rank)

    @property
    def mesh_ranks_in_group_order(self) -> list[int]:
        order = [0] * self.world_size
        for mesh_rank, group_rank in enumerate(self.group_rank_of_mesh_rank):
            order[group_rank] = mesh_rank
        return order


# Cached per mesh object (by identity: DeviceMesh compares by value, so a mesh over another process group, e.g.
# one made after the first one's group was destroyed, would otherwise be handed the first one's group) and
# dropped with it: a module-level cache holding meshes would keep process groups alive past
# destroy_process_group(), to be destroyed during interpreter shutdown, which can abort gloo.
_GROUP_CACHE: dict[int, tuple[weakref.ref[DeviceMesh], MeshGroup]] = {}


def mesh_group(mesh: DeviceMesh | None, mesh_rank: int) -> MeshGroup:
    """The group of all ranks of ``mesh`` (flattened when it has several dims); None mesh: a world of one."""
    if mesh is None:
        return MeshGroup(None, 0, [0])
    key = id(mesh)
    cached = _GROUP_CACHE.get(key)
    if cached is not None and cached[0]() is mesh:
        return cached[1]
    flat = mesh if mesh.ndim == 1 else mesh._flatten()
    group = flat.get_group()
    global_ranks = mesh.mesh.flatten().tolist()
    entry = MeshGroup(group, mesh_rank, [dist.get_group_rank(group, r) for r in global_ranks])
    _GROUP_CACHE[key] = (weakref.ref(mesh, lambda _ref, key=key: _forget(key, _ref)), entry)
    return entry


def _forget(key: int, ref: weakref.ref) -> None:
    """Drop a dead mesh's entry (unless a newer mesh with the same ``id`` has replaced it)."""
    cached = _GROUP_CACHE.get(key)
    if cached is not None and cached[0] is ref:
        del _GROUP_CACHE[key]


@dataclass
class PendingExchange:
    """An all-to-all in flight: ``wait()`` returns the receive buffer split per source mesh rank."""

    received: Tensor
    recv_counts: list[int]
    handle: dist.Work | None
    mesh_ranks_in_group_order: list[int]

    def wait(self) -> dict[int, Tensor]:
        if self.handle is not None:
            self.handle.wait()
            if self.received.is_cuda:  # allocated where it was launched, maybe a side stream: read on this one
                self.received.record_stream(torch.cuda.current_stream(self.received.device))
        chunks = torch.split(self.received, self.recv_counts)
        return dict(zip(self.mesh_ranks_in_group_order, chunks))


@dataclass
class PackedExchange:
    """An all-to-all whose send buffer is packed, not yet launched: :meth:`start` launches it (once).

    ``packed``: on CUDA, for an exchange packed to be launched later, the event recorded on the packing stream
    once ``send`` is written; the launch then follows that event only (:mod:`.side_streams`), and the receive
    buffer is allocated on the launching stream. None: launched from the current stream."""

    group: MeshGroup
    send: Tensor
    send_counts: list[int]
    recv_counts: list[int]
    packed: torch.cuda.Event | None = None

    def start(self) -> PendingExchange:
        """Launch the exchange; the returned :class:`PendingExchange` waits for it."""
        if self.group.group is None:  # a group of one: what it sends is what it receives, already a copy of its pieces
            return PendingExchange(self.send, self.recv_counts, None, self.group.mesh_ranks_in_group_order)
        if self.packed is None:
            return self._launch()
        with beside_queued_work(self.send.device, LAUNCHES, after=self.packed):
            # the send buffer's block returns to the packing stream's pool: not before this stream has sent it
            self.send.record_stream(torch.cuda.current_stream(self.send.device))
            return self._launch()

    def _launch(self) -> PendingExchange:
        """The all-to-all from the current stream, into a receive buffer allocated on it."""
        received = torch.empty(sum(self.recv_counts), dtype=self.send.dtype, device=self.send.device)
        handle = dist.all_to_all_single(
            received, self.send, self.recv_counts, self.send_counts, group=self.group.group, async_op=True
        )
        return PendingExchange(received, self.recv_counts, handle, self.group.mesh_ranks_in_group_order)


def pack_all_to_all(
    mesh_group_: MeshGroup,
    send_chunks: dict[int, list[Tensor]],
    recv_counts: dict[int, int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    launched_later: bool = False,
) -> PackedExchange:
    """Pack one variable-size all-to-all: ``send_chunks[mesh_rank]`` (flattened pieces) go to that rank;
    ``recv_counts[mesh_rank]`` elements come from it. The send buffer is a copy: the pieces may be overwritten
    once this returns. ``launched_later``: on CUDA, record the packing event so that :meth:`PackedExchange.start`
    follows it alone."""
    order = mesh_group_.mesh_ranks_in_group_order
    send_parts: list[Tensor] = []
    send_counts: list[int] = []
    for rank in order:
        parts = send_chunks.get(rank, [])
        send_parts.extend(p.reshape(-1) for p in parts)
        send_counts.append(sum(p.numel() for p in parts))
    counts_in = [recv_counts.get(rank, 0) for rank in order]
    # one concatenation, then one cast to the wire dtype (not one cast per piece)
    send = torch.cat(send_parts).to(dtype) if send_parts else torch.empty(0, dtype=dtype, device=device)
    packed = None
    if launched_later and send.is_cuda and mesh_group_.group is not None:
        packed = torch.cuda.Event()
        packed.record(torch.cuda.current_stream(send.device))
    return PackedExchange(mesh_group_, send, send_counts, counts_in, packed)
