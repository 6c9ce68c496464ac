"""Compute placements: where the expensive, whole-matrix part of a rule runs for one unit of matrices.

The plan gives every unit (one matrix, or a fixed group of same-shape matrices computed as one batch) a
placement; one strategy module in :mod:`dtensor_muon.engine.strategies` carries out each kind.

- :class:`Local`: every rank that holds any part of the unit holds all of it whole, and computes it itself
  (no communication; whole-expert shards, plain tensors).
- :class:`Owned`: the unit is gathered whole to one owner rank, computed there once, and its pieces are sent
  back (the all_gatherv-equivalent); exact.
- :class:`GatherAll`: every rank of the mesh gathers the whole parameter and computes the unit (the baseline
  other libraries use; exact, duplicated work).
- :class:`TensorParallelGroup`: one tensor-parallel group (the TP ranks at one data-parallel coordinate,
  chosen by the plan) computes the unit: each member gathers the whole matrix and runs the rule on it
  (``distributed=False``, Megatron's "duplicated"; exact), or its own TP block of it, the members running
  Newton–Schulz together through all-reduced Gram matrices (``distributed=True``). Either way each member
  sends the holders of its TP block their pieces back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Local:
    """Computed by each holder from its own whole copy."""


@dataclass(frozen=True)
class Owned:
    """Computed once on mesh rank ``rank``."""

    rank: int


@dataclass(frozen=True)
class GatherAll:
    """Computed on every rank of the mesh from gathered whole parameters."""


@dataclass(frozen=True)
class TensorParallelGroup:
    """Computed by the mesh ranks ``ranks`` (one TP group, in TP-coordinate order) together; ``dim``: the
    parameter dim that TP splits."""

    ranks: tuple[int, ...]
    distributed: bool
    dim: int


Placement = Local | Owned | GatherAll | TensorParallelGroup
