"""``offload="host"``: the shard state in host memory, streamed through the device in buckets each step.

What lives on the host: the matrix rule's shard state (the momentum buffer; int8's codes and scales) and
AdamW's moments (``exp_avg``, ``exp_avg_sq``), each in its parameter's layout (a DTensor whose local tensor is
pinned host memory, :mod:`dtensor_muon.distributed.host_memory`). Owner state (NorMuon's row moments, SOAP's
factors and bases) stays on the device, whole on each matrix's owner; step counts stay where they were.

Each step the state passes through the device bucket by bucket (at most ``bucket_bytes`` of state each, or
one parameter's momentum where that is larger; AdamW's moments go in pieces of at most a bucket): a
bucket is copied in on a copy stream while the one before it computes, updated there by the same kernels as
without offload (so the bits are the same), and copied back on a second stream, so transfers in both
directions overlap with the work. On the device: at most three buckets at a time (one copied in, one updated,
one copied back).

Host memory: the matrix rule's shard state twice over several ranks (once on one process), AdamW's moments
once. A step over several ranks keeps nothing until every rank has succeeded (:mod:`dtensor_muon.engine.step`),
so its new momentum is written beside the old one (a spare buffer per tensor, made when the engine is built)
and the two exchange storage when the step commits; AdamW runs after that agreement and writes its moments
back in place.

Reading the state on the host: the last copies back may still be in flight when ``step()`` returns;
``optimizer.state_dict()`` (and so every checkpoint) and ``optimizer.flush()`` wait for them
(:meth:`HostOffload.settle`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..distributed.host_memory import pinned_empty_like, swap_storage
from ..rules.adamw import MOMENTS
from ..rules.base import MatrixRule

OFFLOAD_MODES = ("none", "host")


State = dict[str, Tensor]


def offloaded_keys(rule: MatrixRule, group: dict[str, Any]) -> tuple[str, ...]:
    """The state keys that ``offload="host"`` keeps on the host for a parameter of ``group``: ``rule``'s
    shard-state keys (its step count excepted) for a matrix-rule group, AdamW's moments otherwise."""
    if not group["use_muon"]:
        return MOMENTS
    return tuple(k for k in rule.state_keys(group) if k != "step")


def streamed(rule: MatrixRule, group: dict[str, Any]) -> bool:
    """Whether the shard state of a matrix-rule parameter of ``group`` is streamed: every key of it offloaded
    (SOAP's shard state is only a step count, which stays where it is)."""
    keys = rule.state_keys(group)
    return bool(keys) and offloaded_keys(rule, group) == keys


class HostOffload:
    """Streams host-resident state through ``device`` (see the module docstring). On a CPU ``device`` the copies
    are plain clones and copies back (nothing to overlap; the state is in host memory anyway)."""

    def __init__(self, device: torch.device, bucket_bytes: int) -> None:
        self.device = device
        self.bucket_bytes = bucket_bytes
        cuda = device.type == "cuda"
        self._to_device = torch.cuda.Stream(device) if cuda else None
        self._to_host = torch.cuda.Stream(device) if cuda else None
        self._written: torch.cuda.Event | None = None  # the last copy back, recorded on _to_host
        self._written_before: torch.cuda.Event | None = None  # the last copy back of the steps before this one
        self._spares: dict[int, Tensor] = {}  # id(host tensor) → its spare (same shape, strides, dtype)

    def start_step(self) -> None:
        """A new step begins: its copies in wait for the copies back of the steps before it (which filled the host
        tensors it reads), not for its own (which fill other tensors), so both directions run at once."""
        self._written_before = self._written

    def staged(self, hosts: list[State]) -> Iterator[tuple[range, list[State]]]:
        """Device copies of ``hosts`` (each a dict of host tensors), bucket by bucket: yields (positions in
        ``hosts``, their copies); the next bucket is being copied in while the caller computes on this one."""
        spans = self._spans(hosts)
        if not spans:
            return
        ahead = self._fetch(hosts, spans[0])
        for i, span in enumerate(spans):
            copies, ready = ahead
            if i + 1 < len(spans):
                ahead = self._fetch(hosts, spans[i + 1])
            if ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ready)
            yield span, copies

    def write_back(self, copies: list[State], targets: list[State]) -> None:
        """Copy each device tensor of ``copies`` into the host tensor of the same key in ``targets``, after the
        work queued so far on the current stream (asynchronously on CUDA)."""
        if self._to_host is None:
            for copy, target in zip(copies, targets):
                for key, t in copy.items():
                    target[key].copy_(t)
            return
        stream = self._to_host
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for copy, target in zip(copies, targets):
                for key, t in copy.items():
                    target[key].copy_(t, non_blocking=True)
                    t.record_stream(stream)
        self._written = stream.record_event()

    def spares(self, hosts: list[State]) -> list[State]:
        """A spare host tensor for each tensor of ``hosts`` (made at the first call, kept for the next steps; the
        engine makes them when it is built, so a lack of host memory shows then), for state written beside the
        state it replaces."""
        out = []
        for host in hosts:
            spare = {}
            for key, t in host.items():
                if id(t) not in self._spares:
                    self._spares[id(t)] = pinned_empty_like(t)
                spare[key] = self._spares[id(t)]
            out.append(spare)
        return out

    @staticmethod
    def exchange(pairs: list[tuple[State, State]]) -> None:
        """For each (state, spare): make the spare's values the state's (and the state's former values the
        spare), by storage."""
        for host, spare in pairs:
            for key, t in host.items():
                swap_storage(t, spare[key])

    def settle(self) -> None:
        """Wait until every copy back has reached host memory."""
        if self._written is not None:
            self._written.synchronize()
            self._written = self._written_before = None

    def _spans(self, hosts: list[State]) -> list[range]:
        """``hosts`` cut into consecutive runs of at most ``bucket_bytes`` (a larger state alone)."""
        spans: list[range] = []
        start, size = 0, 0
        for i, host in enumerate(hosts):
            nbytes = sum(t.numel() * t.element_size() for t in host.values())
            if i > start and size + nbytes > self.bucket_bytes:
                spans.append(range(start, i))
                start, size = i, 0
            size += nbytes
        if hosts:
            spans.append(range(start, len(hosts)))
        return spans

    def _fetch(self, hosts: list[State], span: range) -> tuple[list[State], torch.cuda.Event | None]:
        """Start copying ``hosts[span]`` to the device; (the copies, the event that marks them complete)."""
        if self._to_device is None:
            return [{key: t.clone() for key, t in hosts[i].items()} for i in span], None
        stream = self._to_device
        if self._written_before is not None:  # host tensors an earlier step's copies back may still be filling
            stream.wait_event(self._written_before)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):  # allocated on the stream that writes them first
            copies = [{key: t.to(self.device, non_blocking=True) for key, t in hosts[i].items()} for i in span]
        for copy in copies:
            for t in copy.values():
                t.record_stream(current)
        return copies, stream.record_event()
