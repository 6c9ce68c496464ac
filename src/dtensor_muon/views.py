"""Matrices of a parameter: what a matrix rule orthogonalizes, by shape rules and explicit split metadata.

A parameter of shape ``S`` is cut into matrices as follows:

- 2-D ``[m, n]``: one matrix;
- 3-D ``[E, m, n]`` (stacked MoE experts): E matrices ``[m, n]``, one per expert;
- ≥4-D ``[a, b, c, …]`` (e.g. a convolution): one matrix viewed as ``(a, b·c·…)``;
- with a :class:`MatrixSplit`, each of those matrices is cut further along one dimension of the parameter:
  by explicit ``sizes`` (fused QKV ``sizes=(q, k, v)``, SwiGLU w13 ``sizes=(hidden, hidden)``) or into equal
  ``block``-sized pieces (per-head matrices). Never guessed from shapes.

Each matrix is a box of the parameter (one half-open range per dimension) plus the 2-D shape it is viewed
as, and a key (``"m0"``, ``"m1"``, … in expert-major, split-minor order) that names it within its
parameter: owner state is saved under it, so the key depends only on the shape and the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from .layout import Box, Range


@dataclass(frozen=True)
class MatrixSplit:
    """Cut a parameter into matrices along ``dim``: by ``sizes`` (summing to that dim's length) or into equal
    blocks of ``block`` (which must divide it). Exactly one of ``sizes`` and ``block`` is given.

    ``dim`` counts the parameter's dimensions (negative from the end); for a 3-D expert parameter it must
    be 1 or 2 (a split of each expert's matrix), never the expert dimension 0.
    """

    dim: int
    sizes: tuple[int, ...] | None = None
    block: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"MatrixSplit: dim must be an int, got {self.dim!r}")
        if (self.sizes is None) == (self.block is None):
            raise ValueError("MatrixSplit: give exactly one of sizes=(…) and block=…")
        if self.sizes is not None:
            sizes = tuple(self.sizes)
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
                raise ValueError(f"MatrixSplit: sizes must be positive ints, got {self.sizes!r}")
            object.__setattr__(self, "sizes", sizes)
        elif isinstance(self.block, bool) or not isinstance(self.block, int) or self.block <= 0:
            raise ValueError(f"MatrixSplit: block must be a positive int, got {self.block!r}")

    def ranges(self, name: str, shape: tuple[int, ...]) -> list[Range]:
        """The ranges of dim :meth:`resolved_dim` that the split cuts parameter ``name`` into."""
        dim = self.resolved_dim(name, shape)
        length = shape[dim]
        if self.sizes is not None:
            if sum(self.sizes) != length:
                raise ValueError(
                    f"parameter {name!r}: matrix_split sizes {self.sizes} sum to {sum(self.sizes)}, but dim {dim} "
                    f"of shape {tuple(shape)} has length {length}"
                )
            sizes = list(self.sizes)
        else:
            assert self.block is not None
            if length % self.block:
                raise ValueError(
                    f"parameter {name!r}: matrix_split block {self.block} does not divide dim {dim} of shape "
                    f"{tuple(shape)} (length {length})"
                )
            sizes = [self.block] * (length // self.block)
        out, start = [], 0
        for size in sizes:
            out.append((start, start + size))
            start += size
        return out

    def resolved_dim(self, name: str, shape: tuple[int, ...]) -> int:
        """``dim`` as a non-negative index of ``shape``; raises ValueError naming the parameter when invalid."""
        ndim = len(shape)
        if not -ndim <= self.dim < ndim:
            raise ValueError(f"parameter {name!r}: matrix_split dim {self.dim} is out of range for shape {shape}")
        dim = self.dim % ndim
        if ndim == 3 and dim == 0:
            raise ValueError(
                f"parameter {name!r}: matrix_split dim 0 is the expert dimension of a 3-D parameter; split dim 1 or 2"
            )
        return dim


@dataclass(frozen=True)
class MatrixView:
    """One matrix of a parameter: ``box`` in the parameter, viewed as ``shape``; ``key`` names it in the parameter."""

    key: str
    box: Box
    shape: tuple[int, int]


def matrix_shape_of_box(box: Box, ndim: int) -> tuple[int, int]:
    """The 2-D shape a box of an ``ndim``-D parameter is viewed as (see the module rules)."""
    lengths = [stop - start for start, stop in box]
    if ndim == 3:
        return (lengths[1], lengths[2])
    return (lengths[0], prod(lengths[1:]))


def parameter_matrices(name: str, shape: tuple[int, ...], split: MatrixSplit | None = None) -> list[MatrixView]:
    """The matrices of parameter ``name`` of ``shape`` (see the module docstring), in key order."""
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"parameter {name!r}: a matrix rule needs ≥2 dims, got shape {tuple(shape)}")
    if ndim > 3 and split is not None and split.resolved_dim(name, shape) > 1:
        raise ValueError(
            f"parameter {name!r}: a ≥4-D parameter is viewed as (shape[0], -1); split dim 0 or 1, got {split.dim}"
        )
    full: Box = tuple((0, s) for s in shape)
    bases = [((e, e + 1),) + full[1:] for e in range(shape[0])] if ndim == 3 else [full]
    pieces: list[Box] = []
    for base in bases:
        if split is None:
            pieces.append(base)
            continue
        dim = split.resolved_dim(name, shape)
        for r in split.ranges(name, shape):
            pieces.append(base[:dim] + (r,) + base[dim + 1 :])
    return [MatrixView(f"m{i}", box, matrix_shape_of_box(box, ndim)) for i, box in enumerate(pieces)]
