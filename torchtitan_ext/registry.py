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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import dtensor_muon
from torchtitan_ext import sections

if TYPE_CHECKING:
    from torchtitan.config import Optimizer as OptimizerConfig

TORCHTITAN_OPTIMIZERS = ("Adam", "AdamW")
"""``[optimizer] name`` values left to torchtitan's own builders."""


def _shared_kwargs(optimizer_config: "OptimizerConfig") -> dict[str, Any]:
    return {
        "lr": optimizer_config.lr,
        "weight_decay": optimizer_config.weight_decay,
        "adamw_betas": (optimizer_config.beta1, optimizer_config.beta2),
        "adamw_eps": optimizer_config.eps,
    }


def _engine_kwargs(section: sections.Muon | sections.MOP | sections.SOAP) -> dict[str, Any]:
    return {
        "wire_dtype": getattr(torch, section.wire_dtype),
        "bucket_size_mb": section.bucket_size_mb,
        "exchange": section.exchange,
        "skip_nonfinite": section.skip_nonfinite,
        "diagnostics_interval": section.diagnostics_interval,
        "overlap": section.overlap,
        "tp_mode": section.tp_mode,
    }


def muon_kwargs(optimizer_config: "OptimizerConfig", muon_config: sections.Muon) -> dict[str, Any]:
    """Keyword arguments of :class:`dtensor_muon.Muon` from the ``[optimizer]`` and ``[muon]`` sections."""
    return {
        **_shared_kwargs(optimizer_config),
        "momentum": muon_config.momentum,
        "nesterov": muon_config.nesterov,
        "ns_coefficients": muon_config.ns_coefficients,
        "ns_steps": muon_config.ns_steps,
        "adjust_lr_fn": muon_config.adjust_lr_fn,
        "ns_dtype": getattr(torch, muon_config.ns_dtype),
        "ns_algorithm": muon_config.ns_algorithm,
        **_engine_kwargs(muon_config),
    }


def normuon_kwargs(optimizer_config: "OptimizerConfig", normuon_config: sections.NorMuon) -> dict[str, Any]:
    """Keyword arguments of :class:`dtensor_muon.NorMuon` from ``[optimizer]`` and ``[normuon]``: Muon's, plus
    beta2 and normuon_eps."""
    return {
        **muon_kwargs(optimizer_config, normuon_config),
        "beta2": normuon_config.beta2,
        "normuon_eps": normuon_config.normuon_eps,
    }


def mop_kwargs(optimizer_config: "OptimizerConfig", mop_config: sections.MOP) -> dict[str, Any]:
    """Keyword arguments of :class:`dtensor_muon.MOP` from the ``[optimizer]`` and ``[mop]`` sections."""
    return {
        **_shared_kwargs(optimizer_config),
        "momentum": mop_config.momentum,
        "nesterov": mop_config.nesterov,
        "scale": mop_config.scale,
        "adjust_lr_fn": mop_config.adjust_lr_fn,
        **_engine_kwargs(mop_config),
    }


@dataclass(frozen=True)
class MatrixOptimizerEntry:
    """One matrix optimizer selectable by ``[optimizer] name``."""

    name: str
    """The ``[optimizer] name`` that selects it."""

    section_cls: type
    """Its config section, a dataclass of :mod:`torchtitan_ext.sections`."""

    optimizer_cls: type[torch.optim.Optimizer]
    """The :mod:`dtensor_muon` class constructed once per model part, over its named parameters."""

    kwargs: Callable[["OptimizerConfig", Any], dict[str, Any]]
    """``(optimizer_config, section) -> keyword arguments`` of :attr:`optimizer_cls`."""

    @property
    def section(self) -> str:
        """The TOML section name (``[muon]``: ``"muon"``), also the JobConfig field and the attribute of the
        ``[optimizer]`` object that holds the section (see :func:`attach_sections`)."""
        return self.section_cls.SECTION


def soap_kwargs(optimizer_config: "OptimizerConfig", soap_config: sections.SOAP) -> dict[str, Any]:
    """Keyword arguments of :class:`dtensor_muon.SOAP` (and KLSOAP, REKLS) from ``[optimizer]`` (lr,
    weight_decay, and Adam's beta1, beta2, eps, for the eigenbasis Adam and AdamW alike) and the section."""
    return {
        **_shared_kwargs(optimizer_config),
        "betas": (optimizer_config.beta1, optimizer_config.beta2),
        "eps": optimizer_config.eps,
        "shampoo_beta": soap_config.shampoo_beta,
        "precondition_frequency": soap_config.precondition_frequency,
        "basis": soap_config.basis,
        "kl": soap_config.kl,
        "max_preconditioner_dim": soap_config.max_preconditioner_dim,
        "correct_bias": soap_config.correct_bias,
        "correct_shampoo_beta_bias": soap_config.correct_shampoo_beta_bias,
        "max_update_rms": soap_config.max_update_rms,
        "skip_first_update": soap_config.skip_first_update,
        "match_update_rms": soap_config.match_update_rms,
        **_engine_kwargs(soap_config),
    }


REGISTRY: dict[str, MatrixOptimizerEntry] = {
    entry.name: entry
    for entry in (
        MatrixOptimizerEntry("Muon", sections.Muon, dtensor_muon.Muon, muon_kwargs),
        MatrixOptimizerEntry("MOP", sections.MOP, dtensor_muon.MOP, mop_kwargs),
        MatrixOptimizerEntry("NorMuon", sections.NorMuon, dtensor_muon.NorMuon, normuon_kwargs),
        MatrixOptimizerEntry("SOAP", sections.SOAP, dtensor_muon.SOAP, soap_kwargs),
        MatrixOptimizerEntry("KLSOAP", sections.KLSOAP, dtensor_muon.KLSOAP, soap_kwargs),
        MatrixOptimizerEntry("REKLS", sections.REKLS, dtensor_muon.REKLS, soap_kwargs),
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


def optimizer_kwargs(optimizer_config: "OptimizerConfig") -> dict[str, Any]:
    """Keyword arguments of the matrix optimizer that ``optimizer_config.name`` selects."""
    entry = REGISTRY[optimizer_config.name]
    return entry.kwargs(optimizer_config, section_of(optimizer_config, entry))
