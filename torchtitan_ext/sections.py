"""The config sections of the matrix optimizers: ``[muon]``, ``[mop]``, ``[normuon]``, ``[soap]``, ``[klsoap]``
and ``[rekls]``, built from the options table (:data:`dtensor_muon.optim.options.OPTIONS`), and ``[batch_scaling]``.

Each section is a dataclass holding one optimizer's options beyond the shared ``[optimizer]`` ones (lr, betas,
eps, weight decay): every option of its table that the table puts in the section, with the table's section
default, type (a ``Literal`` of the allowed names where it has choices) and line of help. :mod:`torchtitan_ext.
registry` pairs it with its ``[optimizer] name`` and its optimizer class. ``SECTION`` is its TOML section name.
Values are checked in ``__post_init__``, i.e. when torchtitan builds the config (from TOML or the command line),
against the table's choices and bounds and the section's cross-option rules: a bad value raises ``ValueError``
naming ``[section] key = value`` and the valid choices, before any process group exists.

Muon's and NorMuon's ``ns_dtype`` and ``wire_dtype`` default to the table's ``"bfloat16"`` held as a
:class:`DeviceDefault`, which tells "not set" from a ``"bfloat16"`` the user wrote: when the optimizer is built,
:func:`device_dtypes` gives an unset one float32 in a job on CPU (CPUs without AVX-512 BF16 run bfloat16 matrix
products many times slower), and an unset wire never rounds a Newton–Schulz input wider than bfloat16; the
plug-ins log what was picked (:func:`device_dtypes_note`). A value set in TOML, on the command line or in an
override is kept.

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


class DeviceDefault(str):
    """The section default of a dtype option that depends on where the job runs: equal to the table's dtype name
    (``"bfloat16"``), but a value the user did not set (a TOML, command-line or override value is a plain
    ``str``), so :func:`device_dtypes` may pick another."""


DEVICE_DTYPE_OPTIONS = ("ns_dtype", "wire_dtype")
"""Options whose section default is a :class:`DeviceDefault` where bfloat16 is one of their choices (Muon's and
NorMuon's; MOP's and SOAP's wires are float32 only)."""


def _has_device_default(option: Option) -> bool:
    return option.name in DEVICE_DTYPE_OPTIONS and "bfloat16" in option.choices


def is_set(value: object) -> bool:
    """Whether a section value was given by the user (not a :class:`DeviceDefault`)."""
    return not isinstance(value, DeviceDefault)


def device_dtypes(section: Any, on_cpu: bool) -> dict[str, str]:
    """The dtype names the unset :data:`DEVICE_DTYPE_OPTIONS` of ``section`` take, by option name (empty when
    all are set or the section has none):

    - ``ns_dtype``: ``"float32"`` in a job on CPU (``on_cpu``), unless ``wire_dtype`` is set to ``"bfloat16"``
      (the Newton–Schulz input is then bfloat16); the table's ``"bfloat16"`` otherwise;
    - ``wire_dtype``: ``"bfloat16"`` on GPUs with a bfloat16 Newton–Schulz; ``"float32"`` in a job on CPU or
      with a wider Newton–Schulz dtype (a bfloat16 wire would round its input).
    """
    ns, wire = getattr(section, "ns_dtype", None), getattr(section, "wire_dtype", None)
    picked = {}
    if isinstance(ns, DeviceDefault):
        ns = picked["ns_dtype"] = "float32" if on_cpu and not (is_set(wire) and wire == "bfloat16") else str(ns)
    if isinstance(wire, DeviceDefault):
        picked["wire_dtype"] = "bfloat16" if not on_cpu and ns == "bfloat16" else "float32"
    return picked


def device_dtypes_note(section: Any, on_cpu: bool, where: str) -> str | None:
    """A log line naming the unset dtype options of ``section`` that :func:`device_dtypes` moved off the table's
    default, and why; None when it moved none. ``where`` names the section as the user sets it (``"[muon]"``
    in torchtitan 0.2's TOML, ``"[optimizer.muon]"`` in torchtitan 0.3's config)."""
    moved = {k: v for k, v in device_dtypes(section, on_cpu).items() if v != getattr(section, k)}
    if not moved:
        return None
    settings = ", ".join(f"{k} = {v!r}" for k, v in moved.items())
    why = (
        "this job runs on CPU, where bfloat16 matrix products run many times slower (CPUs without AVX-512 BF16)"
        if on_cpu
        else f"a bfloat16 wire would round the {section.ns_dtype} Newton–Schulz input"
    )
    return f"{where} {settings}: not set, and {why}; setting {' and '.join(moved)} keeps your choice"


def _field_type(option: Option) -> Any:
    kind = Literal[option.choices] if option.choices else type(option.section_default)
    doc = option.doc
    if _has_device_default(option):
        doc += " (not set: float32 in a job on CPU)"
    return Annotated[kind, tyro.conf.arg(help=doc)]


def _field_default(option: Option) -> Any:
    default = option.section_default
    return DeviceDefault(default) if _has_device_default(option) else default


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

    fields = [(o.name, _field_type(o), dataclasses.field(default=_field_default(o))) for o in options]
    namespace = {"SECTION": section, "__post_init__": __post_init__, "__doc__": doc, "__module__": __name__}
    cls = dataclasses.make_dataclass(optimizer, fields, bases=(base,) if base else (), namespace=namespace)
    cls.__annotations__["SECTION"] = ClassVar[str]
    return cls


def _wire_within_ns_dtype(config: Any) -> None:
    if is_set(config.wire_dtype) and config.wire_dtype == "bfloat16" and config.ns_dtype != "bfloat16":
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
