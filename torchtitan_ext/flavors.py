"""Cut-down flavors of real models for torchtitan 0.2.x: a real flavor's dimensions with fewer layers.

Importing :mod:`torchtitan_ext` (``[experimental] custom_import = "torchtitan_ext"``, or the launcher
``python -m torchtitan_ext.train``) adds them to torchtitan's flavor tables, next to the flavors they come from:

============  ==================  ============  ==========================================================
model         flavor              from          what it keeps
============  ==================  ============  ==========================================================
llama3        ``8B_2layers``      ``8B``        dim 4096, 32 heads (8 KV), FFN 14336, vocab 128256
qwen3         ``30B-A3B_2layers`` ``30B-A3B``   dim 2048, 32 heads (4 KV), 128 experts of 768 (top 8),
                                                vocab 151936: both layers MoE
deepseek_v3   ``16B_2layers``     ``16B``       dim 2048, MLA (16 heads, kv rank 512), 64 routed + 2 shared
                                                experts of 1408 (top 6), vocab 102400: layer 0 dense (FFN
                                                10944), layer 1 MoE
============  ==================  ============  ==========================================================

Each is ``dataclasses.replace`` of a deep copy of the real flavor's arguments with ``n_layers = 2`` and nothing
else changed: every matrix has the real model's shape (the optimizer's work per layer is the real one's), and a
DeepSeek-V3 flavor keeps ``n_dense_layers`` (1) below ``n_layers`` so that one MoE layer remains. The vocabulary
stays the real one: torchtitan 0.2.2 takes ``vocab_size`` from the flavor, not from the tokenizer, and the
offline tokenizer (:mod:`torchtitan_ext.data`, 2048 tokens) only uses the first ids, so no matching tokenizer is
needed; the unused embedding and output rows still cost their memory and their AdamW state.

:func:`cut_down` makes another one (``cut_down("llama3", "8B", 4)`` is ``8B_4layers``) for a module of your
own named by ``[experimental] custom_import``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from importlib import import_module
from typing import Any

FLAVOR_TABLES = {"llama3": "llama3_args", "qwen3": "qwen3_args", "deepseek_v3": "deepseekv3_args"}
"""The module-level flavor dict of each model package (``torchtitan.models.<model>.<dict>``), as torchtitan 0.2.2
names them; the model's train spec holds the same dict (``TrainSpec.model_args``)."""

CUT_DOWN: tuple[tuple[str, str, int], ...] = (
    ("llama3", "8B", 2),
    ("qwen3", "30B-A3B", 2),
    ("deepseek_v3", "16B", 2),
)
"""``(model, real flavor, layers)`` of the flavors registered at import."""


def flavor_name(flavor: str, n_layers: int) -> str:
    """The name of ``flavor`` cut to ``n_layers`` layers: ``8B`` → ``8B_2layers``."""
    return f"{flavor}_{n_layers}layers"


def flavor_table(model: str) -> dict[str, Any]:
    """torchtitan's flavor dict of ``model`` (one of :data:`FLAVOR_TABLES`)."""
    return getattr(import_module(f"torchtitan.models.{model}"), FLAVOR_TABLES[model])


def cut_down_args(args: Any, n_layers: int) -> Any:
    """A copy of the model arguments ``args`` with ``n_layers`` layers, nothing else changed; for a model with
    dense leading layers (DeepSeek-V3's ``n_dense_layers``) at least one layer must stay MoE."""
    if n_layers < 1:
        raise ValueError(f"n_layers must be >= 1, got {n_layers}")
    if n_layers > args.n_layers:
        raise ValueError(f"n_layers = {n_layers} exceeds the flavor's {args.n_layers} layers")
    dense = getattr(args, "n_dense_layers", None)
    if dense is not None and dense >= n_layers:
        raise ValueError(f"n_layers = {n_layers} leaves no MoE layer: the first {dense} layers are dense")
    # a deep copy: update_from_config() writes into nested arguments (moe_args), which must not be the real flavor's
    return dataclasses.replace(copy.deepcopy(args), n_layers=n_layers)


def cut_down(model: str, flavor: str, n_layers: int) -> str:
    """Add ``flavor`` of ``model`` cut to ``n_layers`` layers to torchtitan's flavor dict (replacing an entry of
    the same name); return its name (:func:`flavor_name`)."""
    table = flavor_table(model)
    if flavor not in table:
        raise ValueError(f"{model} has no flavor {flavor!r}; its flavors: {', '.join(table)}")
    name = flavor_name(flavor, n_layers)
    table[name] = cut_down_args(table[flavor], n_layers)
    return name


def register_all() -> list[str]:
    """Register the flavors of :data:`CUT_DOWN` whose model and real flavor the installed torchtitan has; return
    them as ``model/flavor``."""
    names = []
    for model, flavor, layers in CUT_DOWN:
        try:
            table = flavor_table(model)
        except (ImportError, AttributeError):
            continue
        if flavor in table:
            names.append(f"{model}/{cut_down(model, flavor, layers)}")
    return names


def flavor_problem(model: str, flavor: str) -> str | None:
    """Why torchtitan cannot build ``[model] name``/``flavor``, in one line, or None: an unknown model or a
    flavor its train spec does not have (the closest flavor suggested). Call it after the job's
    ``custom_import`` (which may register both)."""
    from torchtitan.protocols.train_spec import get_train_spec

    try:
        flavors = get_train_spec(model).model_args
    except ValueError as exc:
        return f"[model] name = {model!r} is not valid: {exc}"
    except ImportError:  # an experiment whose own requirements are missing: torchtitan will say which
        return None
    if flavor in flavors:
        return None
    close = difflib.get_close_matches(flavor, list(flavors), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"[model] flavor = {flavor!r} is not a flavor of {model}{hint}; its flavors: {', '.join(flavors)}"
