"""The CPU path: torchtitan 0.3's unchanged trainer on CPU processes that talk through gloo.

torchtitan 0.3, like 0.2, picks its device once, at import, and falls back to CUDA where no accelerator is
found; it also has no attention for language models that trains on a CPU (SDPA is gone; FlexAttention,
compiled, has no backward pass there). :func:`use_cpu_gloo` prepares a process, before the trainer is built:

- ``device_type``/``device_module`` in the modules that copied them at import become ``"cpu"``/``torch.cpu``
  (``init_process_group`` then picks gloo, the CPU's default backend);
- the CUDA memory monitor becomes :class:`torchtitan_ext.cpu.CpuMemoryMonitor` (peak resident set size);
- ``set_pg_timeouts`` (its barrier passes CUDA device ids) is skipped: the process groups keep their start-up
  timeout;
- ``torch.histc`` counts integer CPU tensors (MoE routers count expert indices with it on CUDA);
- attention: :func:`dense_flex_attention` replaces ``FlexAttention.forward``. It evaluates the same
  ``mask_mod`` of the ``BlockMask`` the model built (torchtitan's causal and packed-document mask) on the full
  query × key grid and runs a dense softmax attention with it: the same function as FlexAttention's, at
  O(L²) memory, with a backward pass. The masks are built by an eager ``create_block_mask`` (the compiled
  one needs a C++ toolchain and compiles in every process).

:func:`with_sum_reduction` wraps a model spec's ``parallelize_fn`` so that FSDP2 reduces gradients with SUM
and divides afterwards: gloo has no AVG or PREMUL_SUM reduction (torchtitan 0.3 calls ``fully_shard`` with
lists of modules; every FSDP module of the result is set).

This is the CPU path for tests and small demonstrations: on GPUs none of it is applied.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from torchtitan_ext.cpu import CpuMemoryMonitor, histc_any_dtype, use_sum_reduction

DEVICE_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.tools.profiler",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.components.metrics",
    "torchtitan.models.common.token_dispatcher",
)
"""torchtitan 0.3 modules that copy ``device_type``/``device_module`` from ``tools.utils`` at import."""

SPMD_BACKEND = "partial_dtensor"
"""The ``parallelism.spmd_backend`` of CPU runs. torchtitan 0.3's default, ``spmd_types`` (and
``full_dtensor``), gives ``fully_shard`` plain-tensor parameters with ``dp_mesh_dims`` under torch 2.13 and
stops there (under torch 2.14.1 both run); ``partial_dtensor`` (DTensors for tensor and expert parallelism,
FSDP2 on its own mesh, the layouts the tests cover) runs under both."""

CPU_ARGS = ("--parallelism.spmd_backend", SPMD_BACKEND, "--training.disable_cuda_graphs")
"""Arguments the launcher puts before the user's on CPU: :data:`SPMD_BACKEND`, and no CUDA graphs (without that,
torchtitan refuses expert parallelism with its all-to-all token dispatcher when it checks the config)."""


def _keep_start_up_timeouts(*args: Any, **kwargs: Any) -> None:
    """Replaces ``set_pg_timeouts`` on CPU (its barrier takes CUDA device ids)."""


def _index_grid(batch: int, heads: int, q_len: int, kv_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Broadcastable (b, h, q_idx, kv_idx) index tensors of a [batch, heads, q_len, kv_len] score grid."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)
    q_idx = torch.arange(q_len, device=device).view(1, 1, q_len, 1)
    kv_idx = torch.arange(kv_len, device=device).view(1, 1, 1, kv_len)
    return b, h, q_idx, kv_idx


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    *,
    score_mod: Callable[..., torch.Tensor] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FlexAttention's function on ``(B, N, L, H)`` tensors, computed densely: ``(out, lse)`` (lse only when
    asked for). The mask is ``block_mask.mask_mod`` on every (b, h, q, kv); ``score_mod`` is applied to the
    scaled scores as FlexAttention does."""
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    mask = create_mask(block_mask.mask_mod, batch, 1, q_len, kv_len, device=q.device)
    if score_mod is None and not return_lse:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out, None
    if enable_gqa and k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if score_mod is not None:
        scores = score_mod(scores, *_index_grid(batch, heads, q_len, kv_len, q.device))
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = (torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)) @ v
    return out, lse


def dense_flex_attention(
    self: nn.Module,
    q_BLNH: torch.Tensor,
    k_BLNH: torch.Tensor,
    v_BLNH: torch.Tensor,
    *,
    attention_masks: BlockMask,
    score_mod: Callable[..., torch.Tensor] | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    out_transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``FlexAttention.forward`` on the CPU path: the same arguments (their names too: torchtitan's local-map
    wrapper reads them) and result, through :func:`dense_attention`."""
    if not isinstance(attention_masks, BlockMask):
        raise TypeError(f"attention_masks must be a BlockMask, got {type(attention_masks).__name__}")
    q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
    out, lse = dense_attention(
        q, k, v, attention_masks, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa,
        return_lse=out_transform is not None,
    )  # fmt: skip
    out_BLNH = out.transpose(1, 2)
    if out_transform is None:
        return out_BLNH
    return out_transform(out_BLNH, lse.transpose(1, 2))


def eager_attention_mask(*args: Any, **kwargs: Any) -> BlockMask:
    """torchtitan's ``create_attention_mask`` without ``torch.compile``."""
    return create_block_mask(*args, **kwargs)


def use_cpu_gloo() -> None:
    """Prepare this process's torchtitan for the CPU and gloo (see the module docstring). Idempotent."""
    for name in DEVICE_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = torch.cpu
    from torchtitan.components import metrics
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common import attention, decoder

    metrics.build_device_memory_monitor = CpuMemoryMonitor
    dist_utils.set_pg_timeouts = _keep_start_up_timeouts
    torch.histc = histc_any_dtype
    decoder.create_attention_mask = eager_attention_mask
    attention.FlexAttention.forward = dense_flex_attention


def with_sum_reduction(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``parallelize_fn`` followed by :func:`torchtitan_ext.cpu.use_sum_reduction` (SUM reductions on gloo)."""
    if getattr(parallelize_fn, "sum_reduction", False):
        return parallelize_fn

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        model = parallelize_fn(model, *args, **kwargs)
        use_sum_reduction(model)
        return model

    parallelize.sum_reduction = True
    return parallelize
