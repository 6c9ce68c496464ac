"""The dispatch's tuned constants by name, set around a block: how benchmarks and tools vary the dispatch.

    with settings({"MIN_SYRK_DIM": 512}, backend="syrk", gluon=False):
        ...  # Newton–Schulz with those constants, the SYRK kernels forced, the Gluon kernel off

Names (:data:`TUNABLES`): the Gluon kernel's (``WS_MIN_WORK``, ``WS_MAX_DIM``, ``TURN_LEAD``, ``STAGES``), the
SYRK floors (``MIN_SYRK_DIM``, ``MIN_SYRK_TILES``, ``MIN_SMALL_SYRK_TILES``, ``MIN_GLUON_SYRK_DIM``,
``MIN_GLUON_SYRK_TILES``), ``KEEP_LOWER_TILES`` (Gram chains on lower tiles, 1 or 0), the dispatch's
(``MIN_GPU_BACKEND_WORK``, the Gram form's aspects and work floors), ``MAX_GRAPH_WORK``, ``STACK_MAX_SIDE``
(which units stack), ``GATHER_MAX_UNITS`` (which of a holder's units stack across parameters),
``MIN_KERNEL_NUMEL`` (the smallest shard the fused element-wise kernels take), ``MIN_LIST_MEAN_NUMEL`` (the
fewest entries a shard, on average, for one launch over a list of smaller shards) and ``SPLIT_LISTS`` (whether
a list's largest shards take that launch when the whole list is below it, 1 or 0); docs/kernels.md "Measured
constants" and each constant's docstring say what it is and how it was chosen.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import ModuleType

from dtensor_muon.kernels import batching, dispatch, elementwise, shard_lists, triton_matmuls, use_backend, ws_syrk
from dtensor_muon.linalg import ns_graphs

TUNABLES: dict[str, ModuleType] = {
    **dict.fromkeys(("WS_MIN_WORK", "WS_MAX_DIM", "TURN_LEAD", "STAGES"), ws_syrk),
    **dict.fromkeys(
        (
            "MIN_SYRK_DIM",
            "MIN_SYRK_TILES",
            "MIN_SMALL_SYRK_TILES",
            "MIN_GLUON_SYRK_DIM",
            "MIN_GLUON_SYRK_TILES",
            "KEEP_LOWER_TILES",
        ),
        triton_matmuls,
    ),
    **dict.fromkeys(
        (
            "MIN_GPU_BACKEND_WORK",
            "GRAM_MIN_ASPECT",
            "MIN_GRAM_PRODUCT_WORK",
            "GRAM_SMALL_DIM",
            "GRAM_MIN_ASPECT_SMALL",
            "MIN_GRAM_PRODUCT_WORK_SMALL",
        ),
        dispatch,
    ),
    "MAX_GRAPH_WORK": ns_graphs,
    "STACK_MAX_SIDE": batching,
    "GATHER_MAX_UNITS": batching,
    "MIN_KERNEL_NUMEL": elementwise,
    "MIN_LIST_MEAN_NUMEL": shard_lists,
    "SPLIT_LISTS": shard_lists,
}


def number(text: str) -> float:
    """An integer, a float or ``a**b``."""
    if "**" in text:
        base, exponent = text.split("**")
        return int(base) ** int(exponent)
    try:
        return int(text)
    except ValueError:
        return float(text)


@contextlib.contextmanager
def settings(constants: dict[str, float], backend: str | None = None, gluon: bool | None = None) -> Iterator[None]:
    """The constants set on their modules, the backend forced and the Gluon kernel on or off, inside the block."""
    saved = {name: getattr(TUNABLES[name], name) for name in constants}
    with contextlib.ExitStack() as stack:
        if backend is not None:
            stack.enter_context(use_backend(backend))
        if gluon is not None:
            stack.enter_context(ws_syrk.ws_syrk_enabled(gluon))
        try:
            for name, value in constants.items():
                setattr(TUNABLES[name], name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(TUNABLES[name], name, value)
