"""The matrix optimizers torchtitan's ``[optimizer] name`` can select, in one table: :data:`REGISTRY`.

Each :class:`MatrixOptimizerEntry` names the ``[optimizer] name``, the config section (a dataclass of
:mod:`torchtitan_ext.sections`, whose ``SECTION`` is its TOML name), the :mod:`dtensor_muon` class
built per model part, and the function mapping the ``[optimizer]`` section and its own section to
that class's keyword arguments. Everything else is derived from it: :data:`OPTIMIZER_NAMES` and
:func:`check_optimizer_name`, the sections added to torchtitan's JobConfig
(:data:`torchtitan_ext.job_config.JobConfig`), the builders' dispatch and container
(:mod:`torchtitan_ext.optimizer`) and the sections attached to the ``[optimizer]`` object
(:func:`attach_sections`, called by :mod:`torchtitan_ext.spec`).

Every mapping takes lr and weight_decay from ``[optimizer]``, and AdamW's betas and eps (for
embeddings, the output head, norms and biases) from its beta1, beta2 and eps.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import dtensor_muon
from dtensor_muon.optim.options import OPTIONS
from torchtitan_ext import sections

if TYPE_CHECKING:
    from torchtitan.config import Optimizer as OptimizerConfig

TORCHTITAN_OPTIMIZERS = ("Adam", "AdamW")
"""``[optimizer] name`` values left to torchtitan's own builders."""


def optimizer_section_kwargs(
    name: str, optimizer_config: "OptimizerConfig", section: Any, *, on_cpu: bool = False
) -> dict[str, Any]:
    """Keyword arguments of ``dtensor_muon.<name>`` from the ``[optimizer]`` section and the optimizer's own, as
    its options table (:data:`dtensor_muon.optim.options.OPTIONS`) says: each option from the ``[optimizer]``
    keys it names (two keys make a pair: AdamW's and SOAP's betas), or from the section (a dtype by its name).
    Unset dtype options take :func:`torchtitan_ext.sections.device_dtypes` for a job on CPU (``on_cpu``) or on
    GPUs."""
    picked = sections.device_dtypes(section, on_cpu)
    kwargs = {}
    for option in OPTIONS[name]:
        if option.from_optimizer:
            values = tuple(getattr(optimizer_config, key) for key in option.from_optimizer)
            kwargs[option.name] = values if len(values) > 1 else values[0]
        elif option.in_section:
            kwargs[option.name] = option.keyword_value(picked.get(option.name, getattr(section, option.name)))
    return kwargs


def runs_on_cpu(model_parts: list[torch.nn.Module]) -> bool:
    """Whether the job's parameters live on the CPU (the first parameter's device; without parameters, whether no
    GPU is present)."""
    for model in model_parts:
        for p in model.parameters():
            return p.device.type == "cpu"
    return not torch.cuda.is_available()


@dataclass(frozen=True)
class MatrixOptimizerEntry:
    """One matrix optimizer selectable by ``[optimizer] name``."""

    name: str
    """The ``[optimizer] name`` that selects it."""

    section_cls: type
    """Its config section, a dataclass of :mod:`torchtitan_ext.sections`."""

    optimizer_cls: type[torch.optim.Optimizer]
    """The :mod:`dtensor_muon` class constructed once per model part, over its named parameters."""

    def kwargs(self, optimizer_config: "OptimizerConfig", section: Any, *, on_cpu: bool = False) -> dict[str, Any]:
        """Keyword arguments of :attr:`optimizer_cls` from ``[optimizer]`` and this entry's section, for a job on
        CPU (``on_cpu``) or on GPUs (:func:`optimizer_section_kwargs`)."""
        return optimizer_section_kwargs(self.name, optimizer_config, section, on_cpu=on_cpu)

    @property
    def section(self) -> str:
        """The TOML section name (``[muon]``: ``"muon"``), also the JobConfig field and the attribute of the
        ``[optimizer]`` object that holds the section (see :func:`attach_sections`)."""
        return self.section_cls.SECTION


REGISTRY: dict[str, MatrixOptimizerEntry] = {
    entry.name: entry
    for entry in (
        MatrixOptimizerEntry("Muon", sections.Muon, dtensor_muon.Muon),
        MatrixOptimizerEntry("MOP", sections.MOP, dtensor_muon.MOP),
        MatrixOptimizerEntry("NorMuon", sections.NorMuon, dtensor_muon.NorMuon),
        MatrixOptimizerEntry("SOAP", sections.SOAP, dtensor_muon.SOAP),
        MatrixOptimizerEntry("KLSOAP", sections.KLSOAP, dtensor_muon.KLSOAP),
        MatrixOptimizerEntry("REKLS", sections.REKLS, dtensor_muon.REKLS),
    )
}
"""The matrix optimizers by ``[optimizer] name``, in the order the choices and the sections are listed."""

OPTIMIZER_NAMES = (*TORCHTITAN_OPTIMIZERS, *REGISTRY)
"""Every valid ``[optimizer] name``."""


def check_optimizer_name(name: str) -> None:
    """Fail with the valid choices when ``[optimizer] name`` is none of :data:`OPTIMIZER_NAMES` (names are
    case-sensitive, as torchtitan's; a name that differs only in case is suggested)."""
    if name not in OPTIMIZER_NAMES:
        same = [n for n in OPTIMIZER_NAMES if n.lower() == str(name).lower()]
        hint = f" (did you mean {same[0]!r}? names are case-sensitive)" if same else ""
        raise ValueError(f"[optimizer] name = {name!r} is not valid{hint}; choose one of: {', '.join(OPTIMIZER_NAMES)}")


def attach_sections(job_config: Any) -> None:
    """Set each registry section of ``job_config`` (its defaults where the config lacks it) as an attribute of
    ``job_config.optimizer``, where :func:`section_of` finds it."""
    for entry in REGISTRY.values():
        setattr(job_config.optimizer, entry.section, getattr(job_config, entry.section, None) or entry.section_cls())


def section_of(optimizer_config: "OptimizerConfig", entry: MatrixOptimizerEntry) -> Any:
    """``entry``'s section as attached to ``optimizer_config`` by :func:`attach_sections`, else its defaults."""
    return getattr(optimizer_config, entry.section, None) or entry.section_cls()


def optimizer_kwargs(optimizer_config: "OptimizerConfig", *, on_cpu: bool = False) -> dict[str, Any]:
    """Keyword arguments of the matrix optimizer that ``optimizer_config.name`` selects, for a job on CPU
    (``on_cpu``) or on GPUs."""
    entry = REGISTRY[optimizer_config.name]
    return entry.kwargs(optimizer_config, section_of(optimizer_config, entry), on_cpu=on_cpu)
