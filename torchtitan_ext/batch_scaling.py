"""``[batch_scaling]``: ``[optimizer] lr`` moved to this run's global batch by the square-root rule.

With ``reference_batch_size = R`` (sequences) and ``reference_seq_len = S_ref`` (0: this run's), a run whose
global batch is G sequences of S tokens trains at

    lr · √((G·S) / (R·S_ref))        (:func:`dtensor_muon.batch_scaled_lr`)

G is ``[training] global_batch_size``, or ``local_batch_size`` × the data-parallel degree (replicate × shard)
when that is -1, as torchtitan counts it. The scaled lr replaces ``[optimizer] lr`` before any optimizer is
built (the matrix optimizers and AdamW, torchtitan's Adam/AdamW too; schedulers scale from it), and rank 0
logs it once.
"""

from typing import Any

import torch.distributed as dist

from dtensor_muon import batch_scaled_lr

APPLIED = "_batch_scaling_applied"
"""Attribute set on the ``[optimizer]`` object once its lr is scaled (the scaling runs once per job)."""


def global_batch_size(job_config: Any, parallel_dims: Any) -> int:
    """The global batch in sequences, as torchtitan's trainer computes it."""
    size = job_config.training.global_batch_size
    if size < 0:
        degree = parallel_dims.dp_replicate * parallel_dims.dp_shard if parallel_dims is not None else 1
        size = job_config.training.local_batch_size * degree
    return size


def apply_batch_scaling(job_config: Any, parallel_dims: Any) -> str | None:
    """Scale ``job_config.optimizer.lr`` in place when ``[batch_scaling] reference_batch_size`` > 0; returns the
    line rank 0 logged (None when off or already applied)."""
    section = getattr(job_config, "batch_scaling", None)
    if section is None or section.reference_batch_size == 0 or getattr(job_config.optimizer, APPLIED, False):
        return None
    seq_len = job_config.training.seq_len
    tokens = global_batch_size(job_config, parallel_dims) * seq_len
    reference = section.reference_batch_size * (section.reference_seq_len or seq_len)
    lr = job_config.optimizer.lr
    scaled = batch_scaled_lr(lr, tokens, reference)
    job_config.optimizer.lr = scaled
    setattr(job_config.optimizer, APPLIED, True)
    line = (
        f"[batch_scaling] lr {lr:g} -> {scaled:.6g}: x sqrt(B/B_ref) = sqrt({tokens:,} / {reference:,} tokens) "
        f"= {(tokens / reference) ** 0.5:.4g} (global batch {tokens // seq_len} x seq_len {seq_len})"
    )
    if not dist.is_initialized() or dist.get_rank() == 0:
        from torchtitan.tools.logging import logger

        logger.info(line)
    return line
