"""``offload="host"``: the momentum and AdamW's moments in host memory, streamed through the device each step.

Offloading moves state, it does not change arithmetic: every test compares against the same optimizer without
offload (one process, or the distributed run's one-process reference), bit for bit, in parameters and state.
On a GPU the state must also be where the option says: local tensors in pinned host memory.
"""

from __future__ import annotations

import copy
import tempfile
import warnings
from typing import Any

import pytest
import scenarios
import torch
from dist_harness import DEVICES, full_tensor, one_thread, requires_cuda, run_distributed, worker_device
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import dtensor_muon
from dtensor_muon.engine.offload import HostOffload

SHAPES = [
    ("layers.0.attention.wq", (21, 300)),  # 3 int8 blocks a row; rows 11/10, 7/7/7
    ("layers.0.moe.experts", (6, 10, 260)),  # experts 3/3, 2/2/2
    ("layers.0.norm.weight", (300,)),  # AdamW
    ("output.weight", (17, 300)),  # AdamW (by name)
]
OPTIONS: dict[str, Any] = dict(lr=0.02, ns_dtype=torch.float32, wire_dtype=torch.float32, bucket_size_mb=0.01)
"""A bucket of 10 kB: each parameter's state is streamed in several buckets."""
STEPS = 3


def initial(device: torch.device) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(name, torch.randn(shape, generator=g).to(device)) for name, shape in SHAPES]


def gradient(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    return [torch.randn(shape, generator=g) * (1 + step) for _, shape in SHAPES]


def train(params, optimizer: str, options: dict[str, Any], shard=None) -> tuple[dict, torch.optim.Optimizer]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # offload on CPU parameters: "saves nothing"
        opt = getattr(dtensor_muon, optimizer)(params, **options)
    for step in range(STEPS):
        for (name, p), g in zip(params, gradient(step)):
            g = g.to(worker_device() if shard is not None else local_of(p).device)
            p.grad = g if shard is None else shard(name, g)
        opt.step()
    opt.flush()
    result = {
        "params": [full_tensor(p.detach()) for _, p in params],
        "state": [
            {k: full_tensor(v) for k, v in opt.state[p].items() if k not in ("owner_state", "step")} for _, p in params
        ],
        "where": [[(local_of(v).device.type, local_of(v).is_pinned()) for v in offloaded(opt, p)] for _, p in params],
        "spares": len(opt._engine.offload._spares) if opt._engine.offload is not None else 0,
    }
    return result, opt


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def offloaded(opt: torch.optim.Optimizer, p: torch.Tensor) -> list[torch.Tensor]:
    """The state tensors of ``p`` that offload="host" keeps on the host."""
    keys = ("momentum_buffer", "momentum_codes", "momentum_scale", "exp_avg", "exp_avg_sq")
    return [v for k, v in opt.state[p].items() if k in keys]


def options_for(optimizer: str, options: dict[str, Any]) -> dict[str, Any]:
    """OPTIONS with ``options``; MOP (an SVD in float32) has no ns_dtype."""
    merged = {**OPTIONS, **options}
    return {k: v for k, v in merged.items() if not (optimizer == "MOP" and k == "ns_dtype")}


def one_process(device: str, optimizer: str, options: dict[str, Any]) -> dict:
    with one_thread():
        params = [(n, p.clone().requires_grad_()) for n, p in initial(torch.device(device))]
        return train(params, optimizer, options_for(optimizer, options))[0]


def assert_same(got: dict, want: dict) -> None:
    scenarios.assert_same_run([name for name, _ in SHAPES], got, want)


def assert_on_host(got: dict, device: str) -> None:
    """Every offloaded state tensor's values in host memory, pinned wherever the process sees a GPU (the host
    buffers are pinned on such a machine even for CPU parameters: :func:`pinned_empty_like`)."""
    expect_pinned = torch.cuda.is_available()
    for (name, _), where in zip(SHAPES, got["where"]):
        assert where, name
        for device_type, pinned in where:
            assert device_type == "cpu" and pinned == expect_pinned, (name, device, device_type, pinned)


@pytest.mark.parametrize(
    "optimizer, momentum_dtype",
    [("Muon", "float32"), ("Muon", "bfloat16"), ("Muon", "int8"), ("NorMuon", "int8"), ("MOP", "bfloat16")],
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_one_process_offloaded_equals_on_device_bitwise(device, optimizer, momentum_dtype):
    want = one_process(device, optimizer, {"momentum_dtype": momentum_dtype})
    got = one_process(device, optimizer, {"momentum_dtype": momentum_dtype, "offload": "host"})
    assert_same(got, want)
    assert_on_host(got, device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_soap_offloads_adamw_moments_and_keeps_its_owner_state_on_the_device(device):
    options = {"lr": 3e-3, "wire_dtype": torch.float32, "bucket_size_mb": 0.01}
    with one_thread():
        want, got = (
            train([(n, p.clone().requires_grad_()) for n, p in initial(torch.device(device))], "SOAP", o)[0]
            for o in (options, {**options, "offload": "host"})
        )
    assert_same(got, want)
    adamw_rows = [i for i, (name, _) in enumerate(SHAPES) if name.startswith(("output", "layers.0.norm"))]
    for i, where in enumerate(got["where"]):
        assert bool(where) == (i in adamw_rows), SHAPES[i][0]


def sharded(rank: int, world_size: int, optimizer: str, options: dict[str, Any]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(worker_device().type, (world_size,))
    params = [(n, torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]))) for n, p in initial(worker_device())]
    return train(
        params, optimizer, options_for(optimizer, options), lambda n, g: distribute_tensor(g, mesh, [Shard(0)])
    )[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer, momentum_dtype", [("Muon", "float32"), ("NorMuon", "int8"), ("Muon", "bfloat16")])
def test_fsdp_ranks_offloaded_equal_one_process_bitwise(optimizer, momentum_dtype, world_size, device):
    """A step over several ranks writes the new momentum beside the old and exchanges them at the commit."""
    want = one_process(device, optimizer, {"momentum_dtype": momentum_dtype})
    options = {"momentum_dtype": momentum_dtype, "offload": "host"}
    momentum_keys = 2 if momentum_dtype == "int8" else 1  # codes and scales, or the buffer
    for got in run_distributed(sharded, world_size, optimizer, options, device=device):
        assert_same(got, want)
        assert_on_host(got, device)
        assert got["spares"] == 2 * momentum_keys  # one per tensor of the two matrix parameters, made once


@pytest.mark.slow
@pytest.mark.parametrize("saved, loaded", [("host", "none"), ("none", "host"), ("host", "host")])
def test_dcp_checkpoints_cross_offload_modes_and_world_sizes_exactly(saved, loaded):
    """offload is where the state lives, not what it is: a checkpoint saved on 4 ranks in one mode resumes on 2
    and 3 ranks in the other and equals 4 uninterrupted steps of one process."""
    reference = scenarios.reference_run(4, **scenarios.OPTIONS)
    with tempfile.TemporaryDirectory() as path:
        run_distributed(scenarios.dcp_save, 4, path, 2, dtensor_muon.Muon, {**scenarios.OPTIONS, "offload": saved})
        for world_size in (2, 3):
            options = {**scenarios.OPTIONS, "offload": loaded}
            for got in run_distributed(scenarios.dcp_resume, world_size, path, 2, 2, dtensor_muon.Muon, options):
                for (name, _), a, b in zip(scenarios.SHAPES, got, reference):
                    assert torch.equal(a, b), (saved, loaded, world_size, name)


def train_reload_train(device: str, offload: str) -> tuple[dict, dict, list[list[tuple[str, bool]]]]:
    """STEPS steps, a copy of state_dict() loaded into a fresh optimizer, STEPS more steps: the result, and
    where the loaded optimizer held its offloaded tensors right after the load."""
    options = {**OPTIONS, "momentum_dtype": "int8", "offload": offload}
    with one_thread():
        params = [(n, p.clone().requires_grad_()) for n, p in initial(torch.device(device))]
        first, opt = train(params, "Muon", options)
        saved = copy.deepcopy(opt.state_dict())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            reloaded = dtensor_muon.Muon(params, **options)
        reloaded.load_state_dict(saved)
        where = [[(v.device.type, v.is_pinned()) for v in offloaded(reloaded, p)] for _, p in params]
        for step in range(STEPS):
            for (_, p), g in zip(params, gradient(step)):
                p.grad = g.to(device)
            reloaded.step()
        reloaded.flush()
        second = {
            "params": [p.detach().cpu() for _, p in params],
            "state": [
                {k: v.cpu() for k, v in reloaded.state[p].items() if k not in ("owner_state", "step")}
                for _, p in params
            ],
        }
    return first, second, where


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_a_loaded_state_dict_stays_in_host_memory_and_continues_exactly(device):
    """torch's load_state_dict moves state to its parameter's device; an offloaded optimizer keeps the
    offloaded tensors on the host (pinned on a GPU), and continues as the optimizer without offload does."""
    want_first, want_second, _ = train_reload_train(device, "none")
    first, second, where = train_reload_train(device, "host")
    assert_same(first, want_first)
    assert_same(second, want_second)
    assert_on_host({"where": where}, device)


def test_offload_rejects_an_unknown_mode_and_warns_on_cpu_parameters():
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    with pytest.raises(ValueError, match=r"offload must be one of \('none', 'host'\), got 'disk'"):
        dtensor_muon.Muon(params, offload="disk")
    with pytest.warns(UserWarning, match="offload='host'.*on the CPU.*saves nothing"):
        dtensor_muon.Muon(params, offload="host")


def test_state_is_streamed_in_buckets_of_the_given_bytes():
    offload = HostOffload(torch.device("cpu"), bucket_bytes=100)
    hosts = [{"a": torch.zeros(n)} for n in (10, 10, 30, 5, 5)]  # 40, 40, 120, 20, 20 bytes
    spans = [list(span) for span, _ in offload.staged(hosts)]
    assert spans == [[0, 1], [2], [3, 4]]
