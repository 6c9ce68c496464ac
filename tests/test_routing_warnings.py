"""Routing warnings a first user meets: the output layer of an nn.Sequential (named by position only) and
unnamed matrices (an output head cannot be recognized; embedding/head lookalikes are flagged); each warning
points at the user's line (this file), not the library's, and names an unnamed parameter by its position in
the parameters given and its shape."""

import copy
import logging
import warnings

import pytest
import torch
from torch import nn

from dtensor_muon import SOAP, Muon, NorMuon, muon_param_groups
from dtensor_muon.optim.param_groups import sequential_output_linear


def classifier() -> nn.Sequential:
    """A plain MLP classifier: its layer 6 (10×128) feeds the loss."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, 10),
    )


def test_sequential_output_layer_warns_at_the_callers_line():
    model = classifier()
    with pytest.warns(UserWarning, match=r"6\.weight \(10×128\) is the last layer of an nn\.Sequential") as record:
        opt = Muon(model.named_parameters(), lr=0.02)
    assert [w.filename for w in record] == [__file__]
    assert next(g for g in opt.param_groups if g["use_muon"])["param_names"] == ["1.weight", "3.weight", "6.weight"]


@pytest.mark.parametrize("cls", [Muon, NorMuon, SOAP])
def test_muon_param_groups_sends_a_sequentials_output_layer_to_adamw_without_a_warning(cls):
    model = classifier()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = cls(muon_param_groups(model), lr=0.02)
    by_rule = {
        rule: [n for g in opt.param_groups if g["use_muon"] is rule for n in g["param_names"]] for rule in (True, False)
    }
    assert by_rule[True] == ["1.weight", "3.weight"]
    assert by_rule[False] == ["1.bias", "3.bias", "6.weight", "6.bias"]


def test_explicit_use_muon_silences_the_sequential_warning():
    model = classifier()
    named = dict(model.named_parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(
            [
                {"params": [(n, p) for n, p in named.items() if n != "6.weight"]},
                {"params": [("6.weight", named["6.weight"])], "use_muon": True},
            ]
        )


def test_sequential_output_linear_follows_nesting_and_stops_where_the_structure_says_nothing():
    nested = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.GELU()), nn.Sequential(nn.Linear(16, 4)), nn.Softmax(-1))
    assert sequential_output_linear(nested) is nested[1][0]
    with pytest.warns(UserWarning, match=r"1\.0\.weight \(4×16\)"):
        Muon(nested.named_parameters())

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    assert sequential_output_linear(nn.Sequential(nn.Linear(8, 16), Block())) is None
    assert sequential_output_linear(nn.Linear(8, 16)) is None


@pytest.mark.parametrize("cls", [Muon, NorMuon, SOAP])
def test_unnamed_lookalike_warning_points_at_the_callers_line(cls):
    embedding, hidden = nn.Parameter(torch.randn(300, 8)), nn.Parameter(torch.randn(8, 8))
    with pytest.warns(UserWarning, match=r"param\[0\] \(300×8\) looks like an embedding") as record:
        opt = cls([embedding, hidden], lr=0.01)
    assert [w.filename for w in record] == [__file__]
    with pytest.warns(UserWarning, match=r"the one matrix, param\[2\] \(400×8\), goes to") as record:
        opt.add_param_group({"params": [nn.Parameter(torch.randn(400, 8))]})
    assert [w.filename for w in record] == [__file__]


def test_routing_log_names_the_optimizer_that_runs(caplog):
    """KLSOAP and REKLS run SOAP's rule: their routing line says which optimizer it is."""
    from dtensor_muon import KLSOAP, REKLS

    for cls, title in ((KLSOAP, "KLSOAP (soap rule)"), (REKLS, "REKLS (soap rule)"), (Muon, "muon")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dtensor_muon"):
            cls([("w.weight", nn.Parameter(torch.randn(8, 8)))], lr=0.01)
        assert [r.getMessage() for r in caplog.records if r.name == "dtensor_muon"] == [
            f"{cls.__name__} routing: {title}: 1 parameter (64 elements): w.weight"
        ]


class SmallClassifier(nn.Module):
    """A 20 → 64 → 45 MLP with a 7-class head: the head (7×45) is neither the widest nor an elongated matrix."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(20, 64)
        self.fc2 = nn.Linear(64, 45)
        self.out = nn.Linear(45, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


@pytest.mark.parametrize("cls", [Muon, NorMuon, SOAP])
def test_unnamed_parameters_warn_that_a_small_classifier_head_cannot_be_recognized(cls):
    model = SmallClassifier()
    with pytest.warns(UserWarning) as record:
        opt = cls(model.parameters(), lr=0.02)
    assert [w.filename for w in record] == [__file__]
    (message,) = [str(w.message) for w in record]
    assert "without names, so a classifier or output head" in message
    assert "all 3 matrices go to" in message and "the last, param[4] (7×45), included" in message
    assert "looks like an embedding" not in message  # the head has no telling shape
    assert f"{cls.__name__}(model.named_parameters())" in message and '"use_muon": False' in message
    # what the warning says is so: the head went to the matrix rule
    assert next(g for g in opt.param_groups if g["use_muon"])["params"][-1] is model.out.weight


def test_routing_log_lists_unnamed_parameters_by_their_position_as_given_with_shapes(caplog):
    model = SmallClassifier()
    with caplog.at_level(logging.DEBUG, logger="dtensor_muon"), pytest.warns(UserWarning):
        Muon(model.parameters(), lr=0.02)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info == [
        "Muon routing: muon: 3 parameters (4,475 elements): param[0] (64×20), param[2] (45×64), param[4] (7×45)",
        "Muon routing: adamw: 3 parameters (116 elements): param[1] (64), param[3] (45), param[5] (7)",
    ]
    (table,) = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert [line.split()[0] for line in table.splitlines()[1:]] == [f"param[{i}]" for i in range(6)]
    assert "  param[4]  (7, 45)  muon  group 0" in table.splitlines()


def test_positions_count_across_groups_and_survive_a_copy():
    model = SmallClassifier()
    with pytest.warns(UserWarning, match=r"the last, param\[2\] \(45×64\), included"):
        opt = Muon([{"params": [model.fc1.weight, model.fc1.bias]}, {"params": [model.fc2.weight]}], lr=0.02)
    for optimizer in (opt, copy.deepcopy(opt)):
        for p in (p for group in optimizer.param_groups for p in group["params"]):
            p.grad = torch.ones_like(p)
        optimizer.param_groups[0]["params"][0].grad[0, 0] = float("inf")  # param[0], fc1.weight
        with pytest.warns(RuntimeWarning, match=r"'param\[0\]'"):
            optimizer.step()


def test_a_matrix_routed_to_adamw_by_hand_or_use_muon_true_silences_the_unnamed_warning():
    model = SmallClassifier()
    body = [*model.fc1.parameters(), *model.fc2.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([{"params": body}, {"params": model.out.parameters(), "use_muon": False}], lr=0.02)
        Muon([{"params": [model.fc1.weight, model.fc2.weight, model.out.weight], "use_muon": True}], lr=0.02)
