"""Checkpoints and pickles written by an earlier layout of the library load and take the same next step.

The fixtures (``tests/data/checkpoint_compat/``, written by :mod:`checkpoint_fixtures` while the modules stood
flat under ``src/dtensor_muon/``) name ``dtensor_muon.views.MatrixSplit``: a torch.distributed.checkpoint, a
``torch.save`` d state dict and a pickled optimizer, for Muon and SOAP with a param group cut by a ``MatrixSplit``.
Each loads into the current code and its next step equals the saved one bit for bit, where this machine's CPU
rounds as the one that wrote them did (``arithmetic.pt``; elsewhere within a tolerance far below one step).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import checkpoint_fixtures as fx
import pytest
import torch
from dist_harness import one_thread

from dtensor_muon import MatrixSplit

OLD_PATH = "dtensor_muon.views.MatrixSplit"
"""Where ``MatrixSplit`` was defined when the fixtures were written: the module path their pickles name."""


@pytest.fixture(autouse=True)
def on_one_thread() -> Iterator[None]:
    """The fixtures were computed on one thread (torch's CPU products may round differently with more)."""
    with one_thread():
        yield


def same_arithmetic() -> bool:
    """Whether this machine computes the operations of ``arithmetic.pt`` bit for bit as the fixtures' did."""
    saved = torch.load(fx.DATA / "arithmetic.pt")
    now = fx.arithmetic()
    return set(saved) == set(now) and all(torch.equal(saved[k], now[k]) for k in saved)


def expected_split(name: str) -> MatrixSplit:
    return fx.SPLITS[0] if name == "muon" else fx.SPLITS[2]


def assert_takes_the_saved_next_step(name: str, params: dict[str, torch.Tensor], opt: torch.optim.Optimizer) -> None:
    """The fixture's next gradients, one step, and the parameters equal the saved ones."""
    saved = torch.load(fx.DATA / f"{name}_next.pt")
    assert set(params) == set(saved["params"])
    fx.set_gradients(params, saved["grads"])
    opt.step()
    exact = same_arithmetic()
    for n, p in params.items():
        if exact:
            assert torch.equal(p.detach(), saved["params"][n]), n
        else:  # another CPU's rounding: a state that did not load would be off by about lr (1e-2)
            torch.testing.assert_close(p.detach(), saved["params"][n], rtol=0, atol=1e-3, msg=n)


def assert_split_group(name: str, opt: torch.optim.Optimizer) -> None:
    """The loaded param groups hold the checkpoint's split, an instance of today's class."""
    split = opt.param_groups[0]["matrix_split"]
    assert type(split) is MatrixSplit
    assert split == expected_split(name)


@pytest.mark.parametrize("file", ["matrix_split.pkl", "matrix_split_protocol2.pkl"])
def test_a_pickled_matrix_split_loads_as_todays_class(file):
    raw = (fx.DATA / file).read_bytes()
    assert b"dtensor_muon.views" in raw  # the fixture names the old module
    blob = pickle.loads(raw)
    assert len(blob["splits"]) == len(fx.SPLITS)
    for split, (dim, sizes, block, groups) in zip(blob["splits"], blob["fields"]):
        assert type(split) is MatrixSplit
        assert split == MatrixSplit(dim, sizes=sizes, block=block, groups=groups)


@pytest.mark.parametrize("name", fx.OPTIMIZERS)
def test_a_dcp_checkpoint_loads_and_takes_the_saved_next_step(name):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model, opt = fx.build(name)
    options = StateDictOptions(flatten_optimizer_state_dict=name == "muon")
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=options)}
    dcp.load(state, checkpoint_id=str(fx.DATA / f"{name}_dcp"))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=options)
    assert_split_group(name, opt)
    assert_takes_the_saved_next_step(name, dict(model.named_parameters()), opt)


@pytest.mark.parametrize("name", fx.OPTIMIZERS)
def test_a_saved_state_dict_loads_and_takes_the_saved_next_step(name):
    saved = torch.load(fx.DATA / f"{name}_state_dict.pt", weights_only=False)
    model, opt = fx.build(name)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    assert_split_group(name, opt)
    assert_takes_the_saved_next_step(name, dict(model.named_parameters()), opt)


def test_a_saved_state_dict_loads_with_weights_only_when_the_old_path_is_allowed():
    """``torch.load(weights_only=True)`` accepts only allowed globals, by the path a file names: a file written
    before the move names the old one, so it is allowed under that path."""
    path = fx.DATA / "muon_state_dict.pt"
    with torch.serialization.safe_globals([(MatrixSplit, OLD_PATH)]):
        saved = torch.load(path, weights_only=True)
    assert saved["optim"]["param_groups"][0]["matrix_split"] == expected_split("muon")


@pytest.mark.parametrize("name", fx.OPTIMIZERS)
def test_a_pickled_optimizer_loads_and_takes_the_saved_next_step(name):
    opt = pickle.loads((fx.DATA / f"{name}_optimizer.pkl").read_bytes())
    assert_split_group(name, opt)
    assert opt._matrix_splits == ({"w": fx.SPLITS[1]} if name == "muon" else {})
    params = {n: p for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    assert_takes_the_saved_next_step(name, params, opt)
