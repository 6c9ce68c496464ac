"""Side streams of a CUDA device, one per role, for work that must not queue behind the kernels of the current
stream.

- :data:`CONSENSUS`: a step's agreement (which gradients exist, the digests, whether a direction raised). Its
  flags are host values, so their all-reduce and the read that waits for it need not follow the kernels queued
  on the current stream: the host then waits for the ranks and for the group's earlier collectives only.
- :data:`LAUNCHES`: the return exchanges of a step over several ranks. Each is packed on the current stream as
  soon as its directions are computed and launched only once every rank's directions succeeded
  (:class:`~.exchange.PackedExchange`); launched from this stream after its packing event, it waits for its
  own pieces, not for the directions computed after them.

On the CPU there is no stream: :func:`beside_queued_work` runs the block as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CONSENSUS = "consensus"
LAUNCHES = "launches"

_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The side stream of CUDA ``device`` for ``role`` (made once, then reused)."""
    key = (device, role)
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(device)
    return stream


@contextlib.contextmanager
def beside_queued_work(device: torch.device, role: str, after: torch.cuda.Event | None = None) -> Iterator[None]:
    """Run what the block queues on ``device`` on the side stream of ``role``, which first waits for ``after``
    where given (an event recorded on the current stream), so that what the block queues follows that event,
    not every kernel queued on the current stream since. A collective launched in the block still follows its
    group's earlier collectives. The block must not read tensors that the current stream writes after
    ``after``. On the CPU: as it is."""
    if device.type != "cuda":
        yield
        return
    stream = side_stream(device, role)
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        yield
