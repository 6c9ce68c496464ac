"""QK-clip's per-head logit maxima from FlexAttention's own kernel, at no extra Q·Kᵀ.

``flex_attention(q, k, v, ..., return_aux=AuxRequest(max_scores=True))`` (torch ≥ 2.9) also returns

    M[b, h, i] = max over the key positions j the block mask allows of score_mod(q_i·k_j·scale)

in natural units ([batch, query heads, q_len], float32): the Triton kernel keeps its running row maximum in
log2 units (q·k·scale·log2 e, the scale and 1/ln 2 applied in float32) and ``flex_attention`` multiplies it by
ln 2 on return; a row the mask leaves empty holds −inf. With no ``score_mod``, QK-clip's statistic is

    S_h = max over b and i of M[b, h, i],

the empty rows (−inf) dropping out of the max by themselves. The only cost is that reduction: the kernel
computes M anyway for its online softmax and only stores it.

torchtitan's inner attentions call one compiled function: 0.2's ``FlexAttentionWrapper._compiled_flex_attn``
(with ``return_lse``), 0.3's ``FlexAttention.compiled_flex_attn`` (with ``return_aux``). :func:`install`
replaces that class attribute, once, by a function that asks the same function for ``max_scores`` too while
a covered layer's forward runs, hands M to that layer and returns exactly what the original call returns
(the output of the same kernel, which only stores M besides; the lse where it was asked for). Outside a
covered layer it passes the call through unchanged. :func:`record_from_kernel` registers, on each covered
inner attention, the hooks that open that window and hand S_h to the optimizer, once per forward.

Where the kernel cannot serve (see :func:`unavailable`: another attention, tensors on the CPU, where torch
2.13 raises for ``max_scores``, or FlexAttention's FLASH backend, which refuses it),
:mod:`torchtitan_ext.qk_clip` recomputes the maxima exactly instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest

KERNEL_CALLS = {"FlexAttentionWrapper": "_compiled_flex_attn", "FlexAttention": "compiled_flex_attn"}
"""torchtitan's FlexAttention inner-attention classes (0.2, 0.3) and the compiled function each calls."""

_open: list[list[torch.Tensor]] = []
"""The row maxima of the covered attention whose forward is running (its list on top; empty outside one)."""


def unavailable(inner: nn.Module, device: torch.device) -> str | None:
    """Why FlexAttention's kernel cannot give ``inner``'s maxima on ``device``, or None when it can."""
    name = type(inner).__name__
    if name not in KERNEL_CALLS:
        return f"{name} is not FlexAttention and returns no row maxima"
    if device.type != "cuda":
        return f"FlexAttention returns max_scores from its Triton kernel only (CUDA), not on {device.type}"
    if getattr(inner, "kernel_options", {}).get("BACKEND") == "FLASH":
        return "FlexAttention's FLASH backend does not return max_scores"
    return None


def per_head(row_maxima: torch.Tensor) -> torch.Tensor:
    """S_h = max over batch and query positions of the kernel's ``max_scores`` [batch, heads, q_len]; rows the
    mask leaves empty are −inf and do not count."""
    return row_maxima.detach().amax(dim=(0, 2))


def _asking_max_scores(compiled: Callable[..., Any], legacy_lse: bool) -> Callable[..., Any]:
    """``compiled`` (torchtitan's compiled ``flex_attention``) that, inside a covered layer's forward, also asks
    for ``max_scores``, keeps them for the layer and returns what ``compiled`` returns for the call as made.
    ``legacy_lse``: the call passes ``return_lse`` (torchtitan 0.2) rather than ``return_aux`` (0.3)."""

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
        if not _open:
            return compiled(q, k, v, **kwargs)
        if legacy_lse:
            lse = kwargs.pop("return_lse", False)
            out, aux = compiled(q, k, v, **kwargs, return_aux=AuxRequest(lse=lse, max_scores=True))
            _open[-1].append(aux.max_scores)
            return (out, aux.lse) if lse else out
        asked = kwargs.pop("return_aux")
        out, aux = compiled(q, k, v, **kwargs, return_aux=AuxRequest(lse=asked.lse, max_scores=True))
        _open[-1].append(aux.max_scores)
        return out, AuxOutput(lse=aux.lse, max_scores=aux.max_scores if asked.max_scores else None)

    call.asks_max_scores = True
    return call


def install(cls: type) -> None:
    """Replace ``cls``'s compiled FlexAttention function by :func:`_asking_max_scores`'s (idempotent)."""
    attribute = KERNEL_CALLS[cls.__name__]
    compiled = getattr(cls, attribute)
    if getattr(compiled, "asks_max_scores", False):
        return
    call = _asking_max_scores(compiled, legacy_lse=attribute == "_compiled_flex_attn")
    setattr(cls, attribute, call if attribute == "_compiled_flex_attn" else staticmethod(call))


def record_from_kernel(
    layer: str, inner: nn.Module, record: Callable[[str, torch.Tensor], None]
) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks on ``inner`` (a FlexAttention inner attention) that hand ``record(layer, S)`` the kernel's
    per-head maxima of each forward; return their handles."""
    install(type(inner))

    def open_window(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        _open.append([])  # before any error: the always-called hand_over closes it
        if kwargs.get("score_mod") is not None:
            raise NotImplementedError(
                f"QK-clip: attention {layer!r} has a score_mod: its softmax inputs are not q·k·scale"
            )

    def hand_over(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        taken = _open.pop()
        if output is None:  # the forward raised (an always-called hook): its error is the one to see
            return
        if len(taken) != 1:
            raise RuntimeError(
                f"QK-clip: attention {layer!r} made {len(taken)} calls of torchtitan's compiled flex_attention in "
                f"one forward, where its maxima need exactly one ({type(module).__name__}.forward was replaced?)"
            )
        record(layer, per_head(taken[0]))

    return [
        inner.register_forward_pre_hook(open_window, with_kwargs=True),
        inner.register_forward_hook(hand_over, with_kwargs=True, always_call=True),
    ]
