"""Muon's element-wise passes over a whole list of small shards in ONE Triton launch each (GPU):

    momentum_list:        for every shard i: B'_i = lerp(B_i, g_i, 1 − μ), U_i = lerp(g_i, B'_i, μ) or B'_i
    decay_and_add_list:   for every shard i: θ_i ← round(θ_i·d_i) + a_i·O_i

with :mod:`.entrywise`'s arithmetic, so each shard gets the bits the one-shard kernels and torch's operations
give it. Shards below :data:`.elementwise.MIN_KERNEL_NUMEL` entries (a rank's shards at a high world size:
Qwen3-30B-A3B's expert shards hold 3.1 M entries at 64 ranks) would otherwise take torch's multi-tensor passes,
which move 24 + 20 bytes an fp32 entry for momentum and apply against 14 + 10 here (U written in bf16, O read
in bf16), or one Triton launch each, whose host cost is several times the traffic it saves.

The launch reads a table (int64, one row per non-empty shard, made on the device once per distinct table and
kept: the rows depend on the shards' sizes and distances, which a step's passes repeat):

    [entries, first program, each tensor's offset in elements from its role's base tensor, per-shard scalars]

A program covers ``CHUNK`` entries of one shard, ``BLOCK`` at a time; it finds its shard by binary search over
the rows' first programs (``STEPS`` ≥ log2(rows) halvings), so the table holds a row per shard, not an entry
per program: the host's cost grows with the shards, not with their entries. The tensors of a role share a dtype
and a device and are contiguous (:func:`layout_of`); U of a whole list is one allocation, cut per shape.
"""

from __future__ import annotations

import array
import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .lerp import fp32_bits, lerp_weights

try:
    import triton
    import triton.language as tl
except ImportError:  # the package imports without Triton; list_layout then takes no list
    triton = None

BLOCK = 2048
CHUNK = 8 * BLOCK
"""Entries per program: 16,384 (loops of ``BLOCK``). Chosen on an H100 over a rank's shards of Qwen3-30B-A3B at
64 ranks, the device's time of launches queued back to back: 8 blocks a program moved momentum (U in bf16) at
2.7 TB/s and the apply at 2.5, 16 blocks at 2.3 and 2.6, one block a program (a binary search per block) at 1.2."""
WARPS = 4
"""Warps per program."""
TABLES_KEPT = 64
"""Distinct launch tables kept on the device (each a few KB): a step makes one per pass and list layout."""
MIN_LIST_MEAN_NUMEL = 1 << 20
"""The fewest entries per shard, on average over the shards it takes, that a list launch takes
(:func:`listed_shards`). Its host cost per shard (checking and addressing each tensor) is higher than torch's
multi-tensor passes', and the traffic it saves grows with the entries: on an H100 (BENCHMARKS.md, "Whole
optimizer step", the per-size table), over 64 shards of 1 M entries momentum and apply took 18.4 µs a shard in
list launches against 21.5 in torch's passes, and of 256 K entries 11.2 against 9.7 (``bench/elementwise.py``
re-measures)."""
SPLIT_LISTS = 1
"""Whether a list whose shards average fewer than :data:`MIN_LIST_MEAN_NUMEL` entries still gives its largest
shards a list launch (:func:`listed_shards`); 0: the whole list or none, for benchmarks to compare."""

if triton is not None:
    from .entrywise import decay_and_add_entries, momentum_entries

    @triton.jit
    def _shard_row(table_ptr, SHARDS, ROW: tl.constexpr, STEPS: tl.constexpr):
        """(this program's row, this program): the last row whose first program (column 1) is at most this
        program, by binary search in ``STEPS`` halvings."""
        program = tl.program_id(0)
        lo = program * 0
        hi = lo + SHARDS
        for _ in tl.static_range(STEPS):
            mid = (lo + hi) // 2
            below = tl.load(table_ptr + ROW * mid + 1) <= program
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        return table_ptr + ROW * lo, program

    @triton.jit
    def _momentum_list_kernel(
        table_ptr,
        g_base,
        b_base,
        u_base,
        SHARDS,
        w_advance,
        one_minus_w_advance,
        w_nesterov,
        one_minus_w_nesterov,
        SMALL_ADVANCE: tl.constexpr,
        SMALL_NESTEROV: tl.constexpr,
        NESTEROV: tl.constexpr,
        WRITE_BUFFER: tl.constexpr,
        WRITE_INPUT: tl.constexpr,
        STEPS: tl.constexpr,
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """The momentum entries (:func:`.entrywise.momentum_entries`) of this program's chunk; row: [entries,
        first program, g, B, U offsets]."""
        row, program = _shard_row(table_ptr, SHARDS, 5, STEPS)
        end = tl.load(row)
        start = (program - tl.load(row + 1)) * CHUNK
        g_ptr, b_ptr, u_ptr = g_base + tl.load(row + 2), b_base + tl.load(row + 3), u_base + tl.load(row + 4)
        for step in tl.static_range(0, CHUNK, BLOCK):
            offsets = start + step + tl.arange(0, BLOCK)
            momentum_entries(
                g_ptr,
                b_ptr,
                u_ptr,
                offsets,
                offsets < end,
                w_advance,
                one_minus_w_advance,
                w_nesterov,
                one_minus_w_nesterov,
                SMALL_ADVANCE,
                SMALL_NESTEROV,
                NESTEROV,
                WRITE_BUFFER,
                WRITE_INPUT,
            )

    @triton.jit
    def _decay_and_add_list_kernel(
        table_ptr, p_base, o_base, SHARDS, STEPS: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr
    ):
        """The decay-and-add entries (:func:`.entrywise.decay_and_add_entries`) of this program's chunk; row:
        [entries, first program, θ, O offsets, decay's and alpha's fp32 bits]."""
        row, program = _shard_row(table_ptr, SHARDS, 6, STEPS)
        end = tl.load(row)
        start = (program - tl.load(row + 1)) * CHUNK
        p_ptr, o_ptr = p_base + tl.load(row + 2), o_base + tl.load(row + 3)
        decay = tl.load(row + 4).to(tl.int32).to(tl.float32, bitcast=True)
        alpha = tl.load(row + 5).to(tl.int32).to(tl.float32, bitcast=True)
        for step in tl.static_range(0, CHUNK, BLOCK):
            offsets = start + step + tl.arange(0, BLOCK)
            decay_and_add_entries(p_ptr, o_ptr, offsets, offsets < end, decay, alpha)


@dataclass(frozen=True)
class ListLayout:
    """Where a list's shards lie: ``entries[i]`` of shard i, and per role its tensors' distances in elements
    from the role's base (its first non-empty tensor: ``bases``), from which the kernel addresses them."""

    entries: list[int]
    offsets: list[list[int]]
    bases: list[Tensor]


def listed_shards(entries: tuple[int, ...]) -> tuple[int, ...]:
    """The shards (indices, ascending) one list launch takes of a list with these entries: the largest, as many
    as hold at least :data:`MIN_LIST_MEAN_NUMEL` entries a shard on average. Every shard where the whole list
    averages that (its mean is the smallest of the largest-first prefixes'), none where no shard holds it; the
    rest take torch's multi-tensor passes. A rank's expert shards beside its many small ones thus take the
    launch: the first 8 layers of DeepSeek-V3-16B at 64 ranks leave its busiest rank 21 shards of 2.9 M entries
    and 63 of at most 0.35 M, 0.78 M on average; the launch takes 61 of them, 99% of the entries."""
    return _largest_averaging(entries, MIN_LIST_MEAN_NUMEL, bool(SPLIT_LISTS))


@functools.lru_cache(maxsize=TABLES_KEPT)
def _largest_averaging(entries: tuple[int, ...], mean: int, split: bool) -> tuple[int, ...]:
    """:func:`listed_shards` for the threshold ``mean``; without ``split``, every shard or none."""
    if not split:
        return tuple(range(len(entries))) if sum(entries) >= mean * len(entries) else ()
    order = sorted(range(len(entries)), key=lambda i: -entries[i])
    total = taken = 0
    for count, i in enumerate(order, 1):
        total += entries[i]
        if total < mean * count:  # each further shard is no larger: the mean only falls
            break
        taken = count
    return tuple(sorted(order[:taken]))


def list_layout(*roles: list[Tensor]) -> tuple[tuple[int, ...], ListLayout] | None:
    """One list launch over these roles' tensors (shard i is ``role[i]`` of each role): the shards it takes
    (:func:`listed_shards`) and the layout of their tensors, or None where it takes none: Triton absent, not on
    a CUDA device, no shard of :data:`MIN_LIST_MEAN_NUMEL` entries, or a list :func:`layout_of` refuses."""
    if triton is None or not roles[0] or not roles[0][0].is_cuda:
        return None
    entries = [t.numel() for t in roles[0]]
    taken = listed_shards(tuple(entries))
    if not taken:
        return None
    if len(taken) < len(entries):
        roles = tuple([role[i] for i in taken] for role in roles)
        entries = [entries[i] for i in taken]
    layout = layout_of(roles, entries)
    return None if layout is None else (taken, layout)


def layout_of(roles: Sequence[list[Tensor]], entries: list[int] | None = None) -> ListLayout | None:
    """The layout of these roles' tensors (``entries``: role 0's sizes, where the caller has them), or None
    unless every tensor is contiguous, floating and on role 0's base's device (one launch addresses them all), a
    role's tensors share a dtype and lie whole elements apart, and shard i holds as many entries in every role.
    One pass over the tensors: the host's cost of a launch grows with its shards."""
    entries = entries if entries is not None else [t.numel() for t in roles[0]]
    first = next((i for i, n in enumerate(entries) if n), None)
    if first is None:
        return ListLayout(entries, [[0] * len(entries) for _ in roles], [role[0] for role in roles])
    offsets = []
    device = roles[0][first].get_device()
    for index, role in enumerate(roles):
        base = role[first]
        dtype, size, start = base.dtype, base.element_size(), base.data_ptr()
        if not dtype.is_floating_point:
            return None
        distances = []
        for t, n in zip(role, entries):
            distance = t.data_ptr() - start
            if (
                t.dtype is not dtype
                or not t.is_contiguous()
                or distance % size
                or (index and t.numel() != n)
                or t.get_device() != device
            ):
                return None
            distances.append(distance // size)
        offsets.append(distances)
    return ListLayout(entries, offsets, [role[first] for role in roles])


def _table(layout: ListLayout, scalars: list[list[int]] | None) -> tuple[Tensor | None, int, int]:
    """(the launch's table on the bases' device, programs, rows): a row per non-empty shard (module
    docstring), with ``scalars[i]`` at the end of shard i's row. No table where every shard is empty. The
    table depends on the shards' sizes and distances only, which stay the same from step to step (the same
    buffers, gradients laid out alike, U laid out by its sizes): :func:`_device_table` keeps it."""
    rows: list[int] = []
    programs = shards = 0
    columns = list(zip(*layout.offsets))
    for i, n in enumerate(layout.entries):
        if n:
            rows += (n, programs, *columns[i], *(scalars[i] if scalars else ()))
            programs += -(-n // CHUNK)
            shards += 1
    if not rows:
        return None, 0, 0
    device = layout.bases[0].device
    table, copied = _device_table(tuple(rows), device)
    if copied is not None:  # a launch on any stream reads the table after its copy (at once where it is done)
        torch.cuda.current_stream(device).wait_event(copied)
    return table, programs, shards


@functools.lru_cache(maxsize=TABLES_KEPT)
def _device_table(rows: tuple[int, ...], device: torch.device) -> tuple[Tensor, torch.cuda.Event | None]:
    """``rows`` as an int64 tensor on ``device``, made once per distinct table (copied from pinned memory on the
    current stream, without waiting), and the event of that copy (None off CUDA)."""
    host = torch.frombuffer(array.array("q", rows), dtype=torch.int64)
    if device.type != "cuda":  # the Triton interpreter (tests): the table stays on the host
        return host.clone(), None
    table = host.pin_memory().to(device, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(device))
    return table, copied


@functools.lru_cache(maxsize=1024)
def _bits(value: float) -> int:
    """:func:`.lerp.fp32_bits`, remembered: a step's shards share a few factors."""
    return fp32_bits(value)


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """The device current for a launch (CUDA), or nothing to set (the Triton interpreter's CPU tensors)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def halvings(rows: int) -> int:
    """Binary-search steps that find any of ``rows`` rows (the kernels' ``STEPS``)."""
    return max(1, (rows - 1).bit_length())


def _blocks_by_shape(like: list[Tensor]) -> tuple[list[tuple[torch.Size, list[int], int]], list[int]]:
    """How one flat allocation holds tensors shaped as ``like``'s: those of one shape side by side, as
    (shape, their indices, first element) per shape, and each tensor's offset in elements."""
    by_shape: dict[torch.Size, list[int]] = {}
    for i, t in enumerate(like):
        by_shape.setdefault(t.shape, []).append(i)
    blocks, offsets, at = [], [0] * len(like), 0
    for shape, indices in by_shape.items():
        blocks.append((shape, indices, at))
        n = shape.numel()
        for i in indices:
            offsets[i] = at
            at += n
    return blocks, offsets


def _views(flat: Tensor, blocks: list[tuple[torch.Size, list[int], int]], count: int) -> list[Tensor]:
    """The ``count`` views of ``flat`` that :func:`_blocks_by_shape` lays out, cut by one ``unbind`` per shape
    (a view per tensor costs the host several times more)."""
    views: list[Tensor] = [flat] * count
    for shape, indices, at in blocks:
        block = flat[at : at + shape.numel() * len(indices)].view(len(indices), *shape)
        for i, view in zip(indices, block.unbind(0)):
            views[i] = view
    return views


def momentum_list(
    grads: list[Tensor],
    buffers: list[Tensor],
    momentum: float,
    nesterov: bool,
    *,
    write_buffer: bool,
    want_input: bool,
    input_dtype: torch.dtype | None = None,
    layout: ListLayout | None = None,
) -> list[Tensor | None]:
    """:func:`.elementwise.momentum_step` on every (grad, buffer) pair in one launch (``layout``:
    :func:`layout_of` (grads, buffers), where the caller has it): advances the buffers in place when
    ``write_buffer`` and returns each U (in ``input_dtype``, default the buffers' dtype; views of one
    allocation) when ``want_input``, else Nones. U is B' itself without Nesterov when the buffers are written
    (nothing more is written)."""
    if not (write_buffer or want_input):
        raise ValueError("momentum_list: nothing to write (write_buffer and want_input are both False)")
    layout = layout if layout is not None else layout_of([grads, buffers])
    if layout is None:
        raise ValueError("momentum_list: these grads and buffers cannot share a launch (shard_lists.layout_of)")
    write_input = want_input and not (write_buffer and not nesterov)
    entries = layout.entries
    if write_input:
        flat = torch.empty(sum(entries), dtype=input_dtype or buffers[0].dtype, device=buffers[0].device)
        blocks, offsets = _blocks_by_shape(buffers)
        first = next((i for i, n in enumerate(entries) if n), 0)
        layout = ListLayout(  # U's base: flat from its first non-empty shard's offset on
            entries, [*layout.offsets, [a - offsets[first] for a in offsets]], [*layout.bases, flat[offsets[first] :]]
        )
    else:
        layout = ListLayout(entries, [*layout.offsets, layout.offsets[1]], [*layout.bases, layout.bases[1]])
    table, programs, shards = _table(layout, None)
    w_advance, one_minus_advance, small_advance = lerp_weights(1 - momentum)
    w_nesterov, one_minus_nesterov, small_nesterov = lerp_weights(momentum)
    if programs:
        with _on(buffers[0].device):
            _momentum_list_kernel[(programs,)](
                table,
                *layout.bases,
                shards,
                w_advance,
                one_minus_advance,
                w_nesterov,
                one_minus_nesterov,
                SMALL_ADVANCE=small_advance,
                SMALL_NESTEROV=small_nesterov,
                NESTEROV=nesterov,
                WRITE_BUFFER=write_buffer,
                WRITE_INPUT=write_input,
                STEPS=halvings(shards),
                BLOCK=BLOCK,
                CHUNK=CHUNK,
                num_warps=WARPS,
            )
    if not want_input:
        return [None] * len(grads)
    # U's views are cut after the launch: they cost the host more than the launch, and the device need not wait
    return _views(flat, blocks, len(buffers)) if write_input else list(buffers)


def decay_and_add_list(
    params: list[Tensor],
    updates: list[Tensor],
    decays: list[float],
    alphas: list[float],
    layout: ListLayout | None = None,
) -> None:
    """:func:`.elementwise.decay_and_add_` on every (θ, O, decay, alpha) in one launch (float factors, each
    passed to the kernel as fp32); ``layout``: :func:`layout_of` (params, updates), where the caller has
    it."""
    layout = layout if layout is not None else layout_of([params, updates])
    if layout is None:
        raise ValueError("decay_and_add_list: these params and updates cannot share a launch (shard_lists.layout_of)")
    table, programs, shards = _table(layout, [[_bits(d), _bits(a)] for d, a in zip(decays, alphas)])
    if programs:
        with _on(params[0].device):
            _decay_and_add_list_kernel[(programs,)](
                table, *layout.bases, shards, STEPS=halvings(shards), BLOCK=BLOCK, CHUNK=CHUNK, num_warps=WARPS
            )
