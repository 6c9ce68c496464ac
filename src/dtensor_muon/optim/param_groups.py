"""Param groups from a model, with embeddings and output heads routed to AdamW by module, not by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..plan.views import MatrixSplit


def muon_param_groups(
    model: nn.Module,
    *,
    adamw_modules: Sequence[type[nn.Module]] = (),
    adamw_names: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Named param groups for :class:`dtensor_muon.Muon`: ``Muon(muon_param_groups(model), lr=...)``.

    These parameters go to AdamW (a group with ``"use_muon": False``):

    - those of every ``nn.Embedding`` (subclasses included, e.g. FSDP2-wrapped or framework embeddings);
    - those of every module that is an instance of a type in ``adamw_modules``;
    - those of the module ``model.get_output_embeddings()`` returns, when the model has that method
      (Hugging Face models: the output head, tied or not);
    - those of the output layer of an ``nn.Sequential`` model (:func:`sequential_output_linear`: its last
      ``nn.Linear`` when nothing but parameter-free modules follow it, nested Sequentials included);
    - those named in ``adamw_names``: a module's qualified name (``"output"``: all its parameters) or a
      parameter's (``"output.weight"``); a name that matches nothing raises, so typos do not pass silently.

    Every other parameter goes to a group routed by the default rule (:mod:`dtensor_muon.plan.routing`: ≥2-D
    matrices to Muon, unless a name component marks an embedding or head; the rest to AdamW). Groups are
    plain dicts of ``(name, parameter)`` pairs, in ``model.named_parameters()`` order (tied parameters once);
    add keys (``"lr"``, ``"weight_decay"``, ...) to either before building the optimizer. Empty groups are left
    out. Parameters with ``requires_grad=False`` are included (the optimizer gives them no state).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if isinstance(adamw_names, str) or not all(isinstance(n, str) for n in adamw_names):
        raise TypeError(f"adamw_names: expected a tuple of strings, got {type(adamw_names).__name__}")
    types = tuple(adamw_modules)
    for t in types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            label = t if isinstance(t, str) else type(t).__name__
            raise TypeError(f"adamw_modules: expected nn.Module subclasses, got {label!r}")
    modules = dict(model.named_modules())
    named = list(model.named_parameters())
    unknown = [n for n in adamw_names if n not in modules and not any(p == n for p, _ in named)]
    if unknown:
        raise ValueError(f"adamw_names: {unknown[0]!r} names no module or parameter of the model")

    adamw_ids: set[int] = set()
    head = getattr(model, "get_output_embeddings", None)
    head_module = head() if callable(head) else None
    last_linear = sequential_output_linear(model)
    for name, module in modules.items():
        if (
            isinstance(module, (nn.Embedding, *types))
            or module is head_module
            or module is last_linear
            or name in adamw_names
        ):
            adamw_ids.update(id(p) for p in module.parameters())
    adamw_ids.update(id(p) for n, p in named if n in adamw_names)

    default = [(n, p) for n, p in named if id(p) not in adamw_ids]
    adamw = [(n, p) for n, p in named if id(p) in adamw_ids]
    groups: list[dict[str, Any]] = []
    if default:
        groups.append({"params": default})
    if adamw:
        groups.append({"params": adamw, "use_muon": False})
    return groups


def sequential_output_linear(model: nn.Module) -> nn.Linear | None:
    """The ``nn.Linear`` that produces an ``nn.Sequential`` model's output, where the structure says so: walking
    the Sequential's children from the last, parameter-free ones (activations, dropout, flatten) are passed
    over, a Linear is the answer, a nested Sequential is searched the same way; anything else (a module with
    parameters whose forward is not known) ends the search with None, as does a model that is not a Sequential."""
    if not isinstance(model, nn.Sequential):
        return None
    for child in reversed(list(model.children())):
        if isinstance(child, nn.Linear):
            return child
        has_parameters = any(True for _ in child.parameters())
        if isinstance(child, nn.Sequential) and has_parameters:
            return sequential_output_linear(child)
        if has_parameters:
            return None
    return None


def grouped_qkv_splits(model: nn.Module, per: str = "projection") -> dict[str, MatrixSplit]:
    """``{parameter name: MatrixSplit}`` for every fused, KV-group-interleaved QKV weight of ``model``, for the
    ``matrix_splits`` keyword: ``Muon(model.named_parameters(), matrix_splits=grouped_qkv_splits(model))``.

    A module counts when it has a ``wqkv`` submodule with a ``weight`` and the ints ``heads_per_kv`` (h) and
    ``head_dim`` (d), as torchtitan 0.3's ``FusedQKVLinear``: its weight's rows are n_kv groups of h query
    heads, one key head and one value head of d rows each, so n_kv = rows / ((h + 2)·d) (the global row count
    of a DTensor). Each gets :meth:`MatrixSplit.grouped_qkv` (n_kv·h, n_kv, d, ``per``): W_q, W_k, W_v
    (``"projection"``) or every head (``"head"``) as separate parameters would be updated.
    """
    out: dict[str, MatrixSplit] = {}
    for name, module in model.named_modules():
        fused = getattr(module, "wqkv", None)
        h, d = getattr(module, "heads_per_kv", None), getattr(module, "head_dim", None)
        weight = getattr(fused, "weight", None)
        if not (isinstance(fused, nn.Module) and isinstance(h, int) and isinstance(d, int) and weight is not None):
            continue
        rows = weight.shape[0]
        if rows % ((h + 2) * d):
            raise ValueError(
                f"{name}.wqkv.weight: {rows} rows are not KV groups of {h} query heads, one key and one value head "
                f"of head_dim {d}"
            )
        n_kv = rows // ((h + 2) * d)
        out[f"{name}.wqkv.weight" if name else "wqkv.weight"] = MatrixSplit.grouped_qkv(n_kv * h, n_kv, d, per=per)
    return out
