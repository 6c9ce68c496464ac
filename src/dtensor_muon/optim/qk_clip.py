"""QK-clip in the optimizer: per-head maxima recorded during a step's forward passes, one MAX all-reduce, then
each rank scales its own rows of every query and key weight (the factors: :mod:`dtensor_muon.rules.qk_clip`).

The model hands over the maxima (``optimizer.record_max_logits(layer, max_logits)``: one float per head, the
largest softmax input this rank saw, the attention's scale included) any number of times per step: gradient
accumulation, pipeline micro-batches and recomputation all keep the maximum. At ``step()``, after the update,
every configured layer's maxima (−inf where this rank recorded none, e.g. a pipeline stage without that layer:
give every rank the same ``qk_clip_heads``, the whole model's layers, which construction checks) go into one
tensor, all-reduced with MAX over every rank: one collective per step whatever the number of layers.
Each rank then multiplies the rows it holds of each query and key weight by their factors, wherever the layout
puts them (the global rows of a shard come from its box: FSDP's uneven shards, tensor parallelism, FSDP over
tensor parallelism), so every rank's pieces together equal the whole weight clipped in one process. With
``overlap=True`` a weight whose update is still in flight is scaled right after that update lands (in the hook
before its module's forward, or at a flush), so no forward sees it unclipped. A skipped step (a non-finite gradient
with ``skip_nonfinite``) clips nothing; the recorded maxima are dropped either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..distributed import consensus
from ..distributed.layout import local, read_layout
from ..rules.qk_clip import AttentionHeads, row_factors


class QKClip:
    """τ, α and the attention layers (``{layer name: AttentionHeads}``) of one optimizer; see the module."""

    def __init__(self, tau: float, alpha: float, heads: dict[str, AttentionHeads]) -> None:
        self.tau = float(tau)
        self.alpha = float(alpha)
        self.layers = dict(sorted(heads.items()))  # one order on every rank: the packed tensor's
        self._recorded: dict[str, Tensor] = {}
        self.metrics: dict[str, float] = {}

    def check_same_everywhere(self, device: torch.device, what: str) -> None:
        """Raise on every rank, naming the first difference, unless all ranks hold the same τ, α and layers (the
        all-reduce packs the layers' maxima in one order: a difference would mix them up or hang it)."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        description = [("option qk_clip_tau", self.tau), ("option qk_clip_alpha", self.alpha)]
        description += [(f"option qk_clip_heads[{layer!r}]", repr(heads)) for layer, heads in self.layers.items()]
        consensus.check_same_everywhere(description, None, device, what)

    def check_params(self, params: dict[str, Tensor]) -> None:
        """Raise ValueError unless each layer's two weights are both among ``params`` or both absent (another
        pipeline stage's), at least one layer is present, and each present weight has the rows its heads need."""
        present = 0
        for layer, heads in self.layers.items():
            found = [name in params for name in (heads.q, heads.k)]
            if any(found) and not all(found):
                missing = heads.q if not found[0] else heads.k
                raise ValueError(f"qk_clip_heads[{layer!r}]: parameter {missing!r} is not one of this optimizer's")
            if not any(found):
                continue
            present += 1
            for name, rows in heads.row_counts().items():
                shape = tuple(params[name].shape)
                if len(shape) != 2 or shape[0] != rows:
                    raise ValueError(
                        f"qk_clip_heads[{layer!r}]: parameter {name!r} of shape {shape} should be a 2-D weight "
                        f"with {rows} rows for its heads"
                    )
        if not present:
            raise ValueError(
                "qk_clip_heads: none of its layers' weights are parameters of this optimizer; name them as "
                f"the optimizer sees them (named parameters), e.g. {next(iter(self.layers.values())).q!r}"
            )

    def record(self, layer: str, max_logits: Tensor) -> None:
        """Keep the elementwise maximum of this layer's per-head maxima over the calls of this step."""
        heads = self.layers.get(layer)
        if heads is None:
            raise KeyError(f"record_max_logits: unknown layer {layer!r}; qk_clip_heads has {sorted(self.layers)}")
        values = max_logits.detach().reshape(-1).float()
        if values.numel() != heads.n_heads:
            raise ValueError(
                f"record_max_logits({layer!r}): expected {heads.n_heads} per-head maxima, got {values.numel()}"
            )
        if isinstance(values, DTensor):
            values = values.full_tensor()
        before = self._recorded.get(layer)
        self._recorded[layer] = values if before is None else torch.maximum(before, values.to(before.device))

    def _global_maxima(self, device: torch.device) -> Tensor:
        """Every layer's maxima in one float32 tensor, the MAX over all ranks (one all-reduce)."""
        parts = [
            self._recorded[layer].to(device)
            if layer in self._recorded
            else torch.full((heads.n_heads,), float("-inf"), device=device)
            for layer, heads in self.layers.items()
        ]
        packed = torch.cat(parts)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        return packed

    @torch.no_grad()
    def row_factors(self, params: dict[str, Tensor], device: torch.device, skipped: bool) -> dict[str, Tensor]:
        """After the step's update: the all-reduce, then the factors of every row of each weight of ``params``
        that a clipped head touches (none when ``skipped``, which every rank decides alike)."""
        if skipped:
            self._recorded, self.metrics = {}, {}
            return {}
        maxima = self._global_maxima(device).cpu()
        self._recorded = {}
        factors: dict[str, Tensor] = {}
        clipped, offset = 0, 0
        for heads in self.layers.values():
            s = maxima[offset : offset + heads.n_heads]
            offset += heads.n_heads
            over = int((s > self.tau).sum())
            clipped += over
            if over and heads.q in params:
                factors.update(row_factors(heads, s, self.tau, self.alpha))
        self.metrics = {"muon/qk_clip/max_logit": float(maxima.max()), "muon/qk_clip/heads_clipped": float(clipped)}
        return factors


@torch.no_grad()
def scale_rows(name: str, p: Tensor, factors: Tensor) -> None:
    """Multiply the rows this rank holds of weight ``p`` by their factors, in ``p``'s dtype."""
    start, stop = read_layout(name, p).local_box[0] if isinstance(p, DTensor) else (0, p.shape[0])
    shard = local(p)
    if stop > start:
        shard.mul_(factors[start:stop].to(device=shard.device, dtype=shard.dtype)[:, None])
