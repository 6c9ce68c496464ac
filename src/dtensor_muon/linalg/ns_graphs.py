"""Newton–Schulz replayed from CUDA graphs: one graph per input signature, its launches' host cost paid once.

Eagerly, one call on the GPU backend launches 15–20 kernels (three products per iteration, the start, the
allocations), each of which costs the host tens of microseconds: on a large matrix the host's launches take
a good part of the GPU's time, and on a smaller one the host sets the pace (docs/kernels.md "CUDA graphs below
2³⁶ multiply-adds"). A graph replays the iterations with one launch.

Per call, with the graph of that signature captured:

    start from G                  written eagerly into the graph's start buffers (X₀, or round(G) and the
                                  per-matrix scale the first products fold in: ``Backend.start_into``)
    replay                        the iterations, exactly the kernels and configs of the eager call, and for
                                  a tall G the copy of X back into G's orientation (contiguous, as a tall
                                  parameter's shard and update buffer are laid out: the apply or the unpack
                                  would otherwise copy the transposed view, one launch more per call)
    O = copy of the graph's output (the next replay overwrites it), or the output itself for a caller that
        uses it at once (``borrow=True``)

so the result equals :func:`.newton_schulz.newton_schulz`'s bit for bit. A caller that assembles its input anyway
(the owner of a unit, from the pieces the exchange brought) can assemble it in the runner's staging buffer for
that shape (:meth:`NewtonSchulzGraphs.staging_buffer`): where the start folds a scale into the first products
(``Backend.start_scale``: the SYRK route, the input already in the working dtype), that call's graph reads the
buffer in place, and the start only computes the per-matrix scale, one read instead of a read and a write.

The first call of a signature runs eagerly (it tunes and compiles every kernel the graph will hold) and then
captures. Graphs are used on CUDA inputs of either backend (the torch backend takes the small matrices, below
``MIN_GPU_BACKEND_WORK``, whose 15 products per call are the most launch-bound of all: Qwen3-30B-A3B's 512×2048
keys and values and its 128×2048 router) and for at most MAX_GRAPH_WORK multiply-adds per Gram matrix: above it
the GPU work outlasts the host's launches by far, and the graph would only add the output copy and hold its
buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..kernels import Backend, forced_backend, gram_work
from ..kernels.shapes import decision_batch
from .newton_schulz import (
    KELLER_COEFFICIENTS,
    CoefficientSpec,
    in_layout_of,
    iterate,
    iteration_schedule,
    newton_schulz,
    normalized_start,
)

# Chosen by measurement: docs/kernels.md "CUDA graphs below 2³⁶ multiply-adds" (re-measure: tools/kernels/ns_variants.py)
MAX_GRAPH_WORK = 2**36


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    start: Tensor  # the start's buffer, in g's layout: the graph reads it
    x: Tensor  # its wide working view
    scale: Tensor | None  # the per-matrix scale folded into the first products, if any: the graph reads it
    out: Tensor  # the graph's result in g's orientation (contiguous): the graph writes it
    backend: Backend
    reads_input: bool  # start is the caller's staging buffer itself, read in place: only the scale is computed


class NewtonSchulzGraphs:
    """Callable like :func:`.newton_schulz.newton_schulz`; replays a CUDA graph per input signature (shape,
    strides, dtype, device, schedule, working dtype, algorithm, forced backend, the dispatch's decision batch)
    where one pays.

    Each captured graph holds its intermediates (a few matrices of the input's size) for the life of this
    object. Inputs off CUDA, above MAX_GRAPH_WORK, or arriving while the current stream is itself being
    captured run eagerly.
    """

    def __init__(self) -> None:
        self._captured: dict[tuple, _Captured | None] = {}
        self._staging: dict[tuple, Tensor] = {}

    def __len__(self) -> int:
        """Graphs captured so far."""
        return sum(c is not None for c in self._captured.values())

    def staging_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """A contiguous buffer of ``shape`` and ``dtype`` for the caller to write its next input into, kept for the
        life of this object (one per shape, dtype and device); None off CUDA and above MAX_GRAPH_WORK, where no
        graph replays. A call on the buffer (or a contiguous tensor of the same shape on its memory) reads it in
        place where the start folds a scale, the same bits as a call on a copy. The graph reads it when it runs:
        write the buffer again only after the call on it has been enqueued, on the same stream."""
        device = torch.device(device)
        if device.type != "cuda":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        probe = torch.empty(shape, dtype=dtype, device="meta")
        if probe.ndim not in (2, 3) or gram_work(in_layout_of(probe, probe)) > MAX_GRAPH_WORK:
            return None
        key = (tuple(shape), dtype, device)
        if key not in self._staging:
            self._staging[key] = torch.empty(shape, dtype=dtype, device=device)
        return self._staging[key]

    def _is_staging(self, g: Tensor) -> bool:
        """Whether ``g`` is the staging buffer of its shape (:meth:`staging_buffer`), as a contiguous tensor."""
        buffer = self._staging.get((tuple(g.shape), g.dtype, g.device))
        return buffer is not None and g.data_ptr() == buffer.data_ptr() and g.stride() == buffer.stride()

    def __call__(
        self,
        g: Tensor,
        coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
        steps: int = 5,
        eps: float = 1e-7,
        dtype: torch.dtype = torch.bfloat16,
        algorithm: str = "auto",
        *,
        borrow: bool = False,
    ) -> Tensor:
        """O for ``g``. With ``borrow`` a replayed call returns the graph's own output buffer instead of a copy
        (one pass and one launch less): the caller must have enqueued everything that reads it before the
        next call of the same signature overwrites it."""
        schedule = iteration_schedule(g, coefficients, steps)
        if not g.is_cuda or torch.cuda.is_current_stream_capturing():
            return newton_schulz(g, coefficients, steps, eps, dtype, algorithm)
        in_place = self._is_staging(g)
        key = (
            in_place,
            tuple(g.shape),
            g.stride(),
            g.dtype,
            g.device,
            schedule,
            eps,
            dtype,
            algorithm,
            forced_backend(),
            decision_batch(),
        )
        if key not in self._captured:
            return self._first_call(key, g, schedule, eps, dtype, algorithm, in_place)
        captured = self._captured[key]
        if captured is None:
            return newton_schulz(g, coefficients, steps, eps, dtype, algorithm)
        if captured.reads_input:
            captured.backend.start_scale(g, captured.x, eps, captured.scale)
        else:
            captured.backend.start_into(g, captured.start, captured.x, eps, captured.scale)
        captured.graph.replay()
        return captured.out if borrow else captured.out.clone()

    def _first_call(
        self, key: tuple, g: Tensor, schedule: tuple, eps: float, dtype: torch.dtype, algorithm: str, in_place: bool
    ) -> Tensor:
        """Runs eagerly (tuning and compiling every kernel), then captures the iterations where a graph pays; on
        a staging buffer (``in_place``) the graph reads it as its start where the start folds a scale."""
        start, x, backend, scale = normalized_start(g, dtype, eps, own_buffer=not in_place)
        result = in_layout_of(iterate(x, schedule, backend, algorithm, scale), g)
        if gram_work(x) > MAX_GRAPH_WORK:
            self._captured[key] = None
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.device(g.device), torch.cuda.graph(graph):
                out = in_layout_of(iterate(x, schedule, backend, algorithm, scale), g).contiguous()
            self._captured[key] = _Captured(graph, start, x, scale, out, backend, reads_input=start is g)
        return result
