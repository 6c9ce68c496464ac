"""QK-clip for torchtitan's models: each attention layer's heads read from the model, and the per-head logit
maxima handed to the optimizer from the attention's inputs.

:func:`attention_heads` finds every module with an ``inner_attention`` (torchtitan's attention layers) and reads
its geometry: ``wq``/``wk`` with ``n_heads``, ``n_kv_heads``, ``head_dim`` (Llama3, Qwen3: MHA or GQA), or
``wkv_b`` with the MLA dims (DeepSeek-V3; the query weight is ``wq``, or ``wq_b`` with a query LoRA). Parameter
names are the model part's own (``named_parameters``), activation-checkpoint wrappers included.

:func:`record_maxima` registers a forward pre-hook on each ``inner_attention``: from the query and key it is
called with ([batch, heads, seq, head_dim], after RoPE and QK-norm) and its ``scale`` (default head_dim^-½) it
computes the causal softmax inputs q_i·k_j·scale (j ≤ i) in float32, a few query heads at a time, and hands
each head's maximum to the optimizer. This is the exact fallback: one more Q·Kᵀ product per layer and
forward. torchtitan 0.2's SDPA path (causal) is supported; FlexAttention's and varlen's masks are refused (their
documents' masks are not reproduced here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dtensor_muon import AttentionHeads

SCORES_BYTES = 256 * 2**20
"""At most this many bytes of float32 scores at a time (query heads are taken in groups that fit)."""


def attention_heads(model: nn.Module) -> dict[str, tuple[nn.Module, AttentionHeads]]:
    """``{layer name: (its inner_attention module, AttentionHeads)}`` for every attention layer of ``model``."""
    layers = {}
    for name, module in model.named_modules():
        inner = getattr(module, "inner_attention", None)
        if not isinstance(inner, nn.Module):
            continue
        prefix = f"{name}." if name else ""
        if getattr(module, "attn_type", "sdpa") != "sdpa":
            raise NotImplementedError(
                f"QK-clip: attention {name!r} runs attn_type = {module.attn_type!r}, whose masks this plug-in does not "
                "reproduce for the logit maxima; use [model] attn_type = 'sdpa' (or qk_clip_tau = 0)"
            )
        if hasattr(module, "wkv_b"):
            q = "wq" if getattr(module, "q_lora_rank", 0) == 0 else "wq_b"
            heads = AttentionHeads(
                q=f"{prefix}{q}.weight",
                k=f"{prefix}wkv_b.weight",
                n_heads=module.n_heads,
                qk_nope_head_dim=module.qk_nope_head_dim,
                qk_rope_head_dim=module.qk_rope_head_dim,
                v_head_dim=module.v_head_dim,
            )
        elif hasattr(module, "wq") and hasattr(module, "wk"):
            heads = AttentionHeads(
                q=f"{prefix}wq.weight",
                k=f"{prefix}wk.weight",
                n_heads=module.n_heads,
                head_dim=module.head_dim,
                n_kv_heads=module.n_kv_heads,
            )
        else:
            raise ValueError(f"QK-clip: attention {name!r} ({type(module).__name__}) has neither wq/wk nor wkv_b")
        layers[name] = (inner, heads)
    if not layers:
        raise ValueError("QK-clip: the model has no attention layer (no module with an inner_attention)")
    return layers


@torch.no_grad()
def causal_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """max over batch and positions j ≤ i of q_i·k_j·scale, per query head (float32); a key head serves
    ``q heads / k heads`` query heads (GQA)."""
    batch, heads, seq, _ = q.shape
    repeat = heads // k.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    chunk = max(1, SCORES_BYTES // (4 * seq * seq))
    out = torch.full((heads,), float("-inf"), device=q.device)
    for b in range(batch):
        for h0 in range(0, heads, chunk):
            h1 = min(heads, h0 + chunk)
            qs = q[b, h0:h1].float()
            ks = k[b, torch.arange(h0, h1, device=k.device) // repeat].float()  # each query head's key head
            scores = (qs @ ks.transpose(-2, -1)) * scale
            peak = scores.masked_fill(~causal, float("-inf")).amax(dim=(1, 2))
            out[h0:h1] = torch.maximum(out[h0:h1], peak)
    return out


def record_maxima(layers: dict[str, tuple[nn.Module, AttentionHeads]], record: Callable[[str, torch.Tensor], None]):
    """Register the hooks that hand each layer's per-head maxima to ``record(layer, maxima)``; return their
    handles."""
    handles = []
    for layer, (inner, _) in layers.items():

        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], layer: str = layer) -> None:
            if "block_mask" in kwargs or len(args) > 3 or not kwargs.get("is_causal", True):
                raise NotImplementedError(
                    f"QK-clip: attention {layer!r} runs with a mask this plug-in does not reproduce (FlexAttention "
                    "or varlen); use [model] attn_type = 'sdpa'"
                )
            q, k = args[0], args[1]
            scale = kwargs.get("scale") or q.shape[-1] ** -0.5
            record(layer, causal_max_logits(q, k, scale))

        handles.append(inner.register_forward_pre_hook(hook, with_kwargs=True))
    return handles
