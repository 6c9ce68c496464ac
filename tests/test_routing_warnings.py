"""Routing warnings a first user meets: the output layer of an nn.Sequential (named by position only) and
unnamed embedding/head lookalikes; each warning points at the user's line (this file), not the library's."""

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
    with pytest.warns(UserWarning, match=r"params\[0\] \(300×8\)") as record:
        opt = cls([embedding, hidden], lr=0.01)
    assert [w.filename for w in record] == [__file__]
    with pytest.warns(UserWarning, match=r"params\[2\] \(400×8\)") as record:
        opt.add_param_group({"params": [nn.Parameter(torch.randn(400, 8))]})
    assert [w.filename for w in record] == [__file__]


def test_routing_log_names_the_optimizer_that_runs(caplog):
    """KLSOAP and REKLS run SOAP's rule: their routing line says which optimizer it is."""
    import logging

    from dtensor_muon import KLSOAP, REKLS

    for cls, title in ((KLSOAP, "KLSOAP (soap rule)"), (REKLS, "REKLS (soap rule)"), (Muon, "muon")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dtensor_muon"):
            cls([("w.weight", nn.Parameter(torch.randn(8, 8)))], lr=0.01)
        assert [r.getMessage() for r in caplog.records if r.name == "dtensor_muon"] == [
            f"{cls.__name__} routing: {title}: 1 parameter (64 elements): w.weight"
        ]
