"""How a momentum rule keeps its buffer B: a param group's ``momentum_dtype``, its state keys and tensors.

- ``"float32"`` (default): ``momentum_buffer`` in the parameter's dtype and layout, torch.optim.Muon's buffer
  (float32 for float32 parameters, bf16 for bf16 ones).
- ``"bfloat16"``: ``momentum_buffer`` bf16, in the parameter's layout, written by stochastic rounding.
- ``"int8"``: ``momentum_buffer`` int8 codes in the parameter's layout and ``momentum_scale`` float32 of shape
  ``(*shape[:-1], ⌈n / 128⌉)`` in the parameter's placements: one scale per block of 128 entries of the last
  dimension, blocks counted from global column 0.

The formats are :mod:`dtensor_muon.kernels.low_precision`'s. Each step decodes B to float32, computes
B' = lerp(B, g, 1 − μ) and the Newton–Schulz input U from the float32 B', and encodes B' back; no float32 copy
of the buffer outlives the step.

Exact under any sharding: bf16's rounding noise comes from the element's own values, and int8's blocks are
whole on every rank whenever no rank's piece of the last dimension starts or ends inside a block: always for
layouts that keep rows whole (FSDP2 ``Shard(0)``, even or not, experts on ``Shard(0)``, ``_StridedShard(0)``,
``Replicate``), and for a split of the last dimension (tensor-parallel ``Shard(1)``) whose pieces are multiples
of 128 entries. Another split raises ValueError when the state is created, naming the parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..distributed.layout import layout_boxes, read_layout
from ..kernels.low_precision import INT8_BLOCK, MOMENTUM_DTYPES, int8_blocks

BUFFER = "momentum_buffer"
"""The float32 and bfloat16 buffer (torch.optim.Muon's key)."""
CODES = "momentum_codes"
"""int8's codes: a key of their own, so that a checkpoint template of another format (DCP's load fills the
template's keys) never takes int8 codes for a buffer: it misses this key, or the template's buffer, and raises."""
SCALE = "momentum_scale"
MOMENTUM_KEYS = (BUFFER, CODES, SCALE)
"""Every key a momentum rule's shard state may hold; a group's are :func:`momentum_state_keys`."""


def group_momentum_dtype(group: dict[str, Any]) -> str:
    """A param group's ``momentum_dtype``: "float32" where the group has no such key (an optimizer's groups hold
    it only when it is not "float32", so that checkpoints from before it existed still load through DCP)."""
    return group.get("momentum_dtype", "float32")


def check_momentum_dtype(value: Any) -> None:
    """Raise ValueError unless ``value`` is one of :data:`MOMENTUM_DTYPES`."""
    if not isinstance(value, str) or value not in MOMENTUM_DTYPES:
        raise ValueError(f"momentum_dtype: expected one of {MOMENTUM_DTYPES}, got {value!r}")


def momentum_state_keys(momentum_dtype: str) -> tuple[str, ...]:
    """The shard-state keys of ``momentum_dtype``: the buffer, and int8's scales."""
    return (CODES, SCALE) if momentum_dtype == "int8" else (BUFFER,)


def init_momentum_state(param: Tensor, momentum_dtype: str, name: str) -> dict[str, Tensor]:
    """Zero momentum state of ``param`` (named ``name`` in messages) in ``momentum_dtype``'s format, each tensor
    a DTensor in ``param``'s placements where ``param`` is one."""
    if momentum_dtype == "float32":
        return {BUFFER: torch.zeros_like(param)}
    if momentum_dtype == "bfloat16":
        return {BUFFER: torch.zeros_like(param, dtype=torch.bfloat16)}
    return {CODES: torch.zeros_like(param, dtype=torch.int8), SCALE: _zero_scales(param, name)}


def _zero_scales(param: Tensor, name: str) -> Tensor:
    """int8's float32 scales of ``param``, zero; for a DTensor, each rank's piece the scales of its own blocks
    (raises ValueError when a rank's piece of the last dimension starts or ends inside a block)."""
    shape = tuple(param.shape)
    scale_shape = (*shape[:-1], int8_blocks(shape[-1]))
    if not isinstance(param, DTensor):
        return torch.zeros(scale_shape, dtype=torch.float32, device=param.device)
    layout = read_layout(name, param)
    mesh_shape = tuple(param.device_mesh.mesh.shape)
    scale_boxes = layout_boxes(name, scale_shape, mesh_shape, tuple(param.placements))
    cut = sorted({edge for box in layout.boxes for edge in box[-1] if edge % INT8_BLOCK and edge != shape[-1]})
    aligned = all(
        box[:-1] == scale_box[:-1]
        and (box[-1][0] == box[-1][1] or scale_box[-1] == (box[-1][0] // INT8_BLOCK, int8_blocks(box[-1][1])))
        for box, scale_box in zip(layout.boxes, scale_boxes)
    )
    if cut or not aligned:
        raise ValueError(
            f"parameter {name!r} (shape {shape}): momentum_dtype='int8' keeps one scale per {INT8_BLOCK} entries "
            f"of the last dimension, but the layout {tuple(param.placements)} over mesh {mesh_shape} splits that "
            f"dimension inside a block (at columns {cut or 'where the scales split differently'}). Use a split "
            f"whose pieces are multiples of {INT8_BLOCK} columns, or momentum_dtype 'bfloat16' or 'float32' for "
            "this parameter's param group."
        )
    mine = scale_boxes[layout.mesh_rank]
    local_scales = torch.zeros(
        tuple(stop - start for start, stop in mine), dtype=torch.float32, device=param.to_local().device
    )
    stride = torch.empty(scale_shape, device="meta").stride()
    return DTensor.from_local(
        local_scales, param.device_mesh, param.placements, run_check=False, shape=scale_shape, stride=stride
    )


def stored_format(state: dict[str, Any], param_dtype: torch.dtype) -> str:
    """The ``momentum_dtype`` a momentum state was written in: "int8" with scales, "float32" for a buffer in
    the parameter's dtype, "bfloat16" for a bf16 one; else the buffer's dtype, named."""
    buffer = state.get(BUFFER)
    if CODES in state or SCALE in state:
        return "int8"
    dtype = getattr(buffer, "dtype", None)
    if dtype == param_dtype:
        return "float32"
    if dtype == torch.bfloat16:
        return "bfloat16"
    return f"a {dtype} buffer"


def same_format(found: str, expected: str, param_dtype: torch.dtype) -> bool:
    """Whether state written as ``found`` is ``expected``'s format: the same name, or, for bf16 parameters,
    "float32" and "bfloat16" (both a bf16 buffer; only the rounding of B' differs)."""
    both_bf16 = param_dtype == torch.bfloat16 and {found, expected} <= {"float32", "bfloat16"}
    return found == expected or both_bf16


def held_format_problem(state: dict[str, Tensor], momentum_dtype: str, param_dtype: torch.dtype) -> str | None:
    """Why a held momentum state does not fit the group's ``momentum_dtype`` (it changed after the state was
    created), or None."""
    found = stored_format(state, param_dtype)
    if same_format(found, momentum_dtype, param_dtype):
        return None
    return (
        f"the param group's momentum_dtype is {momentum_dtype!r}, but its momentum state was created as "
        f"{found!r}: momentum_dtype is fixed when the state is created (construct the optimizer with the "
        "momentum_dtype it should use)"
    )
