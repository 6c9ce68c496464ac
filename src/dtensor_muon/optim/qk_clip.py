"""QK-clip in the optimizer: per-head maxima recorded during a step's forward passes, one MAX all-reduce, then
each rank scales its own rows of every query and key weight (the factors: :mod:`dtensor_muon.rules.qk_clip`).

The model hands over the maxima (``optimizer.record_max_logits(layer, max_logits)``: one float per head, the
largest softmax input this rank saw, the attention's scale included) any number of times per step: gradient
accumulation, pipeline micro-batches and recomputation all keep the maximum. At ``step()``, after the update,
every configured layer's maxima (−inf where this rank recorded none, e.g. a pipeline stage without that layer:
give every rank the same ``qk_clip_heads``, the whole model's layers, which construction checks) go into one
tensor, all-reduced with MAX over every rank: one collective per step whatever the number of layers, issued before
the update so that it runs beside it. After the update each rank multiplies the rows it holds of each query and
key weight by their factors (1 for a head at or below τ, which leaves its rows bit for bit as they are), wherever
the layout
puts them (the global rows of a shard come from its box: FSDP's uneven shards, tensor parallelism, FSDP over
tensor parallelism), so every rank's pieces together equal the whole weight clipped in one process. The factors
are computed on the weights' device and every layer's weights are scaled, clipped or not: nothing waits for the
device to tell which heads exceeded τ, so ``step()`` returns as soon as its work is queued. The metrics (largest
logit, heads clipped) are read from the device only when asked for. With
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
        self._maxima: Tensor | None = None  # this step's global maxima, between reduce() and row_factors()
        self._last: Tensor | None = None  # the last clipped step's global maxima, for the metrics
        self._metrics: dict[str, float] = {}

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

    @torch.no_grad()
    def reduce(self, device: torch.device) -> None:
        """Before the step's update: every layer's maxima in one float32 tensor on ``device``, the MAX over all
        ranks (the one all-reduce). The recorded maxima are kept until :meth:`row_factors` uses them, so a step
        that raises before it reduces them again."""
        parts = [
            self._recorded[layer].to(device)
            if layer in self._recorded
            else torch.full((heads.n_heads,), float("-inf"), device=device)
            for layer, heads in self.layers.items()
        ]
        packed = torch.cat(parts)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        self._maxima = packed

    @torch.no_grad()
    def row_factors(self, params: dict[str, Tensor], skipped: bool) -> dict[str, Tensor]:
        """After the step's update: the factors of every row of each layer's weights among ``params``, on the
        device of :meth:`reduce` (none when ``skipped``, which every rank decides alike)."""
        maxima, self._maxima, self._recorded = self._maxima, None, {}
        if maxima is None:
            raise RuntimeError("QK-clip: row_factors() before reduce() in this step")
        if skipped:
            self._last, self._metrics = None, {}
            return {}
        self._last, self._metrics = maxima, {}
        factors: dict[str, Tensor] = {}
        offset = 0
        for heads in self.layers.values():
            if heads.q in params:
                factors.update(row_factors(heads, maxima[offset : offset + heads.n_heads], self.tau, self.alpha))
            offset += heads.n_heads
        return factors

    @property
    def metrics(self) -> dict[str, float]:
        """The last step's largest logit over all heads and its number of heads above τ (read from the device
        the first time they are asked for; empty after a skipped step)."""
        if self._last is not None and not self._metrics:
            self._metrics = {
                "muon/qk_clip/max_logit": float(self._last.max()),
                "muon/qk_clip/heads_clipped": float((self._last > self.tau).sum()),
            }
        return self._metrics


@torch.no_grad()
def scale_rows(name: str, p: Tensor, factors: Tensor) -> None:
    """Multiply the rows this rank holds of weight ``p`` by their factors, in ``p``'s dtype."""
    start, stop = read_layout(name, p).local_box[0] if isinstance(p, DTensor) else (0, p.shape[0])
    shard = local(p)
    if stop > start:
        shard.mul_(factors[start:stop].to(device=shard.device, dtype=shard.dtype)[:, None])
