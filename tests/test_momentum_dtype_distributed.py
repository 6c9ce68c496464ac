"""``momentum_dtype`` "bfloat16" and "int8" keep the library's contract: every world size gives the parameters and
the momentum state of one process, bit for bit (real gloo ranks).

bf16's rounding noise is a function of each element's values, so any sharding gives the same bits. int8's
blocks (128 entries of a row, counted from global column 0) are whole on every rank under ``Shard(0)``, even or
not, and under a ``Shard(1)`` whose pieces are multiples of 128 columns (512 columns over 2 or 4 ranks); over 3
ranks (171 columns a piece) the state cannot be created and every rank raises naming the parameter. DCP
checkpoints of either format saved on 4 ranks resume on 2 and 3 exactly; a checkpoint of another momentum_dtype
is refused naming both.
"""

from __future__ import annotations

import functools
import tempfile

import pytest
import scenarios
import torch
from dist_harness import full_tensor, one_thread, run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dtensor_muon

SHAPES = [
    ("layers.0.attention.wq", (21, 300)),  # 3 blocks a row, the last of 44; rows 11/10, 7/7/7, 6/6/6/3
    ("layers.0.moe.experts", (6, 10, 260)),  # experts 3/3, 2/2/2, 2/2/2/0
    ("layers.0.feed_forward.w2", (10, 512)),  # Shard(1) in the "tp" layout: 4 blocks a row
]
OPTIONS = dict(lr=0.02, ns_dtype=torch.float32, wire_dtype=torch.float32)
STEPS = 3


def initial() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(21)
    return [(name, torch.randn(shape, generator=g)) for name, shape in SHAPES]


def gradient(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return [torch.randn(shape, generator=g) * (1 + step) for _, shape in SHAPES]


def placement(name: str, layout: str) -> list:
    return [Shard(1) if layout == "tp" and name.endswith("w2") else Shard(0)]


def train(params: list[tuple[str, torch.Tensor]], optimizer: str, momentum_dtype: str, shard=None) -> dict:
    opt = getattr(dtensor_muon, optimizer)(params, momentum_dtype=momentum_dtype, **OPTIONS)
    for step in range(STEPS):
        for (name, p), g in zip(params, gradient(step)):
            p.grad = g if shard is None else shard(name, g)
        opt.step()
    return {
        "params": [full_tensor(p.detach()) for _, p in params],
        "state": [{k: full_tensor(v) for k, v in opt.state[p].items() if k != "owner_state"} for _, p in params],
    }


@functools.cache
def one_process(optimizer: str, momentum_dtype: str) -> dict:
    with one_thread():
        return train([(n, p.clone().requires_grad_()) for n, p in initial()], optimizer, momentum_dtype)


def sharded(rank: int, world_size: int, optimizer: str, momentum_dtype: str, layout: str) -> dict | str:
    mesh = init_device_mesh("cpu", (world_size,))
    params = [
        (n, torch.nn.Parameter(distribute_tensor(p, mesh, placement(n, layout)))) for n, p in initial()
    ]  # fmt: skip
    try:
        return train(params, optimizer, momentum_dtype, lambda n, g: distribute_tensor(g, mesh, placement(n, layout)))
    except ValueError as error:
        return str(error)


def assert_equal_to_one_process(got: dict, optimizer: str, momentum_dtype: str) -> None:
    scenarios.assert_same_run([name for name, _ in SHAPES], got, one_process(optimizer, momentum_dtype))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("optimizer", ["Muon", "NorMuon"])
def test_uneven_row_shards_equal_one_process_bitwise(optimizer, momentum_dtype, world_size):
    results = run_distributed(sharded, world_size, optimizer, momentum_dtype, "fsdp")
    for got in results:
        assert_equal_to_one_process(got, optimizer, momentum_dtype)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
def test_column_shards_on_block_boundaries_equal_one_process_bitwise(momentum_dtype, world_size):
    for got in run_distributed(sharded, world_size, "Muon", momentum_dtype, "tp"):
        assert_equal_to_one_process(got, "Muon", momentum_dtype)


@pytest.mark.slow
def test_column_shards_inside_int8_blocks_raise_on_every_rank_and_bf16_stays_exact():
    for message in run_distributed(sharded, 3, "Muon", "int8", "tp"):
        assert isinstance(message, str)
        assert "parameter 'layers.0.feed_forward.w2' (shape (10, 512)): momentum_dtype='int8'" in message
        assert "at columns [171, 342]" in message and "multiples of 128" in message
    for got in run_distributed(sharded, 3, "Muon", "bfloat16", "tp"):
        assert_equal_to_one_process(got, "Muon", "bfloat16")


def resume_or_error(*args) -> list[torch.Tensor] | str:
    try:
        return scenarios.dcp_resume(*args)
    except ValueError as error:
        return str(error)


@pytest.mark.slow
@pytest.mark.parametrize("momentum_dtype", ["bfloat16", "int8"])
def test_dcp_saved_on_4_ranks_resumes_on_2_and_3_exactly(momentum_dtype):
    options = {**scenarios.OPTIONS, "momentum_dtype": momentum_dtype}
    reference = scenarios.reference_run(4, **options)
    with tempfile.TemporaryDirectory() as path:
        run_distributed(scenarios.dcp_save, 4, path, 2, dtensor_muon.Muon, options)
        for world_size in (2, 3):
            for got in run_distributed(scenarios.dcp_resume, world_size, path, 2, 2, dtensor_muon.Muon, options):
                for (name, _), a, b in zip(scenarios.SHAPES, got, reference):
                    assert torch.equal(a, b), (world_size, name)


def loaded_momentum_or_error(rank: int, world_size: int, path: str, options: dict) -> dict[str, torch.Tensor] | str:
    """A fresh Muon with ``options`` on Shard(0) parameters, DCP-loaded from ``path``: its whole momentum buffers
    by parameter name, or the load's error message."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    mesh = scenarios.make_mesh("shard0", world_size)
    params = [(n, torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]))) for n, p in scenarios.initial_params()]
    model = scenarios.ParamHolder(params)
    named = [(n, getattr(model, n.replace(".", "__"))) for n, _ in params]
    opt = dtensor_muon.Muon(named, **options)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as error:  # a key of the template the checkpoint lacks
        return str(error)
    set_optimizer_state_dict(model, opt, state["optim"])
    return {n: full_tensor(opt.state[p]["momentum_buffer"]) for n, p in named if "momentum_buffer" in opt.state[p]}


@pytest.mark.slow
def test_dcp_across_momentum_dtypes_converts_bfloat16_to_float32_exactly_and_refuses_the_rest():
    """Through DCP the loading optimizer's template decides what is read. A bfloat16 checkpoint fills a float32
    optimizer's buffers exactly (every bf16 value is a float32 value): each loaded entry is a bf16 value, the
    buffers not all zero. The other crossings miss a key of the template and raise: int8's codes are not a
    "momentum_buffer", and a float32 checkpoint's groups hold no momentum_dtype for a bfloat16 template."""
    for saved, loading, missing in (("bfloat16", "float32", None), ("int8", "float32", "momentum_buffer"),
                                    ("float32", "bfloat16", "momentum_dtype")):  # fmt: skip
        with tempfile.TemporaryDirectory() as path:
            run_distributed(
                scenarios.dcp_save, 2, path, 1, dtensor_muon.Muon, {**scenarios.OPTIONS, "momentum_dtype": saved}
            )
            options = {**scenarios.OPTIONS, "momentum_dtype": loading}
            for result in run_distributed(loaded_momentum_or_error, 2, path, options):
                if missing is not None:
                    assert isinstance(result, str) and missing in result, (saved, loading, result)
                    continue
                assert isinstance(result, dict) and result, result
                for name, buffer in result.items():
                    assert buffer.dtype == torch.float32 and torch.equal(buffer, buffer.bfloat16().float()), name
                assert any(bool(buffer.abs().sum() > 0) for buffer in result.values())
