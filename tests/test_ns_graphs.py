"""Newton–Schulz replayed from CUDA graphs (ns_graphs.py): the same bits as the eager call.

On CPU (CI) the runner must fall back to the eager call; the CUDA tests run on the GPU machine
(`pytest tests/test_ns_graphs.py` there) and compare replays against eager calls on fresh inputs.
"""

from __future__ import annotations

import pytest
import torch

from dtensor_muon import Muon
from dtensor_muon.kernels import use_backend
from dtensor_muon.linalg import ns_graphs
from dtensor_muon.linalg.newton_schulz import newton_schulz, normalized_start
from dtensor_muon.linalg.ns_graphs import NewtonSchulzGraphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("shape", [(48, 96), (96, 48), (3, 40, 64)])
def test_cpu_inputs_run_eagerly_with_the_same_bits(shape):
    runner = NewtonSchulzGraphs()
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for coefficients, steps in (("simple", 5), ("polar_express", 8)):
        assert torch.equal(runner(g, coefficients, steps), newton_schulz(g, coefficients, steps))
    assert len(runner) == 0


def test_bad_inputs_raise_as_newton_schulz_does():
    runner = NewtonSchulzGraphs()
    with pytest.raises(ValueError, match="2-D matrix or a 3-D batch"):
        runner(torch.randn(5))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        runner(torch.randn(4, 4), steps=0)


@cuda
@pytest.mark.parametrize("shape", [(1536, 2560), (2560, 1536), (2, 1536, 2048)])
def test_replays_equal_eager_calls_bitwise(shape):
    """SYRK kernels at every size (the "syrk" backend), standard and Gram form, wide, tall and batched:
    each replay on a fresh input equals the eager call on it, and comes back contiguous in g's orientation."""
    runner = NewtonSchulzGraphs()
    with use_backend("syrk"):
        for algorithm in ("standard", "gram"):
            for seed in range(3):
                g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
                out = runner(g, algorithm=algorithm)
                assert torch.equal(out, newton_schulz(g, algorithm=algorithm))
                assert seed == 0 or out.is_contiguous()  # replays; the first call runs eagerly
    assert len(runner) == 2


@cuda
@pytest.mark.parametrize("shape", [(512, 2048), (2048, 512), (128, 2048), (4, 256, 512)])
def test_small_inputs_replay_the_torch_backends_products_bitwise(shape):
    """Below the GPU backend's bound the torch backend's products are captured too: replays equal eager calls."""
    runner = NewtonSchulzGraphs()
    for seed in range(3):
        g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
        assert torch.equal(runner(g), newton_schulz(g))
    assert len(runner) == 1


def test_the_torch_backend_writes_a_start_of_its_own():
    g = torch.randn(48, 96, dtype=torch.bfloat16)
    start, _, backend, scale = normalized_start(g, torch.bfloat16, 1e-7)
    assert backend.name == "torch" and scale is None and start is not g
    assert torch.equal(start, (g / g.norm()).to(torch.bfloat16))


@cuda
@pytest.mark.parametrize("shape", [(1536, 2560), (2560, 1536), (8, 768, 2048)])
def test_a_working_dtype_input_is_the_start_itself_and_is_never_written(shape):
    """On the SYRK route a bf16 G is read in place (no start written): each call equals the call on G's fp32
    values (whose cast is written) bit for bit, eager and replayed, wide, tall and batched; no call writes G, and
    replays copy into the graph's own buffer, never into the first call's G."""
    runner = NewtonSchulzGraphs()
    with use_backend("syrk"):
        inputs = [
            torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
            for seed in range(3)
        ]
        kept = [g.clone() for g in inputs]
        start, _, _, scale = normalized_start(inputs[0], torch.bfloat16, 1e-7)
        assert start is inputs[0] and scale is not None
        for g in inputs:
            for algorithm in ("standard", "gram"):
                eager = newton_schulz(g, algorithm=algorithm)
                assert torch.equal(eager, newton_schulz(g.float(), algorithm=algorithm))
                assert torch.equal(runner(g, algorithm=algorithm), eager)
        assert all(torch.equal(g, k) for g, k in zip(inputs, kept))
    assert len(runner) == 2


@cuda
def test_above_the_work_bound_runs_eagerly(monkeypatch):
    monkeypatch.setattr(ns_graphs, "MAX_GRAPH_WORK", 2**30)
    runner = NewtonSchulzGraphs()
    g = torch.randn(2048, 2048, device="cuda")
    with use_backend("syrk"):
        assert torch.equal(runner(g), newton_schulz(g))
        assert torch.equal(runner(g), newton_schulz(g))
    assert len(runner) == 0


@cuda
def test_optimizer_steps_equal_with_and_without_graphs():
    def train(graphs: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(2048, 1536, device="cuda")) for _ in range(2)]
        opt = Muon(params, lr=0.02, ns_cuda_graphs=graphs)
        with use_backend("syrk"):
            for step in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
                opt.step()
        return [p.detach().clone() for p in params]

    for with_graphs, without in zip(train(True), train(False)):
        assert torch.equal(with_graphs, without)


@cuda
def test_a_borrowed_output_is_the_graphs_own_buffer():
    """``borrow=True``: the same bits as a copied result, in the buffer that the next replay overwrites."""
    runner = NewtonSchulzGraphs()
    inputs = [
        torch.randn(2, 1536, 2048, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(3)
    ]
    with use_backend("syrk"):
        runner(inputs[0])  # eager, then captured
        copied = runner(inputs[1])
        borrowed = runner(inputs[1], borrow=True)
        assert torch.equal(borrowed, copied)
        kept = borrowed.clone()
        again = runner(inputs[2], borrow=True)
        assert again.data_ptr() == borrowed.data_ptr() and not torch.equal(borrowed, kept)
        assert torch.equal(again, newton_schulz(inputs[2]))


def test_no_staging_buffer_off_cuda_or_above_the_graphs_bound(monkeypatch):
    runner = NewtonSchulzGraphs()
    assert runner.staging_buffer((8, 64, 128), torch.bfloat16, torch.device("cpu")) is None
    monkeypatch.setattr(ns_graphs, "MAX_GRAPH_WORK", 64 * 64 * 128 - 1)  # B·m²·n of a [64, 128] matrix, less one
    assert runner.staging_buffer((64, 128), torch.bfloat16, torch.device("cuda", 0)) is None
    assert runner.staging_buffer((128, 64), torch.bfloat16, torch.device("cuda", 0)) is None


@cuda
@pytest.mark.parametrize("shape", [(3072, 4096), (4096, 3072), (8, 768, 2048), (4, 256, 512)])
def test_a_staging_buffer_is_read_in_place_with_the_same_bits(shape):
    """Inputs written into the runner's staging buffer: every call on it (eager, then replayed) equals the call on
    a copy of the input bit for bit, wide, tall, batched and on the torch backend's sizes; on the SYRK route the
    graph's start is the buffer itself (no copy), elsewhere the graph writes a start of its own; the buffer is
    one per shape and never written by a call."""
    runner = NewtonSchulzGraphs()
    buffer = runner.staging_buffer(shape, torch.bfloat16, torch.device("cuda"))
    assert buffer is runner.staging_buffer(shape, torch.bfloat16, torch.device("cuda", torch.cuda.current_device()))
    for seed in range(3):
        g = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).bfloat16()
        buffer.copy_(g)
        for algorithm in ("standard", "gram"):
            assert torch.equal(runner(buffer.view(shape), algorithm=algorithm), newton_schulz(g, algorithm=algorithm))
        assert torch.equal(buffer, g)
    captured = [c for c in runner._captured.values() if c is not None]
    assert len(captured) == 2
    folds = normalized_start(g, torch.bfloat16, 1e-7)[3] is not None
    assert all(c.reads_input == folds and (c.start.data_ptr() == buffer.data_ptr()) == folds for c in captured)
    assert folds == (shape != (4, 256, 512))
