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
varlen attention and a ``score_mod`` are refused. Under tensor parallelism a rank's attention sees its H/t query
heads only: their maxima go to their global positions of a vector of H, −inf elsewhere (:func:`on_all_heads`,
the rank and degree from the query weight's "tp" mesh dim: :func:`head_shards`), and the optimizer's MAX
all-reduce over all ranks assembles every head. Under pipeline parallelism each stage holds some layers: the
optimizer of every rank is given the same layers, gathered over all ranks (:func:`whole_model_heads`), each
stage records its own, and the forward torch's ``PipelineStage`` runs on uninitialized tensors to infer shapes
records nothing (:func:`real_forwards_only`). Context parallelism is refused (each rank sees a sequence shard).

:func:`build_with_qk_clip` puts both together for the optimizers' containers of both torchtitan lines.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
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
    model: nn.Module, name_of: Callable[[str], str] = str, *, required: bool = True
) -> dict[str, tuple[nn.Module, AttentionHeads]]:
    """``{layer name: (its inner_attention module, AttentionHeads)}`` for every attention layer of ``model``;
    ``name_of`` maps a parameter's ``named_parameters`` name to the optimizer's. ``required``: raise when there
    is none (else return an empty dict: a pipeline stage may hold none)."""
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
        if context_parallel(inner):
            raise NotImplementedError(
                f"QK-clip: attention {name!r} runs under context parallelism: each rank's attention sees a shard "
                "of the sequence, whose logit maxima this plug-in does not reproduce; context parallelism is not "
                "supported with qk_clip_tau"
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
    if required and not layers:
        raise ValueError("QK-clip: the model has no attention layer (no module with an inner_attention)")
    return layers


def context_parallel(inner: nn.Module) -> bool:
    """Whether torchtitan 0.3's context parallelism wraps ``inner``'s forward (``apply_cp_to_forward`` replaces
    it by a ``cp_forward``, which tensor parallelism's ``forward_with_redistribution`` may wrap in turn). torchtitan
    0.2's is refused by its container (``parallel_dims.cp_enabled``), and a sequence-sharded DTensor input by
    :func:`fallback_hook`."""
    seen, todo = set(), [vars(inner).get("forward")]
    while todo:
        fn = todo.pop()
        if not callable(fn) or id(fn) in seen or len(seen) > 16:
            continue
        seen.add(id(fn))
        if getattr(fn, "__name__", "") == "cp_forward":
            return True
        todo += [cell.cell_contents for cell in getattr(fn, "__closure__", None) or () if _filled(cell)]
    return False


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:  # an empty cell
        return False
    return True


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


def query_weight(attention: nn.Module) -> torch.Tensor:
    """The weight holding an attention module's query rows: ``wq`` (``wq_b`` with an MLA query LoRA; in 0.3, in
    ``qkv_linear``, or its fused ``wqkv``)."""
    projections = getattr(attention, "qkv_linear", attention)
    for name in ("wqkv", "wq_b" if getattr(attention, "q_lora_rank", 0) else "wq"):
        if hasattr(projections, name):
            return getattr(projections, name).weight
    raise ValueError(f"QK-clip: {type(attention).__name__} has no wq, wq_b or wqkv weight")


def tensor_parallel_heads(weight: torch.Tensor) -> tuple[int, int]:
    """(this rank's index, degree) of the tensor parallelism that splits the query heads of ``weight`` (its query
    rows): torchtitan's ColwiseParallel shards it by rows on the mesh dim named "tp", rank r holding query heads
    [r·H/tp, (r+1)·H/tp) (and key heads [r·K/tp, (r+1)·K/tp)); (0, 1) without."""
    if not isinstance(weight, DTensor):
        return 0, 1
    mesh = weight.device_mesh
    names = mesh.mesh_dim_names or ()
    if "tp" not in names or getattr(weight.placements[names.index("tp")], "dim", None) != 0:
        return 0, 1
    return mesh.get_local_rank("tp"), mesh.size(names.index("tp"))


def head_shards(model: nn.Module, layers: dict[str, tuple[nn.Module, AttentionHeads]]) -> dict[str, tuple[int, int]]:
    """``{layer: (tensor-parallel index, degree)}`` of each attention layer's query heads (see
    :func:`tensor_parallel_heads`), read from its query weight in ``model``."""
    return {layer: tensor_parallel_heads(query_weight(model.get_submodule(layer))) for layer in layers}


def on_all_heads(
    layer: str, n_heads: int, shard: tuple[int, int], record: Callable[[str, torch.Tensor], None]
) -> Callable[[str, torch.Tensor], None]:
    """``record`` for a layer whose attention sees the ``shard`` = (index r, degree t) of its ``n_heads`` query
    heads (tensor parallelism): the maxima of its H/t local heads go to their global positions [r·H/t, (r+1)·H/t)
    of a vector of H, −inf elsewhere, so the optimizer's MAX all-reduce over all ranks assembles every head."""
    index, degree = shard
    if degree == 1:
        return record

    def on_all(name: str, maxima: torch.Tensor) -> None:
        local = maxima.reshape(-1)
        if local.numel() * degree != n_heads:
            raise ValueError(
                f"QK-clip: attention {layer!r} saw {local.numel()} query heads; with its {n_heads} split over "
                f"tensor parallelism of degree {degree}, it should see {n_heads // degree}"
            )
        full = local.new_full((n_heads,), float("-inf"))
        full[index * local.numel() : (index + 1) * local.numel()] = local
        record(name, full)

    return on_all


_metadata_forwards = 0
"""Above 0 while torch's ``PipelineStage`` runs its metadata-inference forward (see :func:`real_forwards_only`)."""


def _skip_pipeline_metadata_inference() -> None:
    """Wrap ``torch.distributed.pipelining.PipelineStage._forward_metadata_inference`` (once) so that
    :data:`_metadata_forwards` counts the forwards it runs."""
    try:
        from torch.distributed.pipelining.stage import PipelineStage
    except ImportError:
        return
    method = getattr(PipelineStage, "_forward_metadata_inference", None)
    if method is None or getattr(method, "counted_by_qk_clip", False):
        return

    @functools.wraps(method)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _metadata_forwards
        _metadata_forwards += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            _metadata_forwards -= 1

    counted.counted_by_qk_clip = True  # type: ignore[attr-defined]
    PipelineStage._forward_metadata_inference = counted


def real_forwards_only(record: Callable[[str, torch.Tensor], None]) -> Callable[[str, torch.Tensor], None]:
    """``record`` except for the forwards pipeline parallelism runs to learn its stages' shapes: torch's
    ``PipelineStage`` runs each stage once, at the first step, on tensors it allocates without filling
    (``empty_strided``; a stage after the first), whose logits are whatever the memory held (NaN, or huge values
    that would clip heads that never saw them); older torch ran it on the meta device."""
    _skip_pipeline_metadata_inference()

    def recording(layer: str, maxima: torch.Tensor) -> None:
        if _metadata_forwards or maxima.device.type == "meta":
            return
        record(layer, maxima)

    return recording


def whole_model_heads(heads: dict[str, AttentionHeads]) -> dict[str, AttentionHeads]:
    """The attention layers of the whole model: the union of ``heads`` (this rank's model part's) over every
    rank, one ``all_gather_object`` (with pipeline parallelism each stage holds some layers, and the optimizer
    of every rank must name them all, in one order). Raise on every rank where a rank's part holds none, or two
    ranks read one layer differently; without a process group, ``heads`` (none: raise)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        if not heads:
            raise ValueError("QK-clip: the model has no attention layer (no module with an inner_attention)")
        return heads
    gathered: list[dict[str, AttentionHeads] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, heads)
    empty = [rank for rank, part in enumerate(gathered) if not part]
    if empty:
        raise ValueError(
            f"QK-clip: the model part of rank(s) {empty} holds no attention layer (a pipeline stage without "
            "transformer layers?); give every stage at least one layer, or qk_clip_tau = 0"
        )
    whole: dict[str, AttentionHeads] = {}
    for rank, part in enumerate(gathered):
        for layer, layer_heads in (part or {}).items():
            if whole.setdefault(layer, layer_heads) != layer_heads:
                raise ValueError(
                    f"QK-clip: rank {rank} reads attention {layer!r} as {layer_heads}, another rank as {whole[layer]}"
                )
    return whole


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
        seq_dim = 1 if seq_first else 2
        if any(isinstance(t, DTensor) and any(getattr(p, "dim", None) == seq_dim for p in t.placements)
               for t in args[:2]):  # fmt: skip
            raise NotImplementedError(
                f"QK-clip: attention {layer!r} is handed a sequence shard (context parallelism), whose logit maxima "
                "this plug-in does not reproduce; context parallelism is not supported with qk_clip_tau"
            )
        q, k = (t.to_local() if isinstance(t, DTensor) else t for t in args[:2])  # this rank's heads
        q, k = (q.transpose(1, 2), k.transpose(1, 2)) if seq_first else (q, k)
        scale = kwargs.get("scale") or q.shape[-1] ** -0.5
        mask = dense_mask(masks, q.device) if masks is not None else None
        record(layer, max_logits(q, k, scale, mask))

    return hook


def record_maxima(
    layers: dict[str, tuple[nn.Module, AttentionHeads]],
    record: Callable[[str, torch.Tensor], None],
    device: torch.device,
    shards: dict[str, tuple[int, int]] | None = None,
) -> tuple[list, dict[str, str | None]]:
    """Register the hooks that hand each layer's per-head maxima to ``record(layer, maxima)``, from FlexAttention's
    kernel where it can give them on ``device`` (the model's), else by the exact fallback; ``shards``: each
    layer's (tensor-parallel index, degree) of its query heads (:func:`head_shards`; default: all heads local),
    the local heads' maxima handed over at their global positions (:func:`on_all_heads`); none from a pipeline
    stage's metadata-inference forward (:func:`real_forwards_only`). Return the hooks' handles and ``{layer: None on the kernel path, else why the fallback}``."""
    handles, paths = [], {}
    record = real_forwards_only(record)
    for layer, (inner, heads) in layers.items():
        record_layer = on_all_heads(layer, heads.n_heads, (shards or {}).get(layer, (0, 1)), record)
        paths[layer] = qk_clip_kernel.unavailable(inner, device)
        if paths[layer] is None:
            handles += qk_clip_kernel.record_from_kernel(layer, inner, record_layer)
            continue
        # torchtitan 0.3's inner attentions take [batch, seq, heads, d]; 0.2's wrappers [batch, heads, seq, d]
        seq_first = type(inner).__name__ in ("ScaledDotProductAttention", "FlexAttention")
        hook = fallback_hook(layer, seq_first, record_layer)
        handles.append(inner.register_forward_pre_hook(hook, with_kwargs=True))
    return handles, paths


def describe(paths: dict[str, str | None], whole: int | None = None, tensor_parallel: int = 1) -> str:
    """One line saying where the maxima of the layers in ``paths`` come from (:func:`record_maxima`'s); ``whole``:
    the whole model's number of layers where this part holds fewer (pipeline parallelism); ``tensor_parallel``:
    the degree over which each layer's heads are split."""
    kernel = sum(reason is None for reason in paths.values())
    reasons = sorted({reason for reason in paths.values() if reason is not None})
    parts = [f"{kernel} from FlexAttention's kernel (max_scores)"] if kernel else []
    if reasons:
        parts.append(f"{len(paths) - kernel} by the exact fallback, one more Q·Kᵀ each ({'; '.join(reasons)})")
    line = f"QK-clip: logit maxima of {len(paths)} attention layers: " + ", ".join(parts)
    if whole is not None and whole != len(paths):
        line += (
            f" (of the {whole} this part's optimizer clips: the other pipeline stages' maxima come from their ranks)"
        )
    if tensor_parallel > 1:
        line += f"; each rank's 1/{tensor_parallel} of the heads, placed at their global positions"
    return line


def build_with_qk_clip(
    build: Callable[..., Any], model: nn.Module, kwargs: dict[str, Any], name_of: Callable[[str], str] = str
) -> Any:
    """``build(**kwargs)``, the optimizer of one model part; with ``qk_clip_tau`` set, also handed the attention
    heads (``qk_clip_heads``) of the whole model (:func:`whole_model_heads`: with pipeline parallelism, every
    stage's layers, on every rank alike), and the hooks that record the maxima of this part's layers, each at
    its heads' global positions under tensor parallelism (:func:`head_shards`), are registered on the model.
    Every rank calls it as often (once per model part): the heads are gathered over all ranks."""
    if not kwargs.get("qk_clip_tau"):
        return build(**kwargs)
    layers = attention_heads(model, name_of, required=False)
    heads = whole_model_heads({name: heads for name, (_, heads) in layers.items()})
    optimizer = build(**kwargs, qk_clip_heads=heads)
    shards = head_shards(model, layers)
    _, paths = record_maxima(layers, optimizer.record_max_logits, next(model.parameters()).device, shards)
    logger.info(describe(paths, len(heads), max(degree for _, degree in shards.values())))
    return optimizer
