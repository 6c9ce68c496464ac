"""Shape helpers shared by the Newton–Schulz backends (no Triton needed), and the batch count their decisions
use.

The dispatch (backend, Gram form, SYRK kernel) counts a call's matrices in its work floors. Within
:func:`decide_as_batch` it counts a fixed number instead, whatever the call holds: a stack of several units of
one shape then takes the kernels that each unit alone would take, and since those kernels compute every matrix
of a batch the same way whatever the batch count, each matrix gets the bits it gets in its unit alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor

_decision_batch: list[int] = []


def matrix_count(x: Tensor) -> int:
    """Matrices in ``x``: B for a batch [B, m, n], 1 for a matrix [m, n]."""
    return x.size(0) if x.ndim == 3 else 1


def gram_work(x: Tensor) -> int:
    """B·m²·n multiply-adds of one Gram matrix of ``x`` ([m, n] or [B, m, n])."""
    return matrix_count(x) * x.size(-2) ** 2 * x.size(-1)


def decision_count(x: Tensor) -> int:
    """The matrix count the dispatch's work floors use for ``x``: the innermost :func:`decide_as_batch`'s, else
    ``x``'s own (:func:`matrix_count`)."""
    return _decision_batch[-1] if _decision_batch else matrix_count(x)


def decision_work(x: Tensor) -> int:
    """:func:`gram_work` with :func:`decision_count` matrices: C·m²·n."""
    return decision_count(x) * x.size(-2) ** 2 * x.size(-1)


def decision_batch() -> int | None:
    """The innermost :func:`decide_as_batch`'s count, None outside any."""
    return _decision_batch[-1] if _decision_batch else None


@contextlib.contextmanager
def decide_as_batch(count: int) -> Iterator[None]:
    """Within the block the dispatch decides every call as if it held ``count`` matrices (see the module
    docstring)."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"decide_as_batch: count must be an int >= 1, got {count!r}")
    _decision_batch.append(count)
    try:
        yield
    finally:
        _decision_batch.pop()
