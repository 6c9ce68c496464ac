"""Overlap mode: finish each module's Muon updates just before the next forward needs its parameters.

``step()`` returns while the return exchanges are still in flight. :func:`attach_hooks` registers, on every
module that owns Muon parameters, a forward pre-hook placed *before* FSDP2's own pre-forward (which
all-gathers the module's parameters). For an FSDP2 module the parameters are those its FSDP state manages,
plus those of the modules FSDP will prefetch from it (``set_modules_to_forward_prefetch``); for any other
module, the parameters it registers itself. On the root modules, state-dict and load-state-dict pre-hooks
flush everything, so nothing reads or overwrites a parameter with an update still pending.

Stream order (CUDA): updates are applied on the current stream, but FSDP2 copies a module's shards into its
all-gather buffer on streams of its own, which wait for the current stream only in the root module's
pre-forward (before any of these hooks but the root's has run). So once a hook has applied updates, FSDP2's
all-gather streams are made to wait for the current stream before FSDP2's pre-forward reads the shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle


def _fsdp_state(module: nn.Module):
    """The FSDP2 state of ``module`` if it was given to ``fully_shard``, else None."""
    getter = getattr(module, "_get_fsdp_state", None)
    return getter() if getter is not None else None


def _fsdp_managed_params(state) -> list[nn.Parameter]:
    """The sharded parameters an FSDP2 state manages (torch ≥ 2.12 keeps a list of groups, 2.11 one group)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [fp.sharded_param for group in groups for fp in group.fsdp_params]


def _order_all_gathers_after_current_stream(state) -> None:
    """Make FSDP2's all-gather streams (shared by every FSDP2 state under one root) wait for the work queued
    so far on the current stream: the updates just applied to the shards they copy. Before FSDP2's lazy
    initialization (the first forward) there are no such streams, and the root's pre-forward waits anyway."""
    comm = getattr(state, "_comm_ctx", None)
    copy_in = getattr(comm, "all_gather_copy_in_stream", None)
    if copy_in is None:
        return
    current = comm.device_handle.current_stream()
    copy_in.wait_stream(current)
    comm.all_gather_stream.wait_stream(current)


def attach_hooks(
    roots: Iterable[nn.Module],
    index_of_param: dict[int, int],
    finish: Callable[[list[int]], bool],
    flush: Callable[[], None],
) -> list[RemovableHandle]:
    """Register the overlap hooks on ``roots`` (see module docstring); returns their handles.

    ``index_of_param`` maps ``id(parameter)`` to the optimizer's index for it; ``finish(indices)`` applies
    those parameters' pending updates (returning whether it applied any) and ``flush()`` applies all of them.
    """
    handles: list[RemovableHandle] = []
    claimed: set[int] = set()
    state_indices: dict[int, list[int]] = {}
    fsdp_modules: list[tuple[nn.Module, object]] = []
    roots = list(roots)
    for root in roots:
        for module in root.modules():
            state = _fsdp_state(module)
            if state is None or id(state) in state_indices:
                continue
            indices = [index_of_param[id(p)] for p in _fsdp_managed_params(state) if id(p) in index_of_param]
            state_indices[id(state)] = indices
            claimed.update(indices)
            fsdp_modules.extend((m, state) for m in state._modules)

    def fsdp_hook(state) -> Callable:
        def hook(module: nn.Module, args) -> None:
            indices = list(state_indices[id(state)])
            for target in state._states_to_forward_prefetch:
                indices.extend(state_indices.get(id(target), []))
            if finish(indices):
                _order_all_gathers_after_current_stream(state)

        return hook

    for module, state in fsdp_modules:
        handles.append(module.register_forward_pre_hook(fsdp_hook(state), prepend=True))

    for root in roots:
        for module in root.modules():
            own = [
                index_of_param[id(p)]
                for p in module._parameters.values()
                if p is not None and id(p) in index_of_param and index_of_param[id(p)] not in claimed
            ]
            if own:
                claimed.update(own)
                handles.append(
                    module.register_forward_pre_hook(lambda _module, _args, own=own: finish(own), prepend=True)
                )
        handles.append(root.register_state_dict_pre_hook(lambda *_: flush()))
        handles.append(root.register_load_state_dict_pre_hook(lambda *_: flush()))
    return handles
