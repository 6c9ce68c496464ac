"""Which matrices the direction step stacks into one batched call: only small ones, where batching pays.

A batch of small matrices shares its launches, which bound each matrix's Newton–Schulz; a large matrix keeps
the GPU busy alone, and stacking it gains nothing. Stack a shape only when it has at most
:data:`BATCH_MAX_NUMEL` elements, and at most :data:`MAX_BATCH` matrices in one batch (a unit of the plan).
Chosen by measurement: docs/kernels.md "Batching small matrices" (re-measure: tools/kernels/ns_variants.py).

Beyond units, the engine may compute several same-size units of one shape in one call, a *stack*
(:mod:`dtensor_muon.engine.stacks`): up to :func:`units_per_stack` units where :func:`stacking_pays`,
the dispatch deciding as for one unit (:func:`.shapes.decide_as_batch`), so that each matrix keeps the bits of its
unit alone.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TypeVar

import torch

BATCH_MAX_NUMEL = 2048 * 7168
"""Largest matrix (elements) that is stacked with others of its shape (Kimi K2's 2048×7168 experts)."""

MAX_BATCH = 8
"""Most matrices in one batch (a unit of the plan): the gain per matrix flattens there, and smaller units balance
better across ranks (docs/kernels.md "Batching small matrices"). The busiest rank's planned Newton–Schulz FLOPs
over the mean, at 8 / 64 / 256 ranks with these units: Qwen3-30B-A3B 1.000 / 1.000 / 1.029 under FSDP and
1.000 / 1.004 / 1.034 with EP 8; DeepSeek-V3-16B 1.000 / 1.017 / 1.136 and 1.000 / 1.019 / 1.146 (re-measure:
``python -m dtensor_muon.plan --model qwen3:30B-A3B --world-size 8 64 256 [--ep 8]``)."""

MAX_STACK = 16
"""Most units in one stack on a CUDA device (1: each unit is its own call), for the shapes where
:func:`stacking_pays`. Measured on one H200 (docs/kernels.md "Expert stacks"): Qwen3-30B-A3B's step, 8 layers,
199.7 ms as units of 8 experts, 195.0 ms in stacks of up to 16 units, 164.0 ms with those stacks on the SYRK
kernels (:mod:`.triton_matmuls`, 768-wide units of 8); 4 units per stack gained less (196.9 ms). A stack only
groups units that one owner already computes, so the plan and its balance (:data:`MAX_BATCH`) do not change.
Never on CPU, where a batched matmul's bits may depend on its batch count."""

STACK_MAX_SIDE = 1024
"""Largest short side of a matrix whose units stack: 768-wide experts gain (above), DeepSeek-V3-16B's 1408×2048
ones did not (its step 351.5 ms as units, 347.9 ms in stacks of 8; its busiest rank at 64 ranks 6.55 ms as
units, 6.94 ms stacked)."""

GATHER_MAX_UNITS = 4
"""A holder's local units of a parameter that holds at most this many stackable units on the rank stack with the
units of other parameters (:func:`holder_stack_keys`): their views are copied into one input, and each unit's O
goes back to its own parameter. Longer runs stay in their own view of the shard, uncopied (4 units of 8 already
make a stack of 32 matrices). Qwen3-30B-A3B's experts at 8 FSDP ranks, or at EP 8, are 2 units of 8 per parameter
per rank: stacked per parameter, the busiest of 8 ranks made 29 calls and its share took 20.6–20.9 ms; gathered,
8 calls and 18.4–18.7 ms on one H200, the copy (about 1.5 µs a 768×2048 bf16 matrix) included (BENCHMARKS.md
"Expert stacks")."""

_forced_stack: list[int] = []

U = TypeVar("U")


def batching_pays(shape: tuple[int, int]) -> bool:
    """Whether matrices of ``shape`` are computed in batches (see the module docstring)."""
    return shape[0] * shape[1] <= BATCH_MAX_NUMEL


def stacking_pays(matrices: int, shape: tuple[int, int]) -> bool:
    """Whether units of ``matrices`` matrices of ``shape`` stack: at least 2 matrices (a matrix alone and a batch
    of one may take different kernels) with a short side of at most :data:`STACK_MAX_SIDE`."""
    return matrices >= 2 and min(shape) <= STACK_MAX_SIDE


def units_per_stack(device: torch.device) -> int:
    """Most units the engine stacks into one call on ``device``: the innermost :func:`stack_units`'s count,
    else :data:`MAX_STACK` on CUDA and 1 elsewhere."""
    if _forced_stack:
        return _forced_stack[-1]
    return MAX_STACK if device.type == "cuda" else 1


@contextlib.contextmanager
def stack_units(count: int) -> Iterator[None]:
    """Within the block the engine stacks up to ``count`` units into one call on every device (tests on CPU,
    benchmarks); 1 turns stacks off."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"stack_units: count must be an int >= 1, got {count!r}")
    _forced_stack.append(count)
    try:
        yield
    finally:
        _forced_stack.pop()


def group_into_stacks(
    units: Sequence[U],
    key: Callable[[U], Hashable | None],
    limit: int,
    joins: Callable[[list[U], U], bool] | None = None,
) -> list[list[U]]:
    """``units`` in stacks of at most ``limit`` units of one ``key`` (None: the unit stays alone), each stack in
    the order of its units, stacks in the order of their first unit. ``joins(stack, unit)``, when given, must also
    hold for a unit to join a stack; a unit that joins no open stack of its key opens a new one."""
    if limit <= 1:
        return [[unit] for unit in units]
    stacks: list[list[U]] = []
    open_stack: dict[Hashable, list[U]] = {}
    for unit in units:
        k = key(unit)
        current = open_stack.get(k) if k is not None else None
        if current is not None and len(current) < limit and (joins is None or joins(current, unit)):
            current.append(unit)
            continue
        stacks.append([unit])
        if k is not None:
            open_stack[k] = stacks[-1]
    return stacks


def holder_stack_keys(params: Sequence[Hashable], keys: Sequence[Hashable | None]) -> list[Hashable | None]:
    """The keys a holder's local units stack by, in their order: ``keys[i]`` the stack key of unit i (None: it
    computes alone), ``params[i]`` its parameter. A unit of a parameter with at most :data:`GATHER_MAX_UNITS`
    units of non-None key here keeps its key, so that it stacks with other parameters' units (its view is copied);
    a unit of a longer run gets ``(key, parameter)``, so that it stacks only within its parameter."""
    stackable = Counter(p for p, k in zip(params, keys) if k is not None)
    return [None if k is None else k if stackable[p] <= GATHER_MAX_UNITS else (k, p) for p, k in zip(params, keys)]
