"""dtensor_muon.Muon on one device: equal to torch.optim.Muon / AdamW, routing, state, schedulers, bad input."""

import copy

import pytest
import torch
from torch import nn

from dtensor_muon import Muon


def random_matrices(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in [(32, 48), (64, 16), (7, 7), (1, 9)]]


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
def test_equals_torch_optim_muon_bitwise_step_by_step(nesterov, adjust_lr_fn):
    init = random_matrices()
    ours = [p.clone().requires_grad_() for p in init]
    theirs = [p.clone().requires_grad_() for p in init]
    kwargs = dict(lr=0.02, weight_decay=0.05, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt_ours, opt_theirs = Muon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    for a, b in zip(ours, theirs):
        assert torch.equal(opt_ours.state[a]["momentum_buffer"], opt_theirs.state[b]["momentum_buffer"])


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_adamw_params_equal_torch_adamw(device):
    """On CUDA the parameters routed to AdamW take torch's fused kernel: equal to AdamW(fused=True)."""
    init = [torch.randn(10), torch.randn(5, 3), torch.randn(300, 7).bfloat16()]
    ours = [p.clone().to(device).requires_grad_() for p in init]
    theirs = [p.clone().to(device).requires_grad_() for p in init]
    opt_ours = Muon(
        [{"params": ours, "use_muon": False}], lr=3e-3, weight_decay=0.01, adamw_betas=(0.8, 0.99), adamw_eps=1e-6
    )
    fused = {"fused": True} if device == "cuda" else {}
    opt_theirs = torch.optim.AdamW(theirs, lr=3e-3, weight_decay=0.01, betas=(0.8, 0.99), eps=1e-6, **fused)
    for _ in range(4):
        for a, b in zip(ours, theirs):
            g = torch.randn(a.shape).to(device=device, dtype=a.dtype)
            a.grad, b.grad = g.clone(), g.clone()
        opt_ours.step()
        opt_theirs.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert torch.equal(opt_ours.state[a]["exp_avg_sq"], opt_theirs.state[b]["exp_avg_sq"])
        assert opt_ours.state[a]["step"].device.type == "cpu" and float(opt_ours.state[a]["step"]) == 4


def test_adamw_lr_and_weight_decay_default_to_muon_ones_and_can_be_set():
    p = torch.zeros(4, requires_grad=True)
    opt = Muon([p], lr=0.5, weight_decay=0.25)
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.25
    q = torch.zeros(4, requires_grad=True)
    opt = Muon([q], lr=0.5, adamw_lr=0.01, adamw_weight_decay=0.0)
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.0


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.attention = nn.Linear(16, 16)
        self.experts = nn.Parameter(torch.randn(4, 16, 8))
        self.conv = nn.Conv2d(2, 4, 3)
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 32, bias=False)


def routing_of(opt: Muon) -> dict[str, bool]:
    return {n: g["use_muon"] for g in opt.param_groups for n in g["param_names"]}


def test_routing_on_a_small_transformer():
    model = TinyTransformer()
    routes = routing_of(Muon(model.named_parameters()))
    assert routes == {
        "tok_embeddings.weight": False,
        "attention.weight": True,
        "attention.bias": False,
        "experts": True,
        "conv.weight": True,
        "conv.bias": False,
        "norm.weight": False,
        "norm.bias": False,
        "output.weight": False,
    }


def test_explicit_use_muon_wins_and_unnamed_params_route_by_ndim():
    model = TinyTransformer()
    named = dict(model.named_parameters())
    opt = Muon(
        [
            {"params": [("tok_embeddings.weight", named["tok_embeddings.weight"])], "use_muon": True},
            {"params": [("attention.weight", named["attention.weight"])], "use_muon": False},
        ]
    )
    assert routing_of(opt) == {"tok_embeddings.weight": True, "attention.weight": False}
    opt = Muon(list(model.parameters()))
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    assert len(opt.param_groups[0]["params"]) == 5  # without names, embedding and head are matrices too


def test_3d_params_are_batches_and_4d_params_are_row_views():
    experts = torch.randn(3, 8, 12)
    conv = torch.randn(6, 2, 3, 3)
    p_e, p_c = experts.clone().requires_grad_(), conv.clone().requires_grad_()
    ref = [torch.nn.Parameter(e.clone()) for e in experts] + [torch.nn.Parameter(conv.reshape(6, -1).clone())]
    opt = Muon([p_e, p_c], lr=0.1)
    opt_ref = torch.optim.Muon(ref, lr=0.1)
    for _ in range(3):
        ge, gc = torch.randn_like(experts), torch.randn_like(conv)
        p_e.grad, p_c.grad = ge, gc
        for r, g in zip(ref, list(ge) + [gc.reshape(6, -1)]):
            r.grad = g.clone()
        opt.step()
        opt_ref.step()
    for e in range(3):
        torch.testing.assert_close(p_e[e], ref[e], rtol=0, atol=1e-6)
    torch.testing.assert_close(p_c.reshape(6, -1), ref[3], rtol=0, atol=1e-6)


def test_state_is_eager_and_state_dict_round_trip_gives_identical_next_step():
    model = TinyTransformer()
    opt = Muon(model.named_parameters(), lr=0.01)
    assert all(("momentum_buffer" in opt.state[p]) != ("exp_avg" in opt.state[p]) for p in model.parameters())
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    clone = copy.deepcopy(model)
    opt2 = Muon(clone.named_parameters(), lr=0.01)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), clone.parameters()):
        g = torch.randn_like(p)
        p.grad, q.grad = g, g.clone()
    opt.step()
    opt2.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(model.parameters(), clone.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(value, opt2.state[q][key])


def test_lr_scheduler_scales_muon_and_adamw_groups():
    model = TinyTransformer()
    opt = Muon(model.named_parameters(), lr=0.1, adamw_lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.005])


def test_parameter_without_gradient_is_untouched():
    a, b = torch.randn(4, 6, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    b0 = b.detach().clone()
    opt = Muon([a, b])
    a.grad = torch.randn_like(a)
    opt.step()
    assert torch.equal(b, b0)
    assert torch.equal(opt.state[b]["momentum_buffer"], torch.zeros_like(b))


def test_closure_and_metrics():
    p = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    opt = Muon([p], diagnostics_interval=1)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None
    m = opt.metrics
    assert m["muon/update_rms/muon"] > 0
    # Keller NS5 leaves σ in about [0.68, 1.15]: the error is positive and below 0.4.
    assert 0 < m["muon/orthogonality_error"] < 0.4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(ns_steps=101), "ns_steps"),
        (dict(eps=0.0), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(ns_coefficients="unknown"), "ns_coefficients"),
        (dict(adjust_lr_fn="bogus"), "adjust_lr_fn"),
        (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"),
        (dict(adamw_eps=-1.0), "adamw_eps"),
        (dict(adamw_lr=-1.0), "adamw_lr"),
        (dict(ns_dtype="float64"), "ns_dtype"),
        (dict(ns_algorithm="fast"), "ns_algorithm"),
        (dict(exchange="p2p"), "exchange"),
        (dict(bucket_size_mb=0), "bucket_size_mb"),
        (dict(wire_dtype=torch.int8), "wire_dtype"),
        (dict(ns_cuda_graphs="yes"), "ns_cuda_graphs"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon([torch.randn(4, 4, requires_grad=True)], **kwargs)


def test_bad_types_and_parameters_raise():
    with pytest.raises(TypeError, match="ns_steps"):
        Muon([torch.randn(4, 4, requires_grad=True)], ns_steps=2.5)
    with pytest.raises(ValueError, match="complex"):
        Muon([("w", torch.randn(4, 4, dtype=torch.complex64, requires_grad=True))])
    with pytest.raises(ValueError, match="sparse"):
        Muon([("w", torch.randn(4, 4).to_sparse().requires_grad_())])
    with pytest.raises(ValueError, match=r"'bias'.*use_muon"):
        Muon([{"params": [("bias", torch.randn(4, requires_grad=True))], "use_muon": True}])
    with pytest.raises(ValueError, match="lr"):
        Muon([{"params": [torch.randn(4, 4, requires_grad=True)], "lr": -3.0}])


def test_update_rms_max_is_the_largest_matrix_update():
    """``muon/update_rms_max/muon`` is the largest RMS of one matrix's applied update (γ'·O = θ_before − θ_after
    with no weight decay), and ``muon/update_rms/muon`` the RMS over all of them."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=g, requires_grad=True) for shape in ((8, 8), (4, 32), (3, 6, 10))]
    opt = Muon([{"params": params, "use_muon": True}], lr=0.02, weight_decay=0.0, adjust_lr_fn="original")
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    before = [p.detach().clone() for p in params]
    opt.step()
    updates = [(b - p.detach()).reshape(-1, *p.shape[-2:]) for b, p in zip(before, params)]
    per_matrix = [u.square().mean().sqrt() for us in updates for u in us]
    overall = torch.cat([u.reshape(-1) for u in updates]).square().mean().sqrt()
    m = opt.metrics
    assert m["muon/update_rms_max/muon"] == pytest.approx(float(max(per_matrix)), rel=1e-4)
    assert m["muon/update_rms/muon"] == pytest.approx(float(overall), rel=1e-4)
    assert float(max(per_matrix)) > 1.1 * float(min(per_matrix))  # the matrices differ: the max is not the mean
