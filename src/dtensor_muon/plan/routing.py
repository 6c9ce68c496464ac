"""Which parameters Muon orthogonalizes and which go to AdamW.

The rule, applied to each parameter in this order (the first that applies decides):

1. The param group's ``"use_muon"``, when set (``True`` or ``False``), decides for every parameter of the group.
2. A parameter with fewer than 2 dims (biases, norm weights, scalars) goes to AdamW.
3. A named parameter goes to AdamW when a component of its dotted name (``"model.embed_tokens.weight"`` →
   ``model``, ``embed_tokens``, ``weight``) is one of :data:`ELEMENTWISE_NAME_COMPONENTS`, the usual names of
   embedding tables and output heads (whole components only: ``heads`` or ``shared_experts`` do not match).
4. Every other parameter goes to Muon: a 2-D matrix; a 3-D ``[E, m, n]`` parameter as E matrices (experts);
   a ≥4-D weight viewed as ``(shape[0], -1)`` (convolutions).

Parameters given without names (``model.parameters()``) skip step 3, so an embedding or output head among
them goes to Muon: the optimizer then warns whenever one of their 2-D matrices goes to the matrix rule by
default (:func:`unnamed_matrices_warning`), naming each by its position in the parameters given and its shape
(``param[7] (7×45)``, :func:`given_label`) and flagging those that look like an embedding or a head
(:func:`unnamed_lookalikes`). An ``nn.Sequential`` model names its layers by position (``"6.weight"``), so its
output layer goes to Muon too; the optimizer warns about it (:func:`sequential_output_layer`), and
:func:`dtensor_muon.muon_param_groups` routes a Sequential's last ``nn.Linear`` to AdamW. Name them
(``model.named_parameters()``), route them by module type with :func:`dtensor_muon.muon_param_groups`, or
put them in a group with ``"use_muon"`` set. Parameters with ``requires_grad=False`` are routed the same way
but get no optimizer state until they require a gradient (see :class:`dtensor_muon.Muon`). The optimizer logs
the outcome (logger ``dtensor_muon``: one INFO line per rule, the full table at DEBUG), in the order the
parameters were given.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

from torch import Tensor

ELEMENTWISE_NAME_COMPONENTS = frozenset(
    {
        # embeddings
        "tok_embeddings",  # torchtitan
        "embed_tokens",  # Hugging Face Llama, Mistral, Qwen
        "embeddings",
        "embedding",
        "embed",
        "embed_in",  # GPT-NeoX, Pythia
        "embed_positions",  # BART, OPT, Whisper
        "token_embedding",  # CLIP
        "token_embeddings",
        "word_embeddings",  # BERT, BLOOM
        "position_embeddings",
        "position_embedding",
        "wte",  # GPT-2
        "wpe",
        "shared",  # T5's tied input/output embedding
        # output heads
        "output",  # torchtitan
        "lm_head",  # Hugging Face causal LMs
        "embed_out",  # GPT-NeoX, Pythia
        "head",  # timm, ViT
        "score",  # Hugging Face *ForSequenceClassification
        "classifier",  # BERT, ViT (Hugging Face)
    }
)

LOOKALIKE_ASPECT = 4
"""An unnamed matrix looks like an embedding or head when its long side exceeds this many times its short side
(and is the longest side of any matrix): vocabularies run 4.1× (GPT-3) to 65× (GPT-2) the model width; most
hidden matrices stay at or below 4× (4× MLPs; SwiGLU 2.6-3.5×), and the wider ones (Gemma 2B's 8× MLP) are
shorter than the vocabulary when the embedding is among the parameters."""


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


def given_label(position: int) -> str:
    """The label of an unnamed parameter: ``param[i]``, ``i`` its position among all the parameters given to the
    optimizer, in the order given (over every group, then each ``add_param_group``): for
    ``Muon(model.parameters())`` it is ``list(model.parameters())[i]``."""
    return f"param[{position}]"


def is_given_label(label: str) -> bool:
    """True when ``label`` is an unnamed parameter's :func:`given_label` (a parameter name has no ``[``)."""
    return label.startswith("param[")


def with_shape(label: str, p: Tensor) -> str:
    """``label`` followed by the shape of ``p``: ``"param[7] (7×45)"``, ``"param[8] (45)"``, ``"param[9] ()"``."""
    return f"{label} ({'×'.join(str(n) for n in p.shape)})"


def unnamed_lookalikes(
    candidates: Sequence[tuple[str, Tensor]], all_matrix_shapes: Sequence[tuple[int, ...]]
) -> list[str]:
    """Which unnamed matrices routed to Muon by default look like an embedding table or an output head.

    A heuristic for the warning only (it never changes routing): a 2-D parameter whose long side is more than
    :data:`LOOKALIKE_ASPECT` times its short side and equals the longest side of any 2-D parameter of the
    optimizer (``all_matrix_shapes``): the vocabulary is the longest dimension of a language model, and a
    grouped-query key/value projection (8× at Llama 70B) is not the longest. Returns ``"label (A×B)"`` strings.
    """
    longest = max((max(s) for s in all_matrix_shapes if len(s) == 2), default=0)
    found = []
    for label, p in candidates:
        if p.ndim != 2:
            continue
        long, short = max(p.shape), min(p.shape)
        if long == longest and long > LOOKALIKE_ASPECT * short:
            found.append(with_shape(label, p))
    return found


def unnamed_matrices_warning(optimizer: str, matrices: Sequence[str], lookalikes: Sequence[str]) -> str:
    """The warning for unnamed 2-D matrices routed to the matrix rule by default.

    ``optimizer``: the front end's class name; ``matrices``: those matrices as ``"param[i] (A×B)"``, in the order
    given (the last is named: a model's output layer is usually its last parameter); ``lookalikes``: those of
    them that :func:`unnamed_lookalikes` flags. Says that an output head or an embedding cannot be recognized
    without names, and the three ways to route one to AdamW.
    """
    me = optimizer
    if len(matrices) == 1:
        which = f"the one matrix, {matrices[0]}, goes to {me}"
    else:
        which = f"all {len(matrices)} matrices go to {me}, the last, {matrices[-1]}, included"
    looks = ""
    if lookalikes:
        verb = "looks" if len(lookalikes) == 1 else "look"
        looks = (
            f"; {', '.join(lookalikes)} {verb} like an embedding or a head (long side > {LOOKALIKE_ASPECT}× the "
            "short one, the longest of any matrix)"
        )
    return (
        f"{me}: parameters were given without names, so a classifier or output head (or an embedding) cannot be "
        f"recognized: {which} (the output layer, if the model ends in a Linear){looks}. Heads and embeddings "
        f"belong to AdamW: pass {me}(model.named_parameters()) (names such as output, lm_head, head, classifier "
        f"go to AdamW) or {me}(dtensor_muon.muon_param_groups(model)), or put the head in a group with "
        f'"use_muon": False: {me}([{{"params": body}}, {{"params": head.parameters(), "use_muon": False}}]). '
        f'param[i] is list(model.parameters())[i]; a group with "use_muon": True keeps its matrices on {me} '
        "without this warning."
    )


SEQUENTIAL_WEIGHT = re.compile(r"(\d+\.)+weight")
"""The name of a layer's weight in a model that is an ``nn.Sequential`` (nested ones too): positions only."""


def sequential_output_layer(named: Sequence[tuple[str, Tensor]]) -> tuple[str, Tensor] | None:
    """Of ``named`` (an optimizer's named parameters), the 2-D one whose name is positions only
    (:data:`SEQUENTIAL_WEIGHT`: ``"6.weight"``, ``"2.1.weight"``) at the largest position: the output layer of
    an ``nn.Sequential`` model whose last layer is a Linear. None when no name has that form."""
    found = [(name, p) for name, p in named if p.ndim == 2 and SEQUENTIAL_WEIGHT.fullmatch(name)]
    if not found:
        return None
    return max(found, key=lambda item: tuple(int(part) for part in item[0].split(".")[:-1]))


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The directory of the whole dtensor_muon package (this module is in its ``plan/``)."""


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` issued by the function calling this point at the first
    frame outside this package (the user's line, not the library's)."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(PACKAGE_DIR + os.sep):
        frame = frame.f_back
        level += 1
    return level


def name_patterns(members: list[tuple[str, Tensor]]) -> str:
    """Names with numeric components as ``*`` (``layers.*.attention.wq.weight ×32``), in first-seen order; an
    unnamed parameter's label (:func:`given_label`, with or without its shape) is kept as it is."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    for label, _ in members:
        pattern = label if is_given_label(label) else re.sub(r"(?<![^.])\d+(?![^.])", "*", label)
        counts[pattern] = counts.get(pattern, 0) + 1
        first.setdefault(pattern, label)
    return ", ".join(f"{pattern} ×{n}" if n > 1 else first[pattern] for pattern, n in counts.items())
