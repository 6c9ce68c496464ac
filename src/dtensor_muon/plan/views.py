"""Matrices of a parameter: what a matrix rule orthogonalizes, by shape rules and explicit split metadata.

A parameter of shape ``S`` is cut into matrices as follows:

- 2-D ``[m, n]``: one matrix;
- 3-D ``[E, m, n]`` (stacked MoE experts): E matrices ``[m, n]``, one per expert;
- ≥4-D ``[a, b, c, …]`` (e.g. a convolution): one matrix viewed as ``(a, b·c·…)``;
- with a :class:`MatrixSplit`, each of those matrices is cut further along one dimension of the parameter:
  by explicit ``sizes`` (fused QKV ``sizes=(q, k, v)``, SwiGLU w13 ``sizes=(hidden, hidden)``) or into equal
  ``block``-sized pieces (per-head matrices). Never guessed from shapes;
- with ``groups=G`` as well, the ``sizes`` pattern repeats G times along the matrix's rows, and matrix j is
  the rows of part j of every repetition, in order: for rows laid out as
  ``[q₀ k₀ v₀ q₁ k₁ v₁ …]`` (torchtitan 0.3's interleaved ``wqkv``: per KV group its query heads, one key
  head, one value head) the matrices are ``[q₀; q₁; …]``, ``[k₀; k₁; …]``, ``[v₀; v₁; …]``: exactly the
  separate ``wq``, ``wk``, ``wv``. :meth:`MatrixSplit.grouped_qkv` builds it from head counts.

Each matrix is one box of the parameter (one half-open range per dimension), or for a grouped split G boxes
(its *parts*, same shape ``[r, c]``, whose rows stacked in order give the ``[G·r, c]`` matrix), plus the 2-D
shape it is viewed as, and a key (``"m0"``, ``"m1"``, … in expert-major, split-minor order) that names it
within its parameter: owner state is saved under it, so the key depends only on the shape and the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..distributed.layout import Box, Range


@dataclass(frozen=True)
class MatrixSplit:
    """Cut a parameter into matrices along ``dim``: by ``sizes`` (summing to that dim's length) or into equal
    blocks of ``block`` (which must divide it). Exactly one of ``sizes`` and ``block`` is given.

    ``groups`` (with ``sizes``): the dim holds ``groups`` repetitions of the ``sizes`` pattern, so its length
    is ``groups·Σsizes``; matrix j is part j of every repetition, stacked in order along the matrix's rows
    (row g·Σsizes + Σsizes[:j] + i of the parameter is row g·sizes[j] + i of matrix j). ``dim`` must then be
    the matrix's row dim (0 for 2-D and ≥4-D parameters, 1 for 3-D experts).

    ``dim`` counts the parameter's dimensions (negative from the end); for a 3-D expert parameter it must
    be 1 or 2 (a split of each expert's matrix), never the expert dimension 0.
    """

    dim: int
    sizes: tuple[int, ...] | None = None
    block: int | None = None
    groups: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise TypeError(f"MatrixSplit: dim must be an int, got {self.dim!r}")
        if (self.sizes is None) == (self.block is None):
            raise ValueError("MatrixSplit: give exactly one of sizes=(…) and block=…")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups <= 0:
            raise ValueError(f"MatrixSplit: groups must be a positive int, got {self.groups!r}")
        if self.groups > 1 and self.sizes is None:
            raise ValueError("MatrixSplit: groups=… repeats a sizes=(…) pattern; it does not combine with block=…")
        if self.sizes is not None:
            sizes = tuple(self.sizes)
            if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s <= 0 for s in sizes):
                raise ValueError(f"MatrixSplit: sizes must be positive ints, got {self.sizes!r}")
            object.__setattr__(self, "sizes", sizes)
        elif isinstance(self.block, bool) or not isinstance(self.block, int) or self.block <= 0:
            raise ValueError(f"MatrixSplit: block must be a positive int, got {self.block!r}")

    @classmethod
    def grouped_qkv(cls, n_heads: int, n_kv_heads: int, head_dim: int, per: str = "projection") -> MatrixSplit:
        """The split of a fused QKV weight whose rows interleave by KV group (per group: its ``n_heads /
        n_kv_heads`` query heads, one key head, one value head, each ``head_dim`` rows; torchtitan 0.3's
        ``attention.qkv_linear.wqkv.weight``).

        ``per="projection"``: three matrices, W_q (``n_heads·head_dim`` rows), W_k and W_v (``n_kv_heads·head_dim``
        each), each updated exactly as a separate ``wq``/``wk``/``wv`` parameter (``MatrixSplit(0, sizes=(h·d,
        d, d), groups=n_kv_heads)``, h = heads per KV group). ``per="head"``: one matrix per head, ``head_dim`` rows
        each (``MatrixSplit(0, block=head_dim)``), as separate per-head parameters.
        """
        for label, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MatrixSplit.grouped_qkv: {label} must be a positive int, got {value!r}")
        if n_heads % n_kv_heads:
            raise ValueError(f"MatrixSplit.grouped_qkv: n_kv_heads {n_kv_heads} does not divide n_heads {n_heads}")
        if per == "projection":
            return cls(0, sizes=(n_heads // n_kv_heads * head_dim, head_dim, head_dim), groups=n_kv_heads)
        if per == "head":
            return cls(0, block=head_dim)
        raise ValueError(f"MatrixSplit.grouped_qkv: per must be 'projection' or 'head', got {per!r}")

    def ranges(self, name: str, shape: tuple[int, ...]) -> list[Range]:
        """The ranges of dim :meth:`resolved_dim` that the split cuts parameter ``name`` into; for ``groups > 1``
        one per part, repetition-major (the parts of matrix j are entries j, j + len(sizes), …)."""
        dim = self.resolved_dim(name, shape)
        length = shape[dim]
        if self.sizes is not None:
            if self.groups * sum(self.sizes) != length:
                pattern = f"{self.groups} × " if self.groups > 1 else ""
                raise ValueError(
                    f"parameter {name!r}: matrix_split sizes {pattern}{self.sizes} sum to "
                    f"{self.groups * sum(self.sizes)}, but dim {dim} of shape {tuple(shape)} has length {length}"
                )
            sizes = list(self.sizes) * self.groups
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
        if self.groups > 1 and dim != (1 if ndim == 3 else 0):
            raise ValueError(
                f"parameter {name!r}: matrix_split groups={self.groups} joins parts along the matrix's rows; "
                f"split dim {1 if ndim == 3 else 0} of shape {tuple(shape)}, got {self.dim}"
            )
        return dim


@dataclass(frozen=True)
class MatrixView:
    """One matrix of a parameter: ``box`` in the parameter, viewed as ``shape``; ``key`` names it in the parameter.

    For a grouped split (``MatrixSplit(groups=G)``) a view is part ``part`` of ``parts`` = G of one matrix: its
    rows are rows ``part·shape[0]`` … of the ``[parts·shape[0], shape[1]]`` matrix (:attr:`whole_shape`), and
    every part carries the matrix's key."""

    key: str
    box: Box
    shape: tuple[int, int]
    part: int = 0
    parts: int = 1

    @property
    def whole_shape(self) -> tuple[int, int]:
        """The shape of the matrix this view is (one of the parts of): ``(parts·rows, cols)``."""
        return (self.parts * self.shape[0], self.shape[1])


def matrix_shape_of_box(box: Box, ndim: int) -> tuple[int, int]:
    """The 2-D shape a box of an ``ndim``-D parameter is viewed as (see the module rules)."""
    lengths = [stop - start for start, stop in box]
    if ndim == 3:
        return (lengths[1], lengths[2])
    return (lengths[0], prod(lengths[1:]))


def parameter_matrices(name: str, shape: tuple[int, ...], split: MatrixSplit | None = None) -> list[MatrixView]:
    """The matrices of parameter ``name`` of ``shape`` (see the module docstring), in key order; a grouped
    split's parts follow each other, in row order of their matrix."""
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"parameter {name!r}: a matrix rule needs ≥2 dims, got shape {tuple(shape)}")
    if ndim > 3 and split is not None and split.resolved_dim(name, shape) > 1:
        raise ValueError(
            f"parameter {name!r}: a ≥4-D parameter is viewed as (shape[0], -1); split dim 0 or 1, got {split.dim}"
        )
    full: Box = tuple((0, s) for s in shape)
    bases = [((e, e + 1),) + full[1:] for e in range(shape[0])] if ndim == 3 else [full]
    pieces: list[list[Box]] = []  # per matrix, its parts
    for base in bases:
        if split is None:
            pieces.append([base])
            continue
        dim = split.resolved_dim(name, shape)
        ranges = split.ranges(name, shape)
        per_group = len(ranges) // split.groups
        for j in range(per_group):
            parts = ranges[j::per_group]
            pieces.append([base[:dim] + (r,) + base[dim + 1 :] for r in parts])
    return [
        MatrixView(f"m{i}", box, matrix_shape_of_box(box, ndim), part, len(parts))
        for i, parts in enumerate(pieces)
        for part, box in enumerate(parts)
    ]
