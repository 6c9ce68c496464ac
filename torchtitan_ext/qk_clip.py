"""QK-clip for torchtitan's models: each attention layer's heads read from the model, and the per-head logit
maxima handed to the optimizer from the attention's inputs.

:func:`attention_heads` finds every module with an ``inner_attention`` (torchtitan's attention layers) and reads
its geometry: ``wq``/``wk`` with ``n_heads``, ``n_kv_heads``, ``head_dim`` (Llama3, Qwen3: MHA or GQA), or
``wkv_b`` with the MLA dims (DeepSeek-V3; the query weight is ``wq``, or ``wq_b`` with a query LoRA); in
torchtitan 0.3, a ``qkv_linear`` with ``wq``/``wk`` or a fused ``wqkv`` interleaved by key group
(:meth:`dtensor_muon.AttentionHeads.grouped_qkv`). Parameter names are the model part's own (``named_parameters``,
passed through ``name_of``: torchtitan 0.3 names them canonically), activation-checkpoint wrappers included.

:func:`record_maxima` takes each layer's maxima by one of two paths and registers its hooks:

- the kernel path (:mod:`torchtitan_ext.qk_clip_kernel`), for torchtitan's FlexAttention on CUDA: the
  attention's own kernel returns its row maxima (``AuxRequest(max_scores=True)``), reduced per head; no extra
  product, no extra memory beyond [batch, heads, seq] float32 row maxima;
- the exact fallback (:func:`fallback_hook`), for SDPA and wherever the kernel cannot serve (FlexAttention on
  the CPU, its FLASH backend): a forward pre-hook on each ``inner_attention`` computes, from the query and key it
  is called with (after RoPE and QK-norm; [batch, heads, seq, head_dim] in torchtitan 0.2, [batch, seq, heads,
  head_dim] in 0.3) and its ``scale`` (default head_dim^-½), the softmax inputs q_i·k_j·scale at the allowed
  positions (j ≤ i, or FlexAttention's mask) in float32, a few query heads at a time (:func:`max_logits`): one
  more Q·Kᵀ product per layer and forward, and, with FlexAttention, its mask made dense from the block mask's
  ``mask_mod`` ([batch, seq, seq] booleans, :func:`dense_mask`).

Both hand each head's maximum to the optimizer. SDPA (causal) and FlexAttention of both lines are supported;
varlen attention and a ``score_mod`` are refused.

:func:`build_with_qk_clip` puts both together for the optimizers' containers of both torchtitan lines.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_mask

from dtensor_muon import AttentionHeads
from torchtitan_ext import qk_clip_kernel

logger = logging.getLogger("torchtitan_ext")

SCORES_BYTES = 256 * 2**20
"""At most this many bytes of float32 scores at a time (query heads are taken in groups that fit)."""


SUPPORTED = ("sdpa", "flex", "ScaledDotProductAttentionWrapper", "ScaledDotProductAttention", "FlexAttentionWrapper",
             "FlexAttention")  # fmt: skip
"""The attentions (torchtitan 0.2's ``attn_type``, 0.3's inner-attention classes) whose masks the hooks reproduce:
causal SDPA, and FlexAttention's block masks (made dense from their ``mask_mod``)."""


def attention_heads(
    model: nn.Module, name_of: Callable[[str], str] = str
) -> dict[str, tuple[nn.Module, AttentionHeads]]:
    """``{layer name: (its inner_attention module, AttentionHeads)}`` for every attention layer of ``model``;
    ``name_of`` maps a parameter's ``named_parameters`` name to the optimizer's."""
    layers = {}
    for name, module in model.named_modules():
        inner = getattr(module, "inner_attention", None)
        if not isinstance(inner, nn.Module):
            continue
        prefix = f"{name}." if name else ""
        kind = getattr(module, "attn_type", type(inner).__name__)  # torchtitan 0.2 names it; 0.3's is the class
        if kind not in SUPPORTED:
            raise NotImplementedError(
                f"QK-clip: attention {name!r} runs {kind!r}, whose masks this plug-in does not reproduce for the "
                "logit maxima; use SDPA or FlexAttention ([model] attn_type), or qk_clip_tau = 0"
            )
        # torchtitan 0.3 keeps the projections in a qkv_linear submodule, 0.2 on the attention itself
        projections, at = (
            (module.qkv_linear, f"{prefix}qkv_linear.") if hasattr(module, "qkv_linear") else (module, prefix)
        )
        if hasattr(projections, "wqkv"):
            heads = AttentionHeads.grouped_qkv(
                name_of(f"{at}wqkv.weight"), module.n_heads, module.n_kv_heads, module.head_dim
            )
        elif hasattr(module, "wkv_b"):
            q = "wq" if getattr(module, "q_lora_rank", 0) == 0 else "wq_b"
            heads = AttentionHeads(
                q=name_of(f"{prefix}{q}.weight"),
                k=name_of(f"{prefix}wkv_b.weight"),
                n_heads=module.n_heads,
                qk_nope_head_dim=module.qk_nope_head_dim,
                qk_rope_head_dim=module.qk_rope_head_dim,
                v_head_dim=module.v_head_dim,
            )
        elif hasattr(projections, "wq") and hasattr(projections, "wk"):
            heads = AttentionHeads(
                q=name_of(f"{at}wq.weight"),
                k=name_of(f"{at}wk.weight"),
                n_heads=module.n_heads,
                head_dim=module.head_dim,
                n_kv_heads=module.n_kv_heads,
            )
        else:
            raise ValueError(
                f"QK-clip: attention {name!r} ({type(module).__name__}) has no wq/wk, wkv_b or qkv_linear weights"
            )
        layers[name] = (inner, heads)
    if not layers:
        raise ValueError("QK-clip: the model has no attention layer (no module with an inner_attention)")
    return layers


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """max over batch and allowed positions of q_i·k_j·scale, per query head (float32); ``mask`` ([batch or 1,
    1, seq, seq], True where attention looks) or, without one, the causal j ≤ i; a key head serves ``q heads /
    k heads`` query heads (GQA)."""
    batch, heads, seq, _ = q.shape
    repeat = heads // k.shape[1]
    if mask is None:
        mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=q.device).tril()
    chunk = max(1, SCORES_BYTES // (4 * seq * seq))
    out = torch.full((heads,), float("-inf"), device=q.device)
    for b in range(batch):
        allowed = mask[b if mask.shape[0] > 1 else 0, 0]
        for h0 in range(0, heads, chunk):
            h1 = min(heads, h0 + chunk)
            qs = q[b, h0:h1].float()
            ks = k[b, torch.arange(h0, h1, device=k.device) // repeat].float()  # each query head's key head
            scores = (qs @ ks.transpose(-2, -1)) * scale
            peak = scores.masked_fill(~allowed, float("-inf")).amax(dim=(1, 2))
            out[h0:h1] = torch.maximum(out[h0:h1], peak)
    return out


def dense_mask(block_mask: BlockMask, device: torch.device) -> torch.Tensor:
    """FlexAttention's mask as a [batch or 1, 1, q_len, kv_len] bool tensor, from its ``mask_mod`` (document and
    causal masks alike)."""
    batch, _, q_len, kv_len = block_mask.shape
    return create_mask(block_mask.mask_mod, batch, None, q_len, kv_len, device=device)


def fallback_hook(layer: str, seq_first: bool, record: Callable[[str, torch.Tensor], None]) -> Callable[..., None]:
    """The exact fallback's forward pre-hook on ``layer``'s inner attention: ``record(layer, max_logits(q, k,
    scale, mask))`` from the call's own arguments (``seq_first``: torchtitan 0.3's [batch, seq, heads, d])."""

    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get("score_mod") is not None:
            raise NotImplementedError(
                f"QK-clip: attention {layer!r} has a score_mod: its softmax inputs are not q·k·scale"
            )
        masks = kwargs.get("block_mask", kwargs.get("attention_masks"))
        if len(args) > 3 or not (masks is None or isinstance(masks, BlockMask)) or not kwargs.get("is_causal", 1):
            raise NotImplementedError(
                f"QK-clip: attention {layer!r} runs with a mask this plug-in does not reproduce (varlen); use SDPA "
                "or FlexAttention"
            )
        q, k = (args[0].transpose(1, 2), args[1].transpose(1, 2)) if seq_first else (args[0], args[1])
        scale = kwargs.get("scale") or q.shape[-1] ** -0.5
        mask = dense_mask(masks, q.device) if masks is not None else None
        record(layer, max_logits(q, k, scale, mask))

    return hook


def record_maxima(
    layers: dict[str, tuple[nn.Module, AttentionHeads]],
    record: Callable[[str, torch.Tensor], None],
    device: torch.device,
) -> tuple[list, dict[str, str | None]]:
    """Register the hooks that hand each layer's per-head maxima to ``record(layer, maxima)``, from FlexAttention's
    kernel where it can give them on ``device`` (the model's), else by the exact fallback. Return the hooks'
    handles and ``{layer: None on the kernel path, else why the fallback}``."""
    handles, paths = [], {}
    for layer, (inner, _) in layers.items():
        paths[layer] = qk_clip_kernel.unavailable(inner, device)
        if paths[layer] is None:
            handles += qk_clip_kernel.record_from_kernel(layer, inner, record)
            continue
        # torchtitan 0.3's inner attentions take [batch, seq, heads, d]; 0.2's wrappers [batch, heads, seq, d]
        seq_first = type(inner).__name__ in ("ScaledDotProductAttention", "FlexAttention")
        handles.append(inner.register_forward_pre_hook(fallback_hook(layer, seq_first, record), with_kwargs=True))
    return handles, paths


def describe(paths: dict[str, str | None]) -> str:
    """One line saying where the maxima of the layers in ``paths`` come from (:func:`record_maxima`'s)."""
    kernel = sum(reason is None for reason in paths.values())
    reasons = sorted({reason for reason in paths.values() if reason is not None})
    parts = [f"{kernel} from FlexAttention's kernel (max_scores)"] if kernel else []
    if reasons:
        parts.append(f"{len(paths) - kernel} by the exact fallback, one more Q·Kᵀ each ({'; '.join(reasons)})")
    return f"QK-clip: logit maxima of {len(paths)} attention layers: " + ", ".join(parts)


def build_with_qk_clip(
    build: Callable[..., Any], model: nn.Module, kwargs: dict[str, Any], name_of: Callable[[str], str] = str
) -> Any:
    """``build(**kwargs)``, the optimizer of one model part; with ``qk_clip_tau`` set, also handed the part's
    attention heads (``qk_clip_heads``), and the hooks that record its maxima are registered on the model."""
    if not kwargs.get("qk_clip_tau"):
        return build(**kwargs)
    layers = attention_heads(model, name_of)
    optimizer = build(**kwargs, qk_clip_heads={name: heads for name, (_, heads) in layers.items()})
    _, paths = record_maxima(layers, optimizer.record_max_logits, next(model.parameters()).device)
    logger.info(describe(paths))
    return optimizer
