"""What every rank of a mesh must agree on, and how a difference is named.

Ranks that build an optimizer with different options, parameters or hyperparameters would run different
collectives (a gloo size mismatch, a hang) or silently diverge. So the engine compares, on each mesh of more
than one rank:

- at construction, a digest of :func:`describe_engine` (every engine option, every parameter's name, shape,
  dtype, placements and rule, every param group's hyperparameters), in :func:`check_same_everywhere`;
- at every step, a digest of :func:`describe_groups` (the groups' current hyperparameters: a learning-rate
  scheduler changes ``lr`` between steps), carried by the step's consensus all-reduce as max and −min.

Only when digests differ do the ranks exchange the descriptions themselves (``all_gather_object``), so that
every rank raises the same :class:`OptionMismatchError` naming the first differing option and its values.

The flags of a step's consensus are host values (which gradients exist, digests, whether a direction raised),
so on CUDA their all-reduce and its read run on a side stream (:func:`.side_streams.beside_queued_work`): the
host then waits for the ranks and for the group's earlier collectives, not for the kernels already queued on
the device, and goes on queueing the rest of the step while they run.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .side_streams import CONSENSUS, beside_queued_work

Description = list[tuple[str, Any]]
"""(option path, normalized value) pairs, in an order every rank builds alike."""

GROUP_KEYS_SKIPPED = ("params", "param_names")


class OptionMismatchError(RuntimeError):
    """Ranks of one mesh were given different options, parameters or hyperparameters (raised on every rank)."""


def normalized(value: Any, *, tensor_values: bool) -> Any:
    """A value as a plain, comparable structure that prints the same on every rank (no object addresses).

    Tensors compare by shape and dtype, and by value too when ``tensor_values`` (reading a CUDA tensor's
    value waits for the device: done at construction only)."""
    if isinstance(value, Tensor):
        data = value.detach().cpu().flatten().tolist() if tensor_values and value.numel() <= 16 else None
        return ("tensor", tuple(value.shape), str(value.dtype), data)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, (tuple, list)):
        return tuple(normalized(v, tensor_values=tensor_values) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), normalized(v, tensor_values=tensor_values)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, normalized(dataclasses.asdict(value), tensor_values=tensor_values))
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return type(value).__qualname__


def describe_groups(groups: Iterable[dict[str, Any]], *, tensor_values: bool = False) -> Description:
    """Every hyperparameter of ``groups`` as ``("param group k: key", value)``."""
    out: Description = []
    for k, group in enumerate(groups):
        for key in sorted(group):
            if key not in GROUP_KEYS_SKIPPED:
                out.append((f"param group {k}: {key}", normalized(group[key], tensor_values=tensor_values)))
    return out


def describe_engine(
    options: dict[str, Any], params: Iterable[tuple[str, Tensor, bool]], groups: Iterable[dict[str, Any]]
) -> Description:
    """The engine ``options``, each parameter ``(name, tensor, uses the matrix rule)`` and every group's
    hyperparameters (see the module docstring)."""
    out: Description = [(f"option {key}", normalized(value, tensor_values=True)) for key, value in options.items()]
    for name, p, use_muon in params:
        placements = tuple(str(x) for x in getattr(p, "placements", ()))
        rule = "matrix rule" if use_muon else "AdamW"
        out.append((f"parameter {name!r}", (tuple(p.shape), str(p.dtype), placements, rule)))
    out.extend(describe_groups(groups, tensor_values=True))
    return out


def digest(description: Description) -> int:
    """A 62-bit digest of ``description`` (≥ 1)."""
    return int(hashlib.sha256(repr(description).encode()).hexdigest()[:15], 16) + 1


def first_difference(descriptions: list[Description], ranks: list[int]) -> str:
    """Name the first option (or parameter) whose value differs between the descriptions of ``ranks``."""
    as_dicts = [dict(d) for d in descriptions]
    order: list[str] = []
    for d in descriptions:
        order.extend(key for key, _ in d if key not in order)
    for key in order:
        values = [d.get(key, "<missing>") for d in as_dicts]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in zip(ranks, values))
            return f"{key} differs across ranks ({shown})"
    return "the order of options or parameters differs across ranks"


def raise_difference(description: Description, group: Any, what: str) -> None:
    """Exchange descriptions over ``group`` (every member calls this) and raise the first difference."""
    size = dist.get_world_size(group)
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, description, group=group)
    ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(size)]
    raise OptionMismatchError(f"{what}: {first_difference(gathered, ranks)}; no rank changed anything")


def distinct_across(value: int, group: Any, device: torch.device) -> int:
    """How many different ``value`` s the ranks of ``group`` hold (one all-gather of an int64 each)."""
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return len({int(t.item()) for t in gathered})


def check_same_everywhere(description: Description, group: Any, device: torch.device, what: str) -> None:
    """Compare ``description``'s digest across ``group``; on a difference every rank raises naming it."""
    if distinct_across(digest(description), group, device) != 1:
        raise_difference(description, group, what)


def any_rank(flag: bool, groups: Iterable[tuple[Any, torch.device]]) -> bool:
    """Whether ``flag`` is set on any rank of the ``(process group, device)`` meshes: one MAX all-reduce per
    mesh, each mesh's result feeding the next (so, meshes in increasing size, the last carries every flag to
    every rank), and one host read at the end, each beside the work queued on its device
    (:func:`.side_streams.beside_queued_work`)."""
    value = torch.tensor([int(flag)], dtype=torch.int64)
    for group, device in groups:
        with beside_queued_work(device, CONSENSUS):
            value = value.to(device)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    with beside_queued_work(value.device, CONSENSUS):
        return bool(value.item())
