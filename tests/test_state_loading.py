"""Loading optimizer state: what does not fit raises at load and changes nothing; switching optimizers on
purpose (load_compatible_state); state dicts round-trip (torch's test_state_dict_deterministic); param-group
keys are checked. Numbers are checked against torch.optim.AdamW and against runs that never loaded."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import pytest
import torch
from dist_harness import run_distributed
from torch import nn

from dtensor_muon import SOAP, Muon, NorMuon
from dtensor_muon.distributed.layout import local

OPTIMIZERS = {"muon": Muon, "soap": SOAP, "normuon": NorMuon}
OPTIONS = dict(lr=0.02, weight_decay=0.1)
ADAMW = dict(lr=0.01, weight_decay=0.05, betas=(0.9, 0.95), eps=1e-8)  # torch.optim.AdamW's arguments
ADAMW_AS_OURS = dict(adamw_lr=0.01, adamw_weight_decay=0.05, adamw_betas=(0.9, 0.95), adamw_eps=1e-8)


# ---------------------------------------------------------------------------------------------------- helpers
def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Equal structure, equal values; tensors bitwise (DTensors: their local pieces)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        a, b = local(a), local(b)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: {sorted(a, key=str)} != {sorted(b, key=str)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def snapshot(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict]:
    """Parameters (local pieces) and the optimizer's state dict, copied."""
    return [local(p).detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_unchanged(opt: torch.optim.Optimizer, params: list[torch.Tensor], before: tuple) -> None:
    after = snapshot(opt, params)
    assert_same(before[0], after[0], "params")
    assert_same(before[1], after[1], "state_dict")


class Net(nn.Module):
    """An embedding and a head (AdamW by name), two hidden matrices, a bias and a norm (AdamW by shape)."""

    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 6)
        self.fc1 = nn.Linear(6, hidden)
        self.fc2 = nn.Linear(hidden, 6, bias=False)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 12, bias=False)


def make_net(seed: int = 0, hidden: int = 6) -> Net:
    torch.manual_seed(seed)
    return Net(hidden)


def set_grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def stepped(opt_cls: type, model: nn.Module, steps: int, **options: Any) -> torch.optim.Optimizer:
    opt = opt_cls(model.named_parameters(), **options)
    for step in range(steps):
        set_grads(model, step)
        opt.step()
    return opt


# ------------------------------------------------------------------- round trips (torch's test_state_dict_deterministic)
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("named0", [True, False])
@pytest.mark.parametrize("named1", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_state_dict_deterministic(optimizer_name, named0, named1, with_bias):
    """torch's test_optim.py test_state_dict_deterministic: 10 steps, the state dict (deep-copied) loaded into a
    fresh optimizer on cloned parameters, 10 more steps of both in parallel; weights equal at every step (here
    bitwise), equal state dicts (param names aside), and equal last groups after param_groups.extend."""
    optim_cls = OPTIMIZERS[optimizer_name]
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(2, 3))
    bias = nn.Parameter(torch.randn(2))
    input = torch.randn(3)
    params = [weight, bias] if with_bias else [weight]

    def make_named_param(param, is_named):
        return [(f"name{i}", p) for i, p in enumerate(param)] if is_named else param

    def without_param_names(state_dict):
        new_state_dict = copy.deepcopy(state_dict)
        for pg in new_state_dict["param_groups"]:
            pg.pop("param_names", None)
        return new_state_dict

    def fwd_bwd(optim, w, b, i):
        optim.zero_grad()
        loss = (w.mv(i) + b if with_bias else w.mv(i)).pow(2).sum()
        loss.backward()
        return loss

    optimizer = optim_cls(make_named_param(params, named0), lr=0.01)
    closure = functools.partial(fwd_bwd, optimizer, weight, bias, input)
    for _ in range(10):
        closure()
        optimizer.step()

    with torch.no_grad():
        weight_c = nn.Parameter(weight.clone())
        bias_c = nn.Parameter(bias.clone())
    params_c = [weight_c, bias_c] if with_bias else [weight_c]
    optimizer_c = optim_cls(make_named_param(params_c, named1), lr=0.01)
    closure_c = functools.partial(fwd_bwd, optimizer_c, weight_c, bias_c, input)
    optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))

    for _ in range(10):
        closure()
        closure_c()
        optimizer.step()
        optimizer_c.step()
        assert torch.equal(weight, weight_c)
        assert torch.equal(bias, bias_c)

    assert_same(without_param_names(optimizer.state_dict()), without_param_names(optimizer_c.state_dict()))
    assert optimizer_c.defaults == optimizer.defaults

    optimizer_c.param_groups.extend(optimizer_c.param_groups)
    assert_same(
        without_param_names(optimizer.state_dict())["param_groups"][-1],
        without_param_names(optimizer_c.state_dict())["param_groups"][-1],
    )


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_groups_added_after_a_load_carry_no_torch_bookkeeping_keys(optimizer_name):
    model = make_net()
    opt = stepped(OPTIMIZERS[optimizer_name], model, 1)
    keys = set(opt.param_groups[0])
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.add_param_group({"params": [("extra", nn.Parameter(torch.randn(3, 4)))]})
    assert set(opt.param_groups[0]) == keys and set(opt.param_groups[-1]) == keys


@pytest.mark.parametrize(("optimizer_name", "newer"), [("muon", "ns_algorithm"), ("soap", "match_update_rms")])
def test_checkpoint_saved_without_a_newer_option_loads_and_steps(optimizer_name, newer):
    optim_cls = OPTIMIZERS[optimizer_name]
    model = make_net()
    opt = stepped(optim_cls, model, 2)
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        del group[newer]
    clone = copy.deepcopy(model)
    resumed = optim_cls(clone.named_parameters())
    resumed.load_state_dict(saved)
    assert all(group[newer] == resumed.defaults[newer] for group in resumed.param_groups)
    for step in range(2, 4):
        set_grads(model, step)
        set_grads(clone, step)
        opt.step()
        resumed.step()
        assert_same(list(model.parameters()), list(clone.parameters()))
    assert_same(opt.state_dict(), resumed.state_dict())


# ---------------------------------------------------------------------------------- another optimizer's state
def adamw_state(model: nn.Module, steps: int = 2, named: bool = True) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(model.named_parameters() if named else model.parameters(), **ADAMW)
    for step in range(steps):
        set_grads(model, step)
        opt.step()
    return opt


def other_state(source: str, model: nn.Module) -> dict:
    if source == "adamw":
        return copy.deepcopy(adamw_state(model).state_dict())
    return copy.deepcopy(stepped(OPTIMIZERS[source], model, 2).state_dict())


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        (
            "muon",
            "soap",
            r"parameter 'fc1\.weight' \(soap\): the loaded state has keys \['momentum_buffer'\], "
            r"SOAP expects \['owner_state', 'step'\]",
        ),
        (
            "soap",
            "muon",
            r"parameter 'fc1\.weight' \(muon\): the loaded state has keys \['owner_state', 'step'\], "
            r"Muon expects \['momentum_buffer'\]",
        ),
        (
            "muon",
            "normuon",
            r"parameter 'fc1\.weight' \(normuon\): the loaded state has keys \['momentum_buffer'\], "
            r"NorMuon expects \['momentum_buffer', 'owner_state'\]",
        ),
        (
            "normuon",
            "muon",
            r"parameter 'fc1\.weight' \(muon\): the loaded state has keys \['momentum_buffer', "
            r"'owner_state'\], Muon expects \['momentum_buffer'\]",
        ),
        ("adamw", "muon", r"param group 0 \(first parameter 'embed.weight'\) has use_muon=None"),
        ("adamw", "soap", r"param group 0 \(first parameter 'embed.weight'\) has use_muon=None"),
    ],
)
def test_another_optimizers_state_raises_at_load_and_changes_nothing(source, target, expected):
    optim_cls = OPTIMIZERS[target]
    saved = other_state(source, make_net(1))
    model = make_net()
    opt = stepped(optim_cls, model, 1)
    reference_model = copy.deepcopy(model)
    reference = optim_cls(reference_model.named_parameters())
    reference.load_state_dict(copy.deepcopy(opt.state_dict()))
    before = snapshot(opt, list(model.parameters()))
    with pytest.raises(ValueError, match=expected) as raised:
        opt.load_state_dict(saved)
    assert "Nothing was loaded" in str(raised.value) and "load_compatible_state" in str(raised.value)
    assert_unchanged(opt, list(model.parameters()), before)
    for step in range(1, 3):  # and it steps as before: like an optimizer that never saw the failed load
        set_grads(model, step)
        set_grads(reference_model, step)
        opt.step()
        reference.step()
    assert_same(list(model.parameters()), list(reference_model.parameters()))


@pytest.mark.parametrize("target", sorted(OPTIMIZERS))
def test_another_optimizers_state_raises_through_set_optimizer_state_dict(target):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    source_model = make_net(1)
    saved = copy.deepcopy(get_optimizer_state_dict(source_model, adamw_state(source_model)))
    model = make_net()
    opt = stepped(OPTIMIZERS[target], model, 1)
    before = snapshot(opt, list(model.parameters()))
    with pytest.raises(ValueError, match=r"has use_muon=None, .*saved by another optimizer") as raised:
        set_optimizer_state_dict(model, opt, saved)
    assert re.search(r"first parameter '(embed|fc1)\.weight'", str(raised.value)), raised.value
    assert_unchanged(opt, list(model.parameters()), before)


def test_another_routing_raises_at_load():
    model = make_net()
    hidden = [("fc1.weight", model.fc1.weight), ("fc2.weight", model.fc2.weight)]
    saved = copy.deepcopy(Muon([{"params": hidden}]).state_dict())
    opt = Muon([{"params": hidden, "use_muon": False}])
    before = snapshot(opt, [p for _, p in hidden])
    with pytest.raises(
        ValueError,
        match=r"param group 0 has use_muon=True, .*group 0 \(first parameter 'fc1\.weight'\)"
        r" has use_muon=False \(adamw\)",
    ):
        opt.load_state_dict(saved)
    assert_unchanged(opt, [p for _, p in hidden], before)


def test_state_of_other_shapes_raises_at_load_naming_parameter_key_and_shapes():
    saved = copy.deepcopy(stepped(Muon, make_net(1, hidden=5), 2).state_dict())
    model = make_net(hidden=7)
    opt = stepped(Muon, model, 1)
    before = snapshot(opt, list(model.parameters()))
    with pytest.raises(
        ValueError,
        match=r"parameter 'fc1\.weight' \(muon\), state 'momentum_buffer': the loaded tensor's local shape is \(5, 6\), "
        r"this rank's layout of the parameter has \(7, 6\)\. Nothing was loaded\. .*torch\.distributed\.checkpoint",
    ):
        opt.load_state_dict(saved)
    assert_unchanged(opt, list(model.parameters()), before)


# ------------------------------------------------------------------------------ switching on purpose
@pytest.mark.parametrize("form", ["state_dict", "get_optimizer_state_dict", "dcp"])
def test_load_compatible_state_from_torch_adamw_keeps_adamw_moments_and_starts_matrices_fresh(form, tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = make_net()
    source = adamw_state(model, steps=3)  # torch.optim.AdamW going on: the reference of the AdamW parameters
    if form == "state_dict":
        saved = copy.deepcopy(source.state_dict())
    elif form == "get_optimizer_state_dict":
        saved = copy.deepcopy(get_optimizer_state_dict(model, source))
    else:  # saved with DCP; loaded into a template of the saved optimizer built on another copy of the model
        dcp.save({"optim": get_optimizer_state_dict(model, source)}, checkpoint_id=tmp_path)
        template_model = make_net(5)
        template = {
            "optim": get_optimizer_state_dict(template_model, torch.optim.AdamW(template_model.named_parameters()))
        }
        dcp.load(template, checkpoint_id=tmp_path)
        saved = template["optim"]
    fresh_model = copy.deepcopy(model)  # a fresh Muon: the reference of the matrices
    fresh = Muon(fresh_model.named_parameters(), **OPTIONS, **ADAMW_AS_OURS)

    switched_model = copy.deepcopy(model)
    switched = Muon(switched_model.named_parameters(), **OPTIONS, **ADAMW_AS_OURS)
    report = switched.load_compatible_state(saved)
    assert report == {
        "kept": ["embed.weight", "fc1.bias", "norm.weight", "norm.bias", "head.weight"],
        "fresh": ["fc1.weight", "fc2.weight"],
    }, form
    for step in range(3, 6):
        for m in (model, fresh_model, switched_model):
            set_grads(m, step)
        source.step()
        fresh.step()
        switched.step()
    got = dict(switched_model.named_parameters())
    for name, p in model.named_parameters():
        if name in report["kept"]:
            assert torch.equal(got[name], p), (form, name)
    for name, p in fresh_model.named_parameters():
        if name in report["fresh"]:
            assert torch.equal(got[name], p), (form, name)


def test_load_compatible_state_between_our_optimizers_and_what_it_logs(caplog):
    model = make_net()
    muon = stepped(Muon, model, 3, **OPTIONS)
    saved = copy.deepcopy(muon.state_dict())
    start = copy.deepcopy(model)
    soap_model = copy.deepcopy(start)
    soap = SOAP(soap_model.named_parameters(), adamw_lr=0.02, adamw_weight_decay=0.1)
    with caplog.at_level("INFO", logger="dtensor_muon"):
        report = soap.load_compatible_state(saved)
    assert report["fresh"] == ["fc1.weight", "fc2.weight"]
    assert (
        "kept the AdamW state of 5 parameters" in caplog.text
        and "started 2 fresh (fc1.weight, fc2.weight)" in caplog.text
    )
    fresh_model = copy.deepcopy(start)
    fresh = SOAP(fresh_model.named_parameters())
    for step in range(3, 5):
        for m in (model, soap_model, fresh_model):
            set_grads(m, step)
        muon.step()
        soap.step()
        fresh.step()
    got = dict(soap_model.named_parameters())
    muon_params, fresh_params = dict(model.named_parameters()), dict(fresh_model.named_parameters())
    for name in report["kept"]:
        assert torch.equal(got[name], muon_params[name]), name
    for name in report["fresh"]:
        assert torch.equal(got[name], fresh_params[name]), name


def test_load_compatible_state_refuses_unnamed_state_and_other_shapes_changing_nothing():
    model = make_net()
    opt = stepped(Muon, model, 1)
    before = snapshot(opt, list(model.parameters()))
    unnamed = adamw_state(make_net(1), named=False).state_dict()
    with pytest.raises(ValueError, match=r"param group 0 names no parameters .*named_parameters\(\)"):
        opt.load_compatible_state(unnamed)
    other = make_net(1)
    other.norm = nn.LayerNorm(4)
    with pytest.raises(
        ValueError,
        match=r"parameter 'norm\.weight' \(adamw\), state 'exp_avg': the loaded value has local shape \(4,\), "
        r"this rank's layout of the parameter has \(6,\)",
    ):
        opt.load_compatible_state(adamw_state(other).state_dict())
    assert_unchanged(opt, list(model.parameters()), before)


# ------------------------------------------------------------------------------------------ param-group keys
def test_unknown_param_group_keys_raise_naming_the_key_and_the_valid_ones():
    model = make_net()
    with pytest.raises(ValueError, match=r"unknown param group key 'momentum_typo'\. Valid param group keys: .*'?lr"):
        Muon([{"params": list(model.parameters()), "momentum_typo": 0.9}])
    with pytest.raises(ValueError, match=r"unknown param group key 'foreach'"):  # torch.optim.AdamW's, not ours
        Muon([{"params": list(model.parameters()), "foreach": False}])
    with pytest.raises(ValueError, match=r"unknown param group key 'ns_steps'"):  # Muon's, not SOAP's
        SOAP([{"params": list(model.parameters()), "ns_steps": 3}])
    with pytest.raises(ValueError, match=r"unknown param group key 'ns_cuda_graphs'"):  # not a keyword of SOAP's
        SOAP([{"params": list(model.parameters()), "ns_cuda_graphs": False}])
    for key, value in [
        ("wire_dtype", torch.float32),
        ("bucket_size_mb", 8.0),
        ("overlap", True),
        ("matrix_splits", {}),
    ]:
        with pytest.raises(
            ValueError, match=rf"param group key '{key}' is a constructor keyword.*NorMuon\(\.\.\., {key}=\.\.\.\)"
        ):
            NorMuon([{"params": list(model.parameters()), key: value}])
    opt = Muon(model.named_parameters())
    with pytest.raises(ValueError, match=r"param group key 'exchange' is a constructor keyword"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 4))], "exchange": "gather_all"})
    assert len(opt.param_groups) == 2


def test_scheduler_and_torch_keys_are_accepted_in_param_groups():
    model = make_net()
    opt = Muon(model.named_parameters(), lr=0.1)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    # groups copied from a scheduled optimizer's, as fine-tuning code builds them: initial_lr comes along
    template = {k: v for k, v in opt.param_groups[0].items() if k not in ("params", "param_names")}
    assert template["initial_lr"] == 0.1
    opt.add_param_group({**template, "params": [("extra", nn.Parameter(torch.randn(3, 4)))], "differentiable": False})
    assert opt.param_groups[-1]["initial_lr"] == 0.1
    extra = nn.Parameter(torch.randn(3, 4))
    second = Muon([{**template, "params": [("extra", extra)]}], lr=0.3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(second, lambda step: 0.5**step)
    assert second.param_groups[0]["lr"] == 0.1  # the group's lr (0.1), scaled from its initial_lr (0.1)
    extra.grad = torch.ones_like(extra)
    second.step()
    scheduler.step()
    assert second.param_groups[0]["lr"] == 0.05
    with pytest.raises(ValueError, match=r"differentiable=True is not supported"):
        Muon([{"params": list(model.parameters()), "differentiable": True}])


# ------------------------------------------------------------------------------------------ several ranks
def _local_state(state_dict: dict) -> dict:
    """A state dict with every DTensor replaced by its local piece (what a rank's file would hold)."""

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items()}
        return local(value).clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)

    return {"state": strip(state_dict["state"]), "param_groups": copy.deepcopy(state_dict["param_groups"])}


def _save_normuon(rank: int, world_size: int) -> Any:
    try:
        from scenarios import distributed_params, set_gradients

        params = distributed_params("shard0", world_size)
        opt = NorMuon(params, lr=0.02)
        for step in range(2):
            set_gradients(params, step)
            opt.step()
        return _local_state(opt.state_dict())
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _load_on_two(rank: int, world_size: int, saved_on_three: list[dict]) -> Any:
    from scenarios import distributed_params, set_gradients
    from torch.distributed.tensor import Shard, distribute_tensor

    out: dict[str, Any] = {}

    def attempt(key, opt, state_dict):
        try:
            opt.load_state_dict(state_dict)
            out[key] = "loaded"
        except Exception as e:
            out[key] = f"{type(e).__name__}: {e}"

    try:
        params = distributed_params("shard0", world_size)
        ref_params = distributed_params("shard0", world_size)
        opt = NorMuon(params, lr=0.02)
        reference = NorMuon(ref_params, lr=0.02)
        for step in range(2):
            set_gradients(params, step)
            set_gradients(ref_params, step)
            opt.step()
            reference.step()
        tensors = [p for _, p in params]
        before = snapshot(opt, tensors)
        # 1. the state of rank `rank` of three ranks (plain tensors: each rank's file)
        attempt("three_ranks", opt, copy.deepcopy(saved_on_three[rank]))
        # 2. this world size's state, but rank 1's has one tensor of another shape: every rank raises
        own = _local_state(reference.state_dict())
        if rank == 1:
            own["state"][0]["momentum_buffer"] = own["state"][0]["momentum_buffer"][:-1]
        attempt("one_rank_off", opt, own)
        # 3. DTensor state in another layout (columns sharded) at this world size
        column_params = [
            (n, nn.Parameter(distribute_tensor(p.full_tensor().detach(), p.device_mesh, [Shard(p.ndim - 1)])))
            for n, p in params
        ]
        attempt("other_layout", opt, NorMuon(column_params, lr=0.02).state_dict())
        try:
            assert_unchanged(opt, tensors, before)
            out["unchanged"] = True
        except AssertionError as e:
            out["unchanged"] = f"changed: {e}"
        # 4. the matching state (DTensors, this layout) loads; then it steps like the reference
        attempt("matching", opt, copy.deepcopy(reference.state_dict()))
        for step in range(2, 4):
            set_gradients(params, step)
            set_gradients(ref_params, step)
            opt.step()
            reference.step()
        out["same_as_reference"] = all(
            torch.equal(p.full_tensor(), q.full_tensor()) for (_, p), (_, q) in zip(params, ref_params)
        )
        return out
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out


def test_plain_load_from_another_world_size_raises_at_load_on_every_rank():
    saved = run_distributed(_save_normuon, 3)
    assert all(isinstance(s, dict) for s in saved), saved
    results = run_distributed(_load_on_two, 2, saved)
    for rank, out in enumerate(results):
        assert "error" not in out, out
        assert re.match(
            r"ValueError: NorMuon\.load_state_dict: parameter 'layers\.0\.attention\.wq' \(normuon\), state "
            r"'momentum_buffer': the loaded tensor's local shape is \(7, 12\), this rank's layout of the parameter has "
            r"\(10, 12\)\. Nothing was loaded\. It was saved with another world size or sharding: load it through "
            r"torch\.distributed\.checkpoint",
            out["three_ranks"],
        ), out["three_ranks"]
        if rank == 1:
            assert re.match(
                r"ValueError: .*parameter 'layers\.0\.attention\.wq' \(normuon\), state 'momentum_buffer': the loaded "
                r"tensor's local shape is \(9, 12\), this rank's layout of the parameter has \(10, 12\)",
                out["one_rank_off"],
            ), out["one_rank_off"]
        else:
            assert re.match(
                r"ValueError: NorMuon: the loaded optimizer state does not fit this optimizer on another rank",
                out["one_rank_off"],
            ), out["one_rank_off"]
        assert re.match(
            r"ValueError: .*parameter 'layers\.0\.attention\.wq' \(normuon\), state 'momentum_buffer': the loaded "
            r"tensor's local shape is \(20, 6\), this rank's layout of the parameter has \(10, 12\)",
            out["other_layout"],
        ), out["other_layout"]
        assert out["unchanged"] is True, out["unchanged"]
        assert out["matching"] == "loaded" and out["same_as_reference"] is True, out
