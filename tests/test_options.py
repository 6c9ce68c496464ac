"""The options table (:data:`dtensor_muon.optim.options.OPTIONS`) against what it declares: each front end's
signature, its validation, both torchtitan lines' sections and docs/options.md."""

import inspect
from pathlib import Path

import pytest
import torch

import dtensor_muon
from dtensor_muon.optim.base import GROUP_KEYS_SINCE_CHECKPOINTS
from dtensor_muon.optim.options import NOT_IN_CONFIG, OPTIONS, TP_MODES, Option, option_table

ROOT = Path(__file__).resolve().parents[1]


def keywords(name: str) -> dict[str, inspect.Parameter]:
    """The constructor keywords of ``dtensor_muon.<name>`` (all but ``params``)."""
    parameters = inspect.signature(getattr(dtensor_muon, name).__init__).parameters
    return {n: p for n, p in parameters.items() if n not in ("self", "params")}


@pytest.mark.parametrize("name", OPTIONS)
def test_the_table_is_the_front_ends_signature_and_defaults(name):
    """Names and defaults of the constructor keywords (KL-SOAP and REKLS take SOAP's, changing two defaults), and
    the param-group values an optimizer built with no keywords holds."""
    table = {o.name: o for o in OPTIONS[name]}
    signature = keywords(name if name not in ("KLSOAP", "REKLS") else "SOAP")
    assert set(table) == set(signature)
    for key, parameter in signature.items():
        assert table[key].default == parameter.default or name in ("KLSOAP", "REKLS"), key
    group = next(g for g in build(name).param_groups if g["use_muon"])
    for option in table.values():
        if option.engine:
            continue
        if GROUP_KEYS_SINCE_CHECKPOINTS.get(option.name, object()) == option.default:
            assert option.name not in group, option.name  # held only at another value: old checkpoints load
        else:
            assert group[option.name] == option.default, option.name


def test_an_engine_option_in_a_param_group_is_refused_naming_the_constructor_keyword():
    for name, options in OPTIONS.items():
        for option in options:
            if option.engine:
                groups = [{"params": list(tiny_model().parameters()), option.name: option.default}]
                with pytest.raises(ValueError, match=f"{option.name!r} is a constructor keyword"):
                    getattr(dtensor_muon, name)(groups)


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.Linear(8, 4))


def build(name: str, **kwargs):
    """``dtensor_muon.<name>`` on :func:`tiny_model`, its last layer routed to the matrix rule on purpose."""
    groups = [{"params": list(tiny_model().parameters()), "use_muon": None}]
    return getattr(dtensor_muon, name)(groups, **kwargs)


def keyword_values(option: Option) -> list:
    """Values the table allows for ``option``, as constructor keywords."""
    if option.choices:
        return [option.keyword_value(choice) for choice in option.choices]
    if isinstance(option.default, bool):
        return [True, False]
    return []


def compatible(option: Option, value) -> dict:
    """The other keywords a value needs: a Newton–Schulz dtype other than bf16 needs a wire that does not round
    its input."""
    if option.name == "ns_dtype" and value != torch.bfloat16:
        return {"wire_dtype": torch.float32}
    return {}


@pytest.mark.parametrize("name", OPTIONS)
def test_every_allowed_value_builds_the_optimizer(name):
    for option in OPTIONS[name]:
        for value in keyword_values(option):
            build(name, **{option.name: value, **compatible(option, value)})


def outside(option: Option):
    """A value just outside ``option``'s bounds, or None where it has none."""
    bound = option.bounds
    if bound == "[0, 1)":
        return (1.0, 1.0) if isinstance(option.default, tuple) else 1.0
    if bound == "[0, 1]":
        return 1.5
    if bound == "> 0":
        return 0.0
    if bound == ">= 0":
        return -1e-3
    if bound.startswith("integer >= "):
        return int(bound.removeprefix("integer >= ")) - 1
    return None


@pytest.mark.parametrize("name", OPTIONS)
def test_a_value_outside_the_bounds_or_choices_raises_naming_the_option(name):
    for option in OPTIONS[name]:
        bad = outside(option) if not option.choices else "no such choice"
        if option.is_dtype:
            bad = torch.int8
        if bad is None:
            continue
        with pytest.raises((ValueError, TypeError)) as info:
            build(name, **{option.name: bad})
        assert option.name in str(info.value), (option.name, str(info.value))
    refused = [mode for mode in TP_MODES if mode not in next(o for o in OPTIONS[name] if o.name == "tp_mode").choices]
    for mode in refused:  # Newton–Schulz's distributed forms, for MOP and SOAP
        with pytest.raises(ValueError, match="tp_mode"):
            build(name, tp_mode=mode)


@pytest.mark.parametrize("name", OPTIONS)
def test_every_option_is_reachable_from_torchtitan_or_says_why_not(name):
    pytest.importorskip("torchtitan")
    from torchtitan_ext import registry

    entry = registry.REGISTRY[name]
    section = entry.section_cls()
    for option in OPTIONS[name]:
        if option.from_optimizer:
            assert option.config_default != NOT_IN_CONFIG
        elif option.in_section:
            assert getattr(section, option.name) == option.section_default, option.name
        else:
            assert option.config_why, option.name
    optimizer_config = type("OptimizerConfig", (), {"lr": 0.5, "weight_decay": 0.25, "beta1": 0.8, "beta2": 0.9,
                                                     "eps": 1e-6})()  # fmt: skip
    kwargs = entry.kwargs(optimizer_config, section)
    expected = {o.name for o in OPTIONS[name] if o.from_optimizer or o.in_section}
    assert set(kwargs) == expected
    assert kwargs["lr"] == 0.5 and kwargs["weight_decay"] == 0.25
    build(name, **kwargs)  # the config's keywords build it


def test_options_not_in_any_config_are_few_and_named():
    missing = {o.name for options in OPTIONS.values() for o in options if o.config_default == NOT_IN_CONFIG}
    assert missing == {"eps", "adamw_lr", "adamw_weight_decay", "matrix_splits", "qk_clip_heads"}


def test_the_docs_page_shows_each_table():
    page = (ROOT / "docs" / "options.md").read_text()
    for name in OPTIONS:
        assert f"## {name}\n\n{option_table(name)}\n" in page, (
            f"docs/options.md's {name} table differs from dtensor_muon.optim.options; print it with "
            f'python -c "from dtensor_muon.optim.options import option_table; print(option_table({name!r}))"'
        )


def test_the_section_defaults_that_differ_say_why():
    for options in OPTIONS.values():
        for option in options:
            if option.in_section and option.section_default != option.default and not option.is_dtype:
                assert option.config_why, option.name
