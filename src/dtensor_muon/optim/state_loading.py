"""Loading optimizer state: what must fit before anything is loaded, and the opt-in switch between optimizers.

:func:`load_problem` says why a state dict cannot be loaded into a :class:`~.base.MatrixOptimizer` on this rank
(another optimizer's or another routing's state, another world size's shards, missing owner state, momentum
saved in another ``momentum_dtype``); the front end's load pre-hook raises it on every rank after :func:`agree`.
:func:`hold_uncast` and :func:`restore_uncast` keep a low-precision momentum's tensors (bf16 buffers, int8 codes
and their float32 scales) in their own dtypes, which torch's loading would cast to the parameter's.
:func:`load_compatible_state` keeps the AdamW moments of another optimizer's state and starts everything else
fresh.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol

from torch import Tensor

from ..distributed import consensus
from ..distributed.host_memory import to_host
from ..distributed.layout import local
from ..engine.context import OWNER_STATE_KEY
from ..engine.step import Engine
from ..plan.routing import name_patterns
from ..rules import adamw as adamw_rule
from ..rules.base import MatrixRule
from ..rules.momentum_storage import BUFFER, CODES, group_momentum_dtype, same_format, stored_format

logger = logging.getLogger("dtensor_muon")


class Loadable(Protocol):
    """What this module reads and sets of a :class:`~.base.MatrixOptimizer` (a protocol, so that the front end
    imports this module and not the other way round)."""

    rule: MatrixRule
    state: Any
    param_groups: list[dict[str, Any]]
    _engine: Engine | None

    def _labelled(self) -> Iterator[tuple[str, Tensor, dict[str, Any]]]: ...

    def _all_params(self) -> list[Tensor]: ...

    def _fresh_state(self, p: Tensor, group: dict[str, Any], label: str) -> dict[str, Tensor]: ...

    def _build_engine(self, loaded_owner_state: set[int] | None = None) -> Engine: ...

    def flush(self) -> None: ...

    def _offloaded_keys(self, group: dict[str, Any]) -> tuple[str, ...]: ...


def load_problem(opt: Loadable, state_dict: dict[str, Any]) -> str | None:
    """Why ``state_dict`` cannot be loaded into this optimizer on this rank, or None.

    Checks, against the state this optimizer holds now: each saved group's ``use_muon`` (True/False, equal to
    that of the group it loads into); each parameter's state keys (the rule's shard-state keys, plus
    ``owner_state`` for a rule with owner state, for a matrix-rule parameter; AdamW's for the others); the
    local shape of every shard-state and AdamW tensor (a DTensor's local piece; a plain tensor as it is)
    against this rank's layout of the parameter; and, for owner state, that every matrix this rank computes
    is there in its shape; for a rule with ``momentum_dtype``, that the saved group's ``momentum_dtype`` and
    the format of each saved momentum (:func:`~..rules.momentum_storage.stored_format`) are this group's (a
    bf16 parameter's "float32" and "bfloat16" buffers are one format). A parameter without saved state gets
    fresh state, as in torch. Group counts and sizes are left to torch's own check.
    """
    saved_groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
        return None
    me, rule = type(opt).__name__, opt.rule.name
    switch = (
        "To switch optimizers, load the model only and start this optimizer fresh, or keep the AdamW moments "
        "with optimizer.load_compatible_state(state_dict) (docs/optimizers.md, Checkpoints)."
    )
    for gi, saved in enumerate(saved_groups):
        found = saved.get("use_muon") if isinstance(saved, dict) else None
        if type(found) is not bool:
            saved = saved if isinstance(saved, dict) else {}
            ids, names = saved.get("params") or [None], saved.get("param_names") or [None]
            first = ids[0] if isinstance(ids[0], str) else names[0]
            if first is None and gi < len(opt.param_groups) and opt.param_groups[gi]["params"]:
                first = next(label for label, p, _ in opt._labelled() if p is opt.param_groups[gi]["params"][0])
            return (
                f"{me}.load_state_dict: loaded param group {gi} (first parameter {first!r}) has "
                f"use_muon={found!r}, where every group of "
                f"{me} has use_muon True ({rule}) or False (adamw): it was saved by another optimizer. Nothing "
                f"was loaded. {switch}"
            )
    if len(saved_groups) != len(opt.param_groups) or any(
        len(s.get("params", ())) != len(g["params"]) for s, g in zip(saved_groups, opt.param_groups)
    ):
        return None  # torch's own check raises
    reshard = (
        "It was saved with another world size or sharding: load it through torch.distributed.checkpoint "
        "(get_optimizer_state_dict, dcp.load, set_optimizer_state_dict), which reshards it."
    )
    rows = list(opt._labelled())
    has_momentum = BUFFER in opt.rule.shard_state_keys  # the rule keeps a momentum buffer (momentum_dtype)
    k = 0
    for gi, (group, saved) in enumerate(zip(opt.param_groups, saved_groups)):
        found, expected = saved.get("use_muon"), group["use_muon"]
        if found != expected:
            first = rows[k][0] if group["params"] else "no parameters"
            return (
                f"{me}.load_state_dict: loaded param group {gi} has use_muon={found!r}, where this optimizer's "
                f"group {gi} (first parameter {first!r}) has use_muon={expected} "
                f"({rule if expected else 'adamw'}): it was saved with another routing (other param groups, "
                f"names or use_muon). Nothing was loaded. {switch}"
            )
        saved_mode = saved.get("momentum_dtype")  # None: saved as float32, or before it existed
        mode = group_momentum_dtype(group) if has_momentum else None
        if expected and mode is not None and saved_mode is not None and saved_mode != mode:
            first = rows[k][0] if group["params"] else "no parameters"
            return (
                f"{me}.load_state_dict: loaded param group {gi} (first parameter {first!r}) was saved with "
                f"momentum_dtype={saved_mode!r}, this optimizer's group {gi} has momentum_dtype={mode!r}. Nothing "
                f"was loaded. Build the optimizer with momentum_dtype={saved_mode!r} to resume this checkpoint."
            )
        k += len(group["params"])
    saved_ids = [i for g in saved_groups for i in g["params"]]
    for key, (label, p, group) in zip(saved_ids, rows):
        saved = saved_state.get(key)
        if not saved:
            continue
        use_muon = group["use_muon"]
        where = f"{me}.load_state_dict: parameter {label!r} ({rule if use_muon else 'adamw'})"
        if not isinstance(saved, dict):
            return f"{where}: its loaded state is a {type(saved).__name__}, expected a dict. Nothing was loaded."
        if use_muon and has_momentum and (BUFFER in saved or CODES in saved):
            found, mode = stored_format(saved, p.dtype), group_momentum_dtype(group)
            if not same_format(found, mode, p.dtype):
                return (
                    f"{where}: the loaded momentum was saved with momentum_dtype={found!r}, this optimizer has "
                    f"momentum_dtype={mode!r}. Nothing was loaded. Build the optimizer with "
                    f"momentum_dtype={found!r} to resume this checkpoint."
                )
        current = opt.state.get(p) or opt._fresh_state(p, group, label)
        keys = list(opt.rule.state_keys(group) if use_muon else adamw_rule.STATE_KEYS)
        if use_muon and opt.rule.has_owner_state:
            keys.append(OWNER_STATE_KEY)
        # a rank that computes none of the parameter's matrices may get no owner_state key at all (flattening
        # a state dict drops an empty dict)
        optional = OWNER_STATE_KEY in keys and not current.get(OWNER_STATE_KEY)
        if set(saved) != set(keys) and not (optional and set(saved) == set(keys) - {OWNER_STATE_KEY}):
            return (
                f"{where}: the loaded state has keys {sorted(saved)}, {me} expects {sorted(keys)}: it was saved "
                f"by another optimizer. Nothing was loaded. {switch}"
            )
        for name in [key for key in keys if key in saved]:
            if name == OWNER_STATE_KEY:
                problem = owner_state_problem(where, saved[name], current.get(name, {}), reshard)
                if problem is not None:
                    return problem
                continue
            value, reference = saved[name], current[name]
            if name == "step" and not use_muon and isinstance(value, (int, float)) and not isinstance(value, bool):
                continue  # a Python number: converted on load, as torch.optim.AdamW does
            if not isinstance(value, Tensor):
                return (
                    f"{where}, state {name!r}: the loaded value is a {type(value).__name__}, expected a Tensor. "
                    "Nothing was loaded."
                )
            found_shape, expected_shape = tuple(local(value).shape), tuple(local(reference).shape)
            if found_shape != expected_shape:
                return (
                    f"{where}, state {name!r}: the loaded tensor's local shape is {found_shape}, this rank's "
                    f"layout of the parameter has {expected_shape}. Nothing was loaded. {reshard}"
                )
    return None


def owner_state_problem(where: str, saved: Any, held: dict[str, Any], reshard: str) -> str | None:
    """Why the loaded owner state ``saved`` of one parameter does not fit what this rank computes (``held``,
    the owner state the current plan keeps here), or None."""
    if not isinstance(saved, dict):
        return f"{where}: its loaded owner_state is a {type(saved).__name__}, expected a dict. Nothing was loaded."
    missing = [matrix for matrix in held if matrix not in saved]
    if missing:
        return (
            f"{where}: the loaded owner_state lacks matrices this rank computes ({', '.join(missing[:3])}"
            f"{', …' if len(missing) > 3 else ''}). Nothing was loaded. {reshard}"
        )
    for matrix, tensors in held.items():
        loaded = saved[matrix]
        if not isinstance(loaded, dict) or set(loaded) != set(tensors):
            found = sorted(loaded) if isinstance(loaded, dict) else type(loaded).__name__
            return (
                f"{where}: the loaded owner_state of matrix {matrix!r} has {found}, expected keys "
                f"{sorted(tensors)}. Nothing was loaded."
            )
        for name, reference in tensors.items():
            value = loaded[name]
            if not isinstance(value, Tensor) or tuple(value.shape) != tuple(reference.shape):
                found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                return (
                    f"{where}, owner_state {matrix!r} {name!r}: the loaded value has shape {found}, expected "
                    f"{tuple(reference.shape)}. Nothing was loaded. {reshard}"
                )
    return None


def hold_uncast(
    opt: Loadable, state_dict: dict[str, Any]
) -> tuple[dict[str, Any], list[tuple[Tensor, dict[str, Any], str, Tensor]]]:
    """``state_dict`` without the state tensors that torch's loading must not cast to their parameter's dtype
    and device: a low-precision momentum (a matrix-rule shard-state tensor whose dtype is not its parameter's)
    and, with ``offload="host"``, every offloaded tensor (it stays in host memory); those tensors as
    (parameter, its group, key, tensor), for :func:`restore_uncast` after torch has loaded the rest."""
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    param_of = dict(zip(saved_ids, opt._all_params()))  # as torch's load_state_dict maps them
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    held: list[tuple[Tensor, dict[str, Any], str, Tensor]] = []
    state = dict(state_dict["state"])
    for key, value in state.items():
        p = param_of.get(key)
        if p is None or not isinstance(value, dict):
            continue
        group = group_of[id(p)]
        offloaded = opt._offloaded_keys(group)
        uncast = {
            name: t
            for name, t in value.items()
            if isinstance(t, Tensor)
            and name != "step"
            and (name in offloaded or (group["use_muon"] and name in opt.rule.shard_state_keys and t.dtype != p.dtype))
        }
        if uncast:
            held.extend((p, group, name, t) for name, t in uncast.items())
            state[key] = {name: t for name, t in value.items() if name not in uncast}
    return {**state_dict, "state": state}, held


def restore_uncast(opt: Loadable, held: list[tuple[Tensor, dict[str, Any], str, Tensor]]) -> None:
    """Put :func:`hold_uncast`'s tensors into the loaded state where the optimizer keeps them: offloaded ones in
    host memory (AdamW's moments in their parameter's dtype, as torch's loading casts them), the others on
    their parameter's device, their dtype kept."""
    for p, group, name, t in held:
        if name in opt._offloaded_keys(group):
            if not group["use_muon"] and t.is_floating_point():
                t = t.to(dtype=p.dtype)
            opt.state[p][name] = to_host(t)
        else:
            opt.state[p][name] = t.to(local(p).device)


def agree(opt: Loadable, problem: str | None) -> str | None:
    """``problem``, or, when this rank has none but another rank of one of the parameters' meshes has one,
    a message saying so: one small all-reduce per mesh (the engine's consensus meshes, in their order)."""
    meshes = opt._engine.consensus_meshes() if opt._engine is not None else []
    failed = consensus.any_rank(problem is not None, meshes)
    if failed and problem is None:
        problem = (
            f"{type(opt).__name__}: the loaded optimizer state does not fit this optimizer on another rank "
            "(that rank's error names the parameter). Nothing was loaded."
        )
    return problem


def load_compatible_state(opt: Loadable, state_dict: dict[str, Any]) -> dict[str, list[str]]:
    """Start from another optimizer's state: keep the AdamW moments of this optimizer's AdamW parameters,
    start everything else fresh. Returns (and logs at INFO) ``{"kept": [...], "fresh": [...]}``, names.

    ``state_dict``: a ``state_dict()`` of torch.optim.AdamW/Adam or of any dtensor_muon optimizer, built on
    ``(name, tensor)`` pairs (its groups carry ``param_names``), or the parameter-name-keyed form of
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (e.g. filled by ``dcp.load``).
    Parameters are matched by name, so this optimizer must be built on named parameters too. An AdamW
    parameter here keeps its saved state when that state has exactly AdamW's keys (``step``, ``exp_avg``,
    ``exp_avg_sq``) in this rank's local shapes (a shape that differs raises ValueError: another world size,
    go through DCP); every other parameter (all matrix-rule parameters, and AdamW parameters saved without
    AdamW state) gets fresh state. Hyperparameters (param groups, lr) are not loaded: this optimizer keeps
    its own. Nothing changes when it raises.
    """
    me = type(opt).__name__
    groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
    if not (isinstance(groups, list) and isinstance(saved_state, dict)):
        raise ValueError(f"{me}.load_compatible_state: expected a state dict with 'state' and 'param_groups'")
    saved: dict[str, Any] = {}
    for gi, group in enumerate(groups):
        names = group.get("param_names")
        for pos, key in enumerate(group.get("params", ())):
            if isinstance(key, str):
                name = key
            elif names is not None:
                name = names[pos]
            else:
                raise ValueError(
                    f"{me}.load_compatible_state: the state dict's param group {gi} names no parameters (integer "
                    "ids without 'param_names'): save it from an optimizer built on model.named_parameters(), or "
                    "with torch.distributed.checkpoint.state_dict.get_optimizer_state_dict (keyed by name)"
                )
            if key in saved_state:
                saved[name] = saved_state[key]
    rows = [(label, p, group) for label, p, group in opt._labelled() if p.requires_grad or opt.state.get(p)]
    if not any(group.get("param_names") for group in opt.param_groups):
        raise ValueError(
            f"{me}.load_compatible_state: this optimizer's parameters have no names to match the state dict's by: "
            "build it on model.named_parameters()"
        )
    kept: dict[int, dict[str, Any]] = {}  # id(parameter) → its saved AdamW state
    fresh: list[tuple[str, Tensor]] = []
    problem = None
    for label, p, group in rows:
        entry = saved.get(label)
        if group["use_muon"] or not isinstance(entry, dict) or set(entry) != set(adamw_rule.STATE_KEYS):
            fresh.append((label, p))
            continue
        reference = opt.state.get(p) or adamw_rule.init_state(p)
        for name in ("exp_avg", "exp_avg_sq"):
            value = entry[name]
            found = tuple(local(value).shape) if isinstance(value, Tensor) else type(value).__name__
            if found != tuple(local(reference[name]).shape) and problem is None:
                problem = (
                    f"{me}.load_compatible_state: parameter {label!r} (adamw), state {name!r}: the loaded value "
                    f"has local shape {found}, this rank's layout of the parameter has "
                    f"{tuple(local(reference[name]).shape)}. Nothing was loaded. It was saved with another world "
                    "size or sharding: fill a template of the saved optimizer with dcp.load first, which reshards."
                )
        kept[id(p)] = entry
    problem = agree(opt, problem)
    if problem is not None:
        raise ValueError(problem)
    opt.flush()
    for label, p, group in rows:
        state = opt._fresh_state(p, group, label)
        entry = kept.get(id(p))
        if entry is not None:
            step = entry["step"]
            state["step"] = adamw_rule.step_tensor(step.item() if isinstance(step, Tensor) else step)
            for name in ("exp_avg", "exp_avg_sq"):
                local(state[name]).copy_(local(entry[name]))
        opt.state[p] = state
    opt._engine = opt._build_engine()
    kept_rows = [(label, p) for label, p, _ in rows if id(p) in kept]
    report = {"kept": [label for label, _ in kept_rows], "fresh": [label for label, _ in fresh]}
    logger.info(
        "%s.load_compatible_state: kept the AdamW state of %d parameters (%s); started %d fresh (%s)",
        me,
        len(kept),
        name_patterns(kept_rows) or "none",
        len(fresh),
        name_patterns(fresh) or "none",
    )
    return report
