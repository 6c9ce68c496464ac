"""Which parameters Muon orthogonalizes and which go to AdamW.

Rule, in order: a param group's explicit ``"use_muon"`` wins; parameters with ndim < 2 go to AdamW; named
embeddings and output heads (a dotted-name component in :data:`ELEMENTWISE_NAME_COMPONENTS`) go to AdamW;
every other parameter (2-D matrices, 3-D expert batches, ≥4-D weights) goes to Muon.
"""

from __future__ import annotations

from torch import Tensor

ELEMENTWISE_NAME_COMPONENTS = frozenset(
    {
        "tok_embeddings",
        "embed_tokens",
        "embeddings",
        "embedding",
        "word_embeddings",
        "position_embeddings",
        "wte",
        "wpe",
        "output",
        "lm_head",
    }
)


def is_embedding_or_head(name: str) -> bool:
    """True when a component of the dotted ``name`` names an embedding table or an output head."""
    return any(part in ELEMENTWISE_NAME_COMPONENTS for part in name.split("."))


def uses_muon(name: str | None, param: Tensor, explicit: bool | None) -> bool:
    """The routing decision for one parameter (see module docstring)."""
    if explicit is not None:
        return bool(explicit)
    if param.ndim < 2:
        return False
    if name is not None and is_embedding_or_head(name):
        return False
    return True
