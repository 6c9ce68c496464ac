"""bench/soap_state_precision.py's simulated bf16 storage: it rounds exactly the owner-state tensors it names."""

import warnings

import torch
from bench_modules import bench_module

import dtensor_muon


def test_round_owner_state_rounds_the_named_tensors_to_bfloat16_and_leaves_the_rest():
    bench = bench_module("soap_state_precision")
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 16), "b": torch.nn.Linear(16, 4)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = dtensor_muon.SOAP(model.named_parameters(), lr=1e-2, skip_first_update=False)
    for _ in range(2):
        model["b"](model["a"](torch.randn(5, 8))).square().sum().backward()
        opt.step()
    before = {
        (id(p), k, name): t.clone()
        for p, s in opt.state.items()
        for k, m in s.get("owner_state", {}).items()
        for name, t in m.items()
    }
    assert {name for _, _, name in before} >= set(bench.PARTS["all"])
    bench.round_owner_state(bench.PARTS["moments"], opt)
    for p, s in opt.state.items():
        for k, m in s.get("owner_state", {}).items():
            for name, t in m.items():
                old = before[(id(p), k, name)]
                if name in bench.PARTS["moments"]:
                    assert torch.equal(t, old.bfloat16().float()) and not torch.equal(t, old)
                else:
                    assert torch.equal(t, old)
