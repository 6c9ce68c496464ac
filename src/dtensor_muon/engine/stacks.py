"""Stacks: several same-size units of one shape computed in one Newton–Schulz call.

A unit (the plan's batch of at most ``MAX_BATCH`` same-shape matrices of one parameter) is what every world size
computes alike, so its bits never depend on how the matrices were spread over ranks. A rank that holds several
units of one shape may still run them as one call: the stack ``[k·B, m, n]`` of k units of B matrices, with the
dispatch deciding as for B (:func:`dtensor_muon.kernels.shapes.decide_as_batch`) and kernels that compute each
matrix of a batch alike whatever the batch count, gives every matrix the bits of its unit alone, in fewer and
larger launches (docs/kernels.md "Expert stacks"). Units stack when

    the rule allows it for the unit (``MatrixRule.stacks_units``: Muon's and NorMuon's on the GPU backend),
    they hold the same number B of matrices of one shape, of one param group (the same settings, γ'),
    stacks pay for them (``stacking_pays``: B ≥ 2, short sides up to ``STACK_MAX_SIDE``), and
    at most ``units_per_stack(device)`` of them share a call (:mod:`dtensor_muon.kernels.batching`, whose
    ``group_into_stacks`` forms them in order).

One matrix alone never joins a stack: a matrix and a batch of one may take different kernels. The rule's answer
is asked once per step for each (param group, shape, unit size, device): a strategy asks for every unit of the
step before its first stack computes, and a step can hold hundreds of units of one shape (Qwen3-30B-A3B's
experts), while the answer on CUDA is a dispatch decision made on a stand-in tensor.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ..kernels.batching import stacking_pays
from ..plan import MatrixSpec
from .context import StepContext


def stack_key(ctx: StepContext, specs: Sequence[MatrixSpec]) -> Hashable | None:
    """What units must share to stack (see the module docstring), None for a unit that computes alone."""
    first = specs[0]
    if first.parts > 1 or not stacking_pays(len(specs), first.shape):
        return None
    e = ctx.entries[first.param_index]
    key = (id(e.group), first.shape, len(specs), e.param.device)
    allowed = ctx.stacking_allowed.get(key)
    if allowed is None:
        allowed = ctx.stacking_allowed[key] = ctx.rule.stacks_units(e.group, first.shape, len(specs), e.param.device)
    return key if allowed else None
