"""Storage layouts: which global index box of a parameter each rank of its mesh holds.

A box is one half-open range ``(start, stop)`` per tensor dimension. For a DTensor with placements
``p₀ … p_{k-1}`` over a mesh of shape ``(n₀ … n_{k-1})``, the rank at mesh coordinate ``(c₀ … c_{k-1})``
holds the box obtained by starting from the whole tensor and, for each mesh dim i with ``Shard(d)``,
keeping chunk cᵢ of the current range of dim d, chunked like ``torch.chunk``: chunk size
``s = ⌈L / nᵢ⌉``, chunk c = ``[min(c·s, L), min((c+1)·s, L))`` (so trailing chunks may be empty).
``Replicate`` keeps the range. Ranks are numbered by their flat index in ``mesh.mesh`` ("mesh rank").
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from math import prod

from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec

Range = tuple[int, int]
Box = tuple[Range, ...]


@dataclass(frozen=True)
class ParamLayout:
    """Where the pieces of one parameter live: ``boxes[r]`` is the global box held by mesh rank r."""

    name: str
    global_shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    mesh_rank: int

    @property
    def world_size(self) -> int:
        return len(self.boxes)

    @property
    def local_box(self) -> Box:
        return self.boxes[self.mesh_rank]


def box_numel(box: Box) -> int:
    """Number of elements in a box."""
    return prod(max(0, stop - start) for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    """The tensor shape of a box."""
    return tuple(stop - start for start, stop in box)


def box_slices(box: Box) -> tuple[slice, ...]:
    """Slices selecting a global ``box`` inside the whole tensor."""
    return tuple(slice(start, stop) for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they share no element."""
    out = tuple((max(sa, sb), min(ea, eb)) for (sa, ea), (sb, eb) in zip(a, b))
    return out if all(start < stop for start, stop in out) else None


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices selecting ``inner`` inside a tensor that holds exactly ``outer``."""
    return tuple(slice(si - so, ei - so) for (si, ei), (so, _) in zip(inner, outer))


def chunk_range(start: int, stop: int, num_chunks: int, index: int) -> Range:
    """Chunk ``index`` of ``num_chunks`` of ``[start, stop)``, as ``torch.chunk`` splits it."""
    length = stop - start
    size = -(-length // num_chunks) if length > 0 else 0
    lo = min(index * size, length)
    hi = min((index + 1) * size, length)
    return (start + lo, start + hi)


def _check_placements(name: str, tensor: DTensor) -> None:
    spec: DTensorSpec = tensor._spec
    for placement in tensor.placements:
        if type(placement) not in (Shard, Replicate):
            raise ValueError(
                f"parameter {name!r}: placement {placement} is not supported (supported: Shard(d), "
                "Replicate(); tensor-parallel _StridedShard and Partial are not)"
            )
    shard_order = getattr(spec, "shard_order", None)
    if shard_order is not None and not DTensorSpec.is_default_device_order(shard_order):
        raise ValueError(f"parameter {name!r}: a non-default shard order {shard_order} is not supported")


def read_layout(name: str, tensor: Tensor) -> ParamLayout:
    """The layout of ``tensor``: a plain tensor is one whole box on a world of one."""
    full: Box = tuple((0, size) for size in tensor.shape)
    if not isinstance(tensor, DTensor):
        return ParamLayout(name, tuple(tensor.shape), (full,), 0)
    _check_placements(name, tensor)
    mesh = tensor.device_mesh
    mesh_shape = tuple(mesh.mesh.shape)
    boxes: list[Box] = []
    for coordinate in product(*(range(n) for n in mesh_shape)):
        box = list(full)
        for mesh_dim, placement in enumerate(tensor.placements):
            if isinstance(placement, Shard):
                dim = placement.dim % tensor.ndim
                box[dim] = chunk_range(*box[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        boxes.append(tuple(box))
    my_coordinate = mesh.get_coordinate()
    if my_coordinate is None:
        raise ValueError(f"parameter {name!r}: this rank is not in its device mesh")
    mesh_rank = 0
    for c, n in zip(my_coordinate, mesh_shape):
        mesh_rank = mesh_rank * n + c
    return ParamLayout(name, tuple(tensor.shape), tuple(boxes), mesh_rank)
