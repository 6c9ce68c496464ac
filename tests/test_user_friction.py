"""What a first real user hits: routing made visible, copies, Tensor lr, old checkpoints, frozen parameters,
torch.optim.Muon's error messages. Numbers are checked against torch.optim.Muon / torch.optim.AdamW."""

from __future__ import annotations

import copy
import logging
import pickle
import re
import warnings

import pytest
import torch
from torch import nn

import dtensor_muon
from dtensor_muon import Muon, muon_param_groups
from dtensor_muon.plan.routing import ELEMENTWISE_NAME_COMPONENTS

OPTIONS = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
ADAMW_OPTIONS = dict(lr=0.02, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)


class TinyLM(nn.Module):
    """Embedding [200, 16] (long side 12.5× the short one), a 16 → 40 → 16 MLP, a norm, a head [200, 16]."""

    def __init__(self, embedding: type[nn.Embedding] = nn.Embedding, names: tuple[str, str] = ("tok", "head")) -> None:
        super().__init__()
        self.names = names
        setattr(self, names[0], embedding(200, 16))
        self.fc1 = nn.Linear(16, 40)
        self.fc2 = nn.Linear(40, 16)
        self.norm = nn.LayerNorm(16)
        setattr(self, names[1], nn.Linear(16, 200, bias=False))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = getattr(self, self.names[0])(tokens)
        x = self.norm(x + self.fc2(torch.relu(self.fc1(x))))
        return getattr(self, self.names[1])(x)


def backward(model: nn.Module, seed: int) -> None:
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, 200, (3, 5), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens)
    nn.functional.cross_entropy(logits.reshape(-1, 200), tokens.roll(1, dims=1).reshape(-1)).backward()


def routing_of(opt: Muon) -> dict[str, bool]:
    return {n: g["use_muon"] for g in opt.param_groups for n in g["param_names"]}


def torch_reference(model: nn.Module, muon_names: set[str]) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon on ``muon_names``, torch.optim.AdamW on every other parameter."""
    named = dict(model.named_parameters())
    muon = [p for n, p in named.items() if n in muon_names]
    adamw = [p for n, p in named.items() if n not in muon_names]
    return [torch.optim.Muon(muon, **OPTIONS), torch.optim.AdamW(adamw, **ADAMW_OPTIONS)]


def train_side_by_side(model, opt, ref_model, refs, steps: int, first_seed: int = 0) -> None:
    for step in range(steps):
        for m, opts in ((model, [opt]), (ref_model, refs)):
            backward(m, first_seed + step)
            for o in opts:
                o.step()


def assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------------------------------------------- 1. routing
def test_unnamed_parameters_warn_about_embedding_and_head_lookalikes():
    model = TinyLM()
    with pytest.warns(UserWarning, match=r"without names.*param\[0\] \(200×16\), param\[7\] \(200×16\) look like"):
        opt = Muon(model.parameters())
    # the routing itself is unchanged (by ndim, as torch.optim.Muon users expect): the warning says so
    assert len(opt.param_groups[0]["params"]) == 4 and opt.param_groups[0]["params"][3] is model.head.weight
    assert [len(g["params"]) for g in opt.param_groups] == [4, 4]


def test_no_warning_for_named_parameters_or_explicit_use_muon():
    model = TinyLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(model.named_parameters())
        Muon(
            [
                {"params": [model.tok.weight, model.head.weight], "use_muon": False},
                {"params": [model.fc1.weight, model.fc2.weight]},
            ]
        )
        Muon([{"params": [model.tok.weight, model.head.weight, model.fc1.weight], "use_muon": True}])
    # a 4× MLP alone (long side = 4 × short side, not more) is a hidden layer, not an embedding; its last
    # matrix may still be an output layer
    with pytest.warns(UserWarning, match=r"the last, param\[2\] \(16×64\), included") as record:
        Muon(nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16)).parameters())
    assert "like an embedding" not in str(record[0].message)


@pytest.mark.parametrize(
    "name", ["embed_in", "embed_out", "shared", "head", "embed", "score", "classifier", "token_embedding"]
)
def test_common_embedding_and_head_names_go_to_adamw_and_step_like_torch_adamw(name):
    assert name in ELEMENTWISE_NAME_COMPONENTS
    init = torch.randn(200, 16)
    ours, theirs = nn.Parameter(init.clone()), nn.Parameter(init.clone())
    opt = Muon([(f"model.{name}.weight", ours)], **OPTIONS)
    assert routing_of(opt) == {f"model.{name}.weight": False}
    ref = torch.optim.AdamW([theirs], **ADAMW_OPTIONS)
    for seed in range(3):
        g = torch.randn(init.shape, generator=torch.Generator().manual_seed(seed))
        ours.grad, theirs.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert torch.equal(ours, theirs)


def test_routing_summary_is_logged_one_line_per_rule_and_the_table_at_debug(caplog):
    model = TinyLM()
    model.fc1.requires_grad_(False)
    with caplog.at_level(logging.DEBUG, logger="dtensor_muon"):
        Muon(model.named_parameters())
    info = [r.getMessage() for r in caplog.records if r.name == "dtensor_muon" and r.levelno == logging.INFO]
    assert info == [
        "Muon routing: muon: 2 parameters (3,840 elements): tok.weight, fc2.weight",  # "tok" is no known name
        "Muon routing: adamw: 4 parameters (3,248 elements): fc2.bias, norm.weight, norm.bias, head.weight",
        "Muon routing: frozen (requires_grad=False, no state until it requires grad): 2 parameters (680 elements): "
        "fc1.weight, fc1.bias",
    ]
    debug = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
    assert "  head.weight  (200, 16)  adamw  group 1" in debug.splitlines()
    assert "  fc2.weight  (16, 40)  muon  group 0" in debug.splitlines()
    assert "  fc1.bias  (40,)  adamw (frozen)  group 1" in debug.splitlines()


def test_routing_summary_counts_repeated_layers_once_per_pattern(caplog):
    blocks = nn.ModuleDict({"layers": nn.ModuleList([nn.Linear(8, 8, bias=False) for _ in range(3)])})
    with caplog.at_level(logging.INFO, logger="dtensor_muon"):
        Muon(blocks.named_parameters())
    assert [r.getMessage() for r in caplog.records if r.name == "dtensor_muon"] == [
        "Muon routing: muon: 3 parameters (192 elements): layers.*.weight ×3"
    ]


class CustomEmbedding(nn.Embedding):
    """A subclass, as frameworks define them (scaled, parallel or quantized embeddings)."""


class HFStyleLM(TinyLM):
    def get_output_embeddings(self) -> nn.Module:
        return self.readout


@pytest.mark.parametrize("kind", ["plain", "subclass", "hf_head", "named_head"])
def test_muon_param_groups_routes_by_module_type_and_steps_like_torch(kind):
    """Embeddings under any name (here ``wordvec``), by type; the head by get_output_embeddings() or by name."""
    embedding = CustomEmbedding if kind == "subclass" else nn.Embedding
    cls = HFStyleLM if kind == "hf_head" else TinyLM
    model = cls(embedding, names=("wordvec", "readout"))
    ref_model = copy.deepcopy(model)
    adamw_names = ("readout",) if kind == "named_head" else ()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = Muon(muon_param_groups(model, adamw_names=adamw_names), **OPTIONS)
    expected_muon = {"fc1.weight", "fc2.weight"} | ({"readout.weight"} if kind in ("plain", "subclass") else set())
    assert {n for n, muon in routing_of(opt).items() if muon} == expected_muon
    refs = torch_reference(ref_model, expected_muon)
    train_side_by_side(model, opt, ref_model, refs, steps=3)
    assert_same_params(model, ref_model)


def test_muon_param_groups_adamw_modules_and_names_by_module_or_parameter():
    model = TinyLM()
    groups = muon_param_groups(model, adamw_modules=(nn.LayerNorm,), adamw_names=("fc1", "fc2.weight"))
    assert groups[0].get("use_muon") is None and groups[1]["use_muon"] is False
    assert [n for n, _ in groups[0]["params"]] == ["fc2.bias", "head.weight"]
    assert [n for n, _ in groups[1]["params"]] == [
        "tok.weight",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "norm.weight",
        "norm.bias",
    ]
    assert dtensor_muon.muon_param_groups is muon_param_groups


def test_muon_param_groups_rejects_unknown_names_and_non_module_types():
    model = TinyLM()
    with pytest.raises(ValueError, match=r"adamw_names: 'outptu' names no module or parameter of the model"):
        muon_param_groups(model, adamw_names=("outptu",))
    with pytest.raises(TypeError, match=r"adamw_modules: expected nn.Module subclasses, got 'Embedding'"):
        muon_param_groups(model, adamw_modules=("Embedding",))
    with pytest.raises(TypeError, match=r"adamw_names: expected a tuple of strings, got str"):
        muon_param_groups(model, adamw_names="head")


# ---------------------------------------------------------------------------------------------------- 3. copies
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_optimizer_takes_the_same_next_step(how):
    model = TinyLM()
    opt = Muon(model.named_parameters(), **OPTIONS)
    for seed in range(2):
        backward(model, seed)
        opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    copied = [p for g in twin.param_groups for p in g["params"]]
    original = [p for g in opt.param_groups for p in g["params"]]
    assert all(a is not b and torch.equal(a, b) for a, b in zip(original, copied))
    for seed in (5, 6):
        backward(model, seed)
        for a, b in zip(original, copied):
            b.grad = a.grad.clone()
        opt.step()
        twin.step()
    for a, b in zip(original, copied):
        assert torch.equal(a, b)
        for key, value in opt.state[a].items():
            assert torch.equal(value, twin.state[b][key])


def test_copy_of_an_overlap_optimizer_asks_for_attach_and_still_saves():
    model = TinyLM()
    twin = copy.deepcopy(Muon(model.named_parameters(), overlap=True))
    with pytest.raises(RuntimeError, match="attach"):
        twin.step()  # the copy has no hooks on any model: it says so instead of failing on a missing attribute
    assert twin.state_dict()["state"]


# ---------------------------------------------------------------------------------------------------- 4. Tensor lr
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_tensor_lr_equals_torch_muon_and_adamw(shape):
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(s, generator=g) for s in [(12, 20), (20, 12)]]
    vecs = [torch.randn(7, generator=g)]
    ours_m, theirs_m = [nn.Parameter(m.clone()) for m in mats], [nn.Parameter(m.clone()) for m in mats]
    ours_v, theirs_v = [nn.Parameter(v.clone()) for v in vecs], [nn.Parameter(v.clone()) for v in vecs]
    opt = Muon(ours_m + ours_v, **{**OPTIONS, "lr": torch.full(shape, 0.02)})
    refs = [
        torch.optim.Muon(theirs_m, **{**OPTIONS, "lr": torch.full(shape, 0.02)}),
        torch.optim.AdamW(theirs_v, **{**ADAMW_OPTIONS, "lr": torch.full(shape, 0.02)}),
    ]
    for _ in range(3):
        for a, b in zip(ours_m + ours_v, theirs_m + theirs_v):
            grad = torch.randn(a.shape, generator=g)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        for r in refs:
            r.step()
    for a, b in zip(ours_m + ours_v, theirs_m + theirs_v):
        assert torch.equal(a, b)


def test_each_split_group_gets_its_own_tensor_lr_so_plateau_halves_it_once():
    model = TinyLM()
    lr = torch.tensor(0.01)
    opt = Muon(model.named_parameters(), lr=lr)
    ref = torch.optim.AdamW(TinyLM().parameters(), lr=torch.tensor(0.01))
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs[0] is lr and lrs[1] is not lr
    for o in (opt, ref):
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0)
        sched.step(1.0)
        sched.step(1.0)
    assert float(ref.param_groups[0]["lr"]) == pytest.approx(0.005)
    assert [float(g["lr"]) for g in opt.param_groups] == [float(ref.param_groups[0]["lr"])] * 2


def test_groups_taking_the_default_tensor_lr_do_not_share_it():
    a, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4))
    opt = Muon([{"params": [a]}, {"params": [b]}], lr=torch.tensor(0.01))
    assert opt.param_groups[0]["lr"] is not opt.param_groups[1]["lr"]


# ---------------------------------------------------------------------------------------------------- 5. old checkpoints
@pytest.mark.parametrize("number", [2, 2.0])
def test_loading_a_python_number_step_converts_it_like_torch_adamw(number):
    model = TinyLM()
    opt = Muon(model.named_parameters(), **OPTIONS)
    for seed in range(2):
        backward(model, seed)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for s in saved["state"].values():
        if "step" in s:
            s["step"] = number
    clone = copy.deepcopy(model)
    resumed = Muon(clone.named_parameters(), **OPTIONS)
    resumed.load_state_dict(saved)
    # torch.optim.AdamW turns the same number into the same tensor on load
    ref = torch.optim.AdamW([nn.Parameter(torch.zeros(3))])
    ref.load_state_dict(
        {
            "state": {0: {"step": number, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}},
            "param_groups": [{**ref.param_groups[0], "params": [0]}],
        }
    )
    ref_step = ref.state[ref.param_groups[0]["params"][0]]["step"]
    for p in clone.parameters():
        if "step" in resumed.state[p]:
            step = resumed.state[p]["step"]
            assert torch.is_tensor(step) and step.dtype == ref_step.dtype and step.device == ref_step.device
            assert torch.equal(step, ref_step)
    backward(model, 7)
    backward(clone, 7)
    opt.step()
    resumed.step()
    assert_same_params(model, clone)


# ---------------------------------------------------------------------------------------------------- 6. frozen params
def frozen_model() -> TinyLM:
    model = TinyLM()
    model.fc1.requires_grad_(False)
    model.tok.requires_grad_(False)
    return model


def test_frozen_parameters_get_no_state_and_no_plan_entry_and_the_rest_steps_like_torch():
    model = frozen_model()
    ref_model = copy.deepcopy(model)
    opt = Muon(model.named_parameters(), **OPTIONS)
    assert set(opt.state) == {p for p in model.parameters() if p.requires_grad}
    assert {r.spec.name for plan in opt.plans for r in plan.routes} == {"fc2.weight"}
    refs = torch_reference(ref_model, {n for n, muon in routing_of(opt).items() if muon})
    train_side_by_side(model, opt, ref_model, refs, steps=3)
    assert_same_params(model, ref_model)


def test_parameter_unfrozen_later_gets_fresh_state_at_its_first_step_like_torch():
    model = frozen_model()
    ref_model = copy.deepcopy(model)
    opt = Muon(model.named_parameters(), **OPTIONS)
    refs = torch_reference(ref_model, {n for n, muon in routing_of(opt).items() if muon})
    train_side_by_side(model, opt, ref_model, refs, steps=2)
    for m in (model, ref_model):
        m.fc1.requires_grad_(True)
    train_side_by_side(model, opt, ref_model, refs, steps=2, first_seed=10)
    assert_same_params(model, ref_model)
    assert model.fc1.weight in opt.state and "fc1.weight" in {r.spec.name for p in opt.plans for r in p.routes}
    assert torch.equal(
        opt.state[model.fc1.weight]["momentum_buffer"], refs[0].state[ref_model.fc1.weight]["momentum_buffer"]
    )


def test_dcp_state_dict_with_frozen_parameters_round_trips():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model = frozen_model()
    opt = Muon(model.named_parameters(), **OPTIONS)
    for seed in range(2):
        backward(model, seed)
        opt.step()
    saved = copy.deepcopy(get_optimizer_state_dict(model, opt))
    assert set(saved["state"]) == {n for n, p in model.named_parameters() if p.requires_grad}
    clone = copy.deepcopy(model)
    resumed = Muon(clone.named_parameters(), **OPTIONS)
    set_optimizer_state_dict(clone, resumed, saved)
    assert set(resumed.state) == {p for p in clone.parameters() if p.requires_grad}
    assert_same_params(model, clone)
    backward(model, 9)
    backward(clone, 9)
    opt.step()
    resumed.step()
    assert_same_params(model, clone)


# ---------------------------------------------------------------------------------------------------- 9. messages
def torch_message(kwargs: dict, step: bool = False) -> str:
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError) as info:
        opt = torch.optim.Muon([p], **kwargs)
        if step:
            p.grad = torch.randn_like(p)
            opt.step()
    return str(info.value)


@pytest.mark.parametrize(
    "kwargs, argument, step",
    [
        (dict(lr=-1.0), "lr", False),
        (dict(lr=torch.tensor([0.1, 0.2])), "lr", False),
        (dict(momentum=-0.1), "momentum", False),
        (dict(weight_decay=-0.1), "weight_decay", False),
        (dict(adjust_lr_fn="bogus"), "adjust_lr_fn", False),
        (dict(ns_steps=100), "ns_steps", True),
    ],
)
def test_bad_shared_arguments_say_what_torch_says_and_name_the_argument(kwargs, argument, step):
    expected = torch_message(kwargs, step)
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        Muon([nn.Parameter(torch.randn(4, 4))], **kwargs)
    assert str(info.value).startswith(f"{argument}: ")


def test_tensor_lr_of_a_param_group_must_be_one_element():
    with pytest.raises(ValueError, match=r"lr: Tensor lr must be 1-element"):
        Muon([{"params": [nn.Parameter(torch.randn(4, 4))], "lr": torch.tensor([0.1, 0.2])}])


def test_add_param_group_after_construction_logs_and_warns_for_its_parameters(caplog):
    with pytest.warns(UserWarning, match=r"the one matrix, param\[0\] \(8×8\)"):
        opt = Muon([nn.Parameter(torch.randn(8, 8))])
    with (
        caplog.at_level(logging.INFO, logger="dtensor_muon"),
        pytest.warns(UserWarning, match=r"param\[1\] \(300×8\) looks like"),
    ):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(300, 8))]})
    assert [r.getMessage() for r in caplog.records if r.name == "dtensor_muon"] == [
        "Muon routing: muon: 1 parameter (2,400 elements): param[1] (300×8)"
    ]


# ---------------------------------------------------------------------------------------------------- FSDP2, 2 ranks
FROZEN_BLOCK = 1
UNFREEZE_AT = 2


def fsdp_frozen_training(rank: int, world_size: int, overlap: bool, steps: int) -> dict:
    """FSDP2 Blocks with block 1 frozen until step 2; a deepcopy of the optimizer taken after step 1 is fed
    the same gradients. Returns the initial and final full parameters, the fed gradients and the copy's."""
    import scenarios
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = scenarios.Blocks()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.blocks[FROZEN_BLOCK].requires_grad_(False)
    mesh = scenarios.make_mesh("shard0", world_size)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = Muon(model.named_parameters(), overlap=overlap, **scenarios.OPTIONS)
    opt.attach(model)
    frozen_state = [p in opt.state for p in model.blocks[FROZEN_BLOCK].parameters()]
    fed, twin, opt_params, twin_params = [], None, [], []
    for step in range(steps):
        if step == UNFREEZE_AT:
            model.blocks[FROZEN_BLOCK].requires_grad_(True)
        tokens = torch.randint(0, 29, (3, 5), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 29), tokens.roll(1, dims=1).reshape(-1))
        loss.backward()
        fed.append({n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None})
        if twin is not None:
            for p, q in zip(opt_params, twin_params):  # the copy's parameters are copies: unfreeze them too
                q.requires_grad_(p.requires_grad)
                q.grad = None if p.grad is None else p.grad.clone()
            twin.step()
        opt.step()
        opt.zero_grad()
        if step == 1 and not overlap:
            twin = copy.deepcopy(opt)
            opt_params = [p for g in opt.param_groups for p in g["params"]]
            twin_params = [p for g in twin.param_groups for p in g["params"]]
    opt.flush()
    names = [n for g in opt.param_groups for n in g["param_names"]]
    return {
        "initial": initial,
        "fed": fed,
        "frozen_state": frozen_state,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "twin": None if twin is None else {n: p.full_tensor() for n, p in zip(names, twin_params)},
    }


@pytest.mark.slow
def test_fsdp_frozen_then_unfrozen_block_equals_torch_with_and_without_overlap_and_a_deepcopy_follows():
    from dist_harness import run_distributed

    steps = 4
    runs = {overlap: run_distributed(fsdp_frozen_training, 2, overlap, steps)[0] for overlap in (False, True)}
    base = runs[False]
    assert base["frozen_state"] == [False] * 4
    # reference: torch.optim.Muon on the block matrices, torch.optim.AdamW on the rest, fed the same gradients
    params = {n: nn.Parameter(t.clone()) for n, t in base["initial"].items()}
    muon_names = {n for n, t in params.items() if n.startswith("blocks.") and t.ndim == 2}
    import scenarios

    muon_options = dict(
        lr=scenarios.OPTIONS["lr"],
        weight_decay=scenarios.OPTIONS["weight_decay"],
        adjust_lr_fn=scenarios.OPTIONS["adjust_lr_fn"],
    )
    refs = [
        torch.optim.Muon([p for n, p in params.items() if n in muon_names], **muon_options),
        torch.optim.AdamW(
            [p for n, p in params.items() if n not in muon_names],
            lr=scenarios.OPTIONS["lr"],
            weight_decay=scenarios.OPTIONS["weight_decay"],
            betas=(0.9, 0.95),
            eps=1e-8,
        ),
    ]
    for grads in base["fed"]:
        for n, p in params.items():
            p.grad = grads.get(n)
        for r in refs:
            r.step()
    assert any(n.startswith(f"blocks.{FROZEN_BLOCK}.") for n in base["fed"][UNFREEZE_AT])
    assert not any(n.startswith(f"blocks.{FROZEN_BLOCK}.") for n in base["fed"][UNFREEZE_AT - 1])
    for n, p in params.items():
        assert torch.equal(base["params"][n], p), n
        assert torch.equal(runs[True]["params"][n], p), n
        assert torch.equal(base["twin"][n], p), n
