"""The config sections of the matrix optimizers: ``[muon]``, ``[mop]``, ``[normuon]``, ``[soap]``, ``[klsoap]``
and ``[rekls]``, built from the options table (:data:`dtensor_muon.optim.options.OPTIONS`), and ``[batch_scaling]``.

Each section is a dataclass holding one optimizer's options beyond the shared ``[optimizer]`` ones (lr, betas,
eps, weight decay): every option of its table that the table puts in the section, with the table's section
default, type (a ``Literal`` of the allowed names where it has choices) and line of help. :mod:`torchtitan_ext.
registry` pairs it with its ``[optimizer] name`` and its optimizer class. ``SECTION`` is its TOML section name.
Values are checked in ``__post_init__``, i.e. when torchtitan builds the config (from TOML or the command line),
against the table's choices and bounds and the section's cross-option rules: a bad value raises ``ValueError``
naming ``[section] key = value`` and the valid choices, before any process group exists.

No ``from __future__ import annotations`` here: torchtitan's config manager and tyro read the fields' types as
classes.
"""

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import tyro

from dtensor_muon.optim.options import OPTIONS, Option


def check_choice(section: str, name: str, value: object, choices: tuple[str, ...] | list[str]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"[{section}] {name} = {value!r} is not valid; choose one of: {', '.join(choices)}")


def check_positive(section: str, name: str, value: float, *, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` > 0 (>= 0 with ``allow_zero``)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"[{section}] {name} = {value!r} is not valid; it must be {bound}")


def check_unit_interval(section: str, name: str, value: float) -> None:
    """Raise ``ValueError`` unless 0 <= ``value`` < 1."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"[{section}] {name} = {value!r} is not valid; it must lie in [0, 1)")


def check_integer(section: str, name: str, value: object, least: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer >= ``least``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"[{section}] {name} = {value!r} is not valid; it must be an integer >= {least}")


def check_option(section: str, option: Option, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is allowed by ``option``'s choices or bounds."""
    if option.choices:
        check_choice(section, option.name, value, option.choices)
    elif option.bounds == "[0, 1)":
        check_unit_interval(section, option.name, value)
    elif option.bounds == "[0, 1]" and not 0.0 <= value <= 1.0:
        raise ValueError(f"[{section}] {option.name} = {value!r} is not valid; it must lie in [0, 1]")
    elif option.bounds in ("> 0", ">= 0"):
        check_positive(section, option.name, value, allow_zero=option.bounds == ">= 0")
    elif option.bounds.startswith("integer >= "):
        check_integer(section, option.name, value, int(option.bounds.removeprefix("integer >= ")))


def section_options(optimizer: str) -> tuple[Option, ...]:
    """The options of ``optimizer``'s table that its config section holds, in table order."""
    return tuple(o for o in OPTIONS[optimizer] if o.in_section)


def _field_type(option: Option) -> Any:
    kind = Literal[option.choices] if option.choices else type(option.section_default)
    return Annotated[kind, tyro.conf.arg(help=option.doc)]


def _section_class(
    optimizer: str, section: str, doc: str, check: Callable[[Any], None] | None = None, base: type | None = None
) -> type:
    """The dataclass of ``optimizer``'s section: its table's section options as fields, checked on creation."""
    options = section_options(optimizer)

    def __post_init__(self: Any) -> None:
        """Reject bad values with the list of valid ones (the section's own rule first: it says why)."""
        if check is not None:
            check(self)
        for option in options:
            check_option(section, option, getattr(self, option.name))

    fields = [(o.name, _field_type(o), dataclasses.field(default=o.section_default)) for o in options]
    namespace = {"SECTION": section, "__post_init__": __post_init__, "__doc__": doc, "__module__": __name__}
    cls = dataclasses.make_dataclass(optimizer, fields, bases=(base,) if base else (), namespace=namespace)
    cls.__annotations__["SECTION"] = ClassVar[str]
    return cls


def _wire_within_ns_dtype(config: Any) -> None:
    if config.wire_dtype == "bfloat16" and config.ns_dtype != "bfloat16":
        raise ValueError(
            f"[{config.SECTION}] wire_dtype = 'bfloat16' would round the {config.ns_dtype} Newton–Schulz input; "
            "choose wire_dtype = 'float32' or ns_dtype = 'bfloat16'"
        )


def _float32_wire(why: str) -> Callable[[Any], None]:
    def check(config: Any) -> None:
        if config.wire_dtype == "bfloat16":
            raise ValueError(f"[{config.SECTION}] wire_dtype = 'bfloat16' is not valid: {why}; choose one of: float32")

    return check


_SOAP_WIRE = _float32_wire("SOAP's factors are float32 and a bfloat16 wire would round the gradient")
"""The float32-only wire of ``[soap]``, ``[klsoap]`` and ``[rekls]``."""

Muon = _section_class(
    "Muon",
    "muon",
    'Muon\'s options beyond the shared ``[optimizer]`` ones (used when ``optimizer.name = "Muon"``).',
    _wire_within_ns_dtype,
)
NorMuon = _section_class(
    "NorMuon",
    "normuon",
    'NorMuon\'s options (used when ``optimizer.name = "NorMuon"``): those of ``[muon]``, same defaults, plus '
    "the per-row second moment of the orthogonalized update.",
    _wire_within_ns_dtype,
    base=Muon,
)
MOP = _section_class(
    "MOP",
    "mop",
    "MOP's options beyond the shared ``[optimizer]`` ones (used when ``optimizer.name = \"MOP\"``): Muon's "
    "momentum, orthogonalized by the exact polar factor of a float32 SVD on each matrix's owner; the wire is "
    "float32 only (a bfloat16 wire would round the SVD's input).",
    _float32_wire("MOP's SVD runs in float32 and a bfloat16 wire would round its input"),
)
SOAP = _section_class(
    "SOAP",
    "soap",
    'SOAP\'s options beyond the shared ``[optimizer]`` ones (used when ``optimizer.name = "SOAP"``): Adam '
    "(``[optimizer]`` beta1, beta2, eps) in the eigenbasis of Shampoo's factors, on each matrix's owner; the "
    "wire is float32 only (SOAP's factors are float32).",
    _SOAP_WIRE,
)
KLSOAP = _section_class(
    "KLSOAP",
    "klsoap",
    "``[soap]``'s keys with KL-Shampoo's factors on (used when ``optimizer.name = \"KLSOAP\"``).",
    _SOAP_WIRE,
    base=SOAP,
)
REKLS = _section_class(
    "REKLS",
    "rekls",
    "``[soap]``'s keys with KL-Shampoo's factors and a full eigendecomposition every refresh (used when "
    '``optimizer.name = "REKLS"``).',
    _SOAP_WIRE,
    base=KLSOAP,
)


@dataclass
class BatchScaling:
    """Scale ``[optimizer] lr`` to this run's global batch by the square-root rule (any ``[optimizer] name``):
    lr · √(B / B_ref), B = global batch × seq_len tokens (:func:`dtensor_muon.batch_scaled_lr`)."""

    SECTION: ClassVar[str] = "batch_scaling"

    reference_batch_size: int = 0
    """The global batch, in sequences, that ``[optimizer] lr`` was tuned at; 0 turns the scaling off."""

    reference_seq_len: int = 0
    """The sequence length of that batch; 0: this run's ``[training] seq_len``."""

    def __post_init__(self) -> None:
        """Reject bad values."""
        for name in ("reference_batch_size", "reference_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"[{self.SECTION}] {name} = {value!r} is not valid; it must be an integer >= 0")
