"""The optimizer of torchtitan 0.3 runs: :class:`MatrixOptimizersContainer`, an ``OptimizersContainer`` whose
nested ``Config`` names one matrix optimizer of :data:`torchtitan_ext.registry.REGISTRY` and holds its options.

torchtitan 0.3 builds whatever ``config.optimizer`` is (``config.optimizer.build(model_parts=…)``) and its
stock container knows only the factories ``Adam``, ``AdamW`` and ``DistMuon``. This subclass builds, per model
part, one instance of the registry's class (:class:`dtensor_muon.Muon`, ``MOP``, ``NorMuon``, ``SOAP``,
``KLSOAP``, ``REKLS``) over the part's named parameters (their canonical names, as torchtitan's checkpoints
key them). Routing is the library's, by name and shape: matrices (2-D, MoE experts ``[E, m, n]`` as E
matrices) take the matrix update; embeddings, ``lm_head``, norms and biases take AdamW (torch's AdamW math,
the same lr: the matrices' lr is scaled to AdamW's update RMS by default). ``param_groups`` is not used.
A fused ``attention.qkv_linear.wqkv.weight`` (llama3's and qwen3's, rows interleaved by KV group) is cut into
its W_q, W_k and W_v by default, each updated as a separate parameter would be
(:meth:`dtensor_muon.MatrixSplit.grouped_qkv`; ``fused_qkv = "head"``: one matrix per head, ``"whole"``: one
matrix).

Stepping, hooks (the MoE load-balancing pre-hook that the model spec's ``post_optimizer_build_fn`` registers)
and checkpointing are the base class's: ``state_dict()`` is torchtitan's flat, name-keyed optimizer state
(the library creates its state eagerly, so torchtitan's zero-step initialisation never runs), and
``load_state_dict`` loads it back through each optimizer's own checks. :attr:`~MatrixOptimizersContainer.metrics`
combines the optimizers' diagnostics for :mod:`torchtitan_ext.titan03.metrics`.

On the command line (tyro): ``--optimizer.name SOAP --optimizer.lr 0.01 --optimizer.soap.precondition-frequency
10``; every option of every registry entry is listed by ``--help`` under ``--optimizer.<section>.``. Muon's and
NorMuon's ``ns_dtype`` and ``wire_dtype`` left unset are float32 in a job on CPU (bfloat16 on GPUs), which the
container logs (:func:`torchtitan_ext.sections.device_dtypes`); a value set on the command line, in an override
or in a config is kept.
"""

from __future__ import annotations

import difflib
import functools
import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import OptimizersContainer

from dtensor_muon import LR_PER_ADAMW_LR, MatrixSplit, lr_from_adamw
from dtensor_muon.optim.lr_scaling import ADAMW_UPDATE_RMS
from torchtitan_ext import sections
from torchtitan_ext.metrics import combine
from torchtitan_ext.qk_clip import build_with_qk_clip
from torchtitan_ext.registry import REGISTRY, MatrixOptimizerEntry, runs_on_cpu

logger = logging.getLogger("torchtitan_ext")

OptimizerName = Literal["Muon", "MOP", "NorMuon", "SOAP", "KLSOAP", "REKLS"]
"""The names of :data:`~torchtitan_ext.registry.REGISTRY` (checked against it at import)."""

if set(OptimizerName.__args__) != set(REGISTRY):
    raise ImportError(f"OptimizerName {OptimizerName.__args__} differs from the registry's names {tuple(REGISTRY)}")

SHARED_OPTIONS = ("lr", "weight_decay", "beta1", "beta2", "eps")
"""Hyperparameters every entry takes from the container's config (AdamW's too); the rest is per section."""

CONTAINER_OPTIONS = ("fused_qkv",)
"""Options of the container itself (how parameters are cut into matrices), the same for every entry."""

FUSED_QKV_CHOICES = ("projection", "head", "whole")


def fused_qkv_splits(model: nn.Module, per: str) -> dict[str, MatrixSplit]:
    """``{parameter name: MatrixSplit}`` for every fused, KV-group-interleaved ``wqkv`` weight of ``model``
    (torchtitan 0.3's ``FusedQKVLinear`` under an attention module with ``n_heads``, ``n_kv_heads`` and
    ``head_dim``), split ``per`` ``"projection"`` or ``"head"``; empty for ``"whole"``."""
    from torchtitan.models.common.attention import FusedQKVLinear

    if per == "whole":
        return {}
    splits = {}
    for name, module in model.named_modules():
        if isinstance(getattr(module, "qkv_linear", None), FusedQKVLinear):
            weight = canonical_fqn(f"{name}.qkv_linear.wqkv.weight" if name else "qkv_linear.wqkv.weight")
            splits[weight] = MatrixSplit.grouped_qkv(module.n_heads, module.n_kv_heads, module.head_dim, per=per)
    return splits


def _check_shared(config: Any) -> None:
    for name in ("lr", "weight_decay", "eps"):
        value = getattr(config, name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < 0
            or (name == "eps" and value == 0)
        ):
            bound = "> 0" if name == "eps" else ">= 0"
            raise ValueError(f"optimizer.{name} = {value!r} is not valid; it must be a number {bound}")
    for name in ("beta1", "beta2"):
        sections.check_unit_interval("optimizer", name, getattr(config, name))


class MatrixOptimizersContainer(OptimizersContainer):
    """torchtitan 0.3's optimizers container holding one matrix optimizer of the registry per model part
    (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """Which matrix optimizer, its shared hyperparameters and every entry's option section (only the
        section of ``name`` is used)."""

        name: OptimizerName = "Muon"
        """The matrix optimizer (a name of :data:`torchtitan_ext.registry.REGISTRY`)."""

        lr: float = 8e-4
        """Learning rate of every parameter (the matrices' scaled by the section's ``adjust_lr_fn``)."""

        weight_decay: float = 0.1
        """Decoupled weight decay of every parameter."""

        beta1: float = 0.9
        """AdamW's β₁ (embeddings, head, norms, biases; SOAP's first moment too)."""

        beta2: float = 0.95
        """AdamW's β₂ (SOAP's second moment too)."""

        eps: float = 1e-8
        """AdamW's ε (SOAP's too)."""

        muon: sections.Muon = field(default_factory=sections.Muon)
        """Options of ``name = "Muon"``."""

        mop: sections.MOP = field(default_factory=sections.MOP)
        """Options of ``name = "MOP"``."""

        normuon: sections.NorMuon = field(default_factory=sections.NorMuon)
        """Options of ``name = "NorMuon"``."""

        soap: sections.SOAP = field(default_factory=sections.SOAP)
        """Options of ``name = "SOAP"``."""

        klsoap: sections.KLSOAP = field(default_factory=sections.KLSOAP)
        """Options of ``name = "KLSOAP"``."""

        rekls: sections.REKLS = field(default_factory=sections.REKLS)
        """Options of ``name = "REKLS"``."""

        fused_qkv: Literal["projection", "head", "whole"] = "projection"
        """A fused, KV-group-interleaved ``wqkv`` weight as its W_q, W_k, W_v ("projection", exactly as separate
        parameters), one matrix per head ("head"), or one matrix ("whole")."""

        def __post_init__(self) -> None:
            """Reject bad shared values and any ``param_groups`` (routing is by name, see the module docstring)."""
            if self.name not in REGISTRY:
                raise ValueError(f"optimizer.name = {self.name!r} is not valid; choose one of: {', '.join(REGISTRY)}")
            _check_shared(self)
            sections.check_choice("optimizer", "fused_qkv", self.fused_qkv, FUSED_QKV_CHOICES)
            if self.param_groups:
                raise ValueError(
                    f"optimizer.param_groups is not used by {self.name}: matrices take {self.name}, embeddings, "
                    "lm_head, norms and biases AdamW, routed by name; leave param_groups empty"
                )

        @property
        def entry(self) -> MatrixOptimizerEntry:
            """The registry entry of :attr:`name`."""
            return REGISTRY[self.name]

        @property
        def section(self) -> Any:
            """The option section of :attr:`name` (e.g. :attr:`muon` for ``"Muon"``)."""
            return getattr(self, self.entry.section)

        def optimizer_kwargs(self, *, on_cpu: bool = False) -> dict[str, Any]:
            """Keyword arguments of the entry's optimizer class (the registry's mapping of this config) for a job
            on CPU (``on_cpu``: unset dtype options are float32) or on GPUs."""
            return self.entry.kwargs(self, self.section, on_cpu=on_cpu)

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        on_cpu = runs_on_cpu(model_parts)
        entry, kwargs = config.entry, config.optimizer_kwargs(on_cpu=on_cpu)
        note = sections.device_dtypes_note(config.section, on_cpu, f"[optimizer.{entry.section}]")
        if note is not None:
            logger.info(note)
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        for part, model in enumerate(model_parts):
            named = [(canonical_fqn(name), p) for name, p in model.named_parameters() if p.requires_grad]
            splits = fused_qkv_splits(model, config.fused_qkv)
            build = functools.partial(entry.optimizer_cls, named, matrix_splits=splits)
            optimizer = build_with_qk_clip(build, model, kwargs, canonical_fqn)
            if kwargs.get("overlap"):
                optimizer.attach(model)
            self.optimizers.append(optimizer)
            all_params.extend(p for _, p in named)
            logger.info(f"Optimizer {entry.name} (model_part={part}): {len(named)} parameters, lr {config.lr}")
        self._validate_params(all_params)
        self._post_init(all_params)

    @property
    def metrics(self) -> dict[str, float]:
        """The latest ``opt.metrics`` of every part's optimizer, combined over the parts of this rank (times,
        bytes and FLOPs add up; see :data:`torchtitan_ext.metrics.REDUCTIONS`)."""
        return combine((opt.metrics for opt in self.optimizers), over="parts")


def option_keys(name: str) -> tuple[str, ...]:
    """The keys an override of ``name`` accepts: the shared hyperparameters, the container's options, then its
    section's options (a key in both, NorMuon's ``beta2``, is the section's)."""
    return tuple(
        dict.fromkeys((*SHARED_OPTIONS, *CONTAINER_OPTIONS, *(f.name for f in fields(REGISTRY[name].section_cls))))
    )


def check_option_keys(name: str, options: dict[str, Any]) -> None:
    """Raise ``ValueError`` at the first key of ``options`` that ``name`` does not take, naming the closest valid
    key and all of them."""
    valid = option_keys(name)
    for key in options:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{name} has no option {key!r}{hint}; its options: {', '.join(valid)}")


def shared_defaults(stock: OptimizersContainer.Config) -> dict[str, Any]:
    """lr, weight_decay, beta1, beta2 and eps of a stock optimizer config: those of its first Adam or AdamW
    param group (a config's catch-all ``default_adamw``), where it has one; the container's defaults otherwise.
    A :class:`MatrixOptimizersContainer.Config` gives its own."""
    if isinstance(stock, MatrixOptimizersContainer.Config):
        return {key: getattr(stock, key) for key in SHARED_OPTIONS}
    for group in stock.param_groups:
        if group.optimizer_name in ("Adam", "AdamW"):
            kwargs = group.optimizer_kwargs
            out = {key: kwargs[key] for key in ("lr", "weight_decay", "eps") if key in kwargs}
            if "betas" in kwargs:
                out["beta1"], out["beta2"] = (float(b) for b in kwargs["betas"])
            return out
    return {}


def _matches_adamw_update_rms(name: str, section: Any) -> bool:
    """Whether ``name``'s section scales every update to an AdamW update's RMS, the setting its
    :data:`dtensor_muon.LR_PER_ADAMW_LR` ratio was measured with (Muon, NorMuon, SOAP and KL-SOAP only)."""
    if name in ("Muon", "NorMuon"):
        return section.adjust_lr_fn == "match_rms_adamw"
    if name in ("SOAP", "KLSOAP"):
        return section.match_update_rms == ADAMW_UPDATE_RMS
    return False


def matrix_optimizer_config(
    stock: OptimizersContainer.Config, name: str, options: dict[str, Any] | None = None
) -> MatrixOptimizersContainer.Config:
    """The container config for ``name`` that replaces ``stock``: the stock config's hyperparameters
    (:func:`shared_defaults`) and implementation, then ``options`` (shared keys and ``name``'s section keys,
    checked: an unknown key or a bad value raises ``ValueError`` with the valid choices). A key of both, NorMuon's
    ``beta2``, sets the section's (AdamW's β₂ is ``--optimizer.beta2`` on the command line).

    From a stock AdamW config with no ``lr`` in ``options`` the measured rule of docs/lr_study.md applies, logged:
    SOAP and KL-SOAP match an AdamW update's RMS (``match_update_rms = 0.2``) unless ``options`` set it, and
    Muon or NorMuon with ``adjust_lr_fn = "match_rms_adamw"``, or SOAP or KL-SOAP matching 0.2, take
    :func:`dtensor_muon.lr_from_adamw` of the stock lr (10×; KL-SOAP 10/3×). An ``lr`` in ``options`` is kept
    as given, and the section as ``options`` set it."""
    if name not in REGISTRY:
        raise ValueError(f"{name!r} is not a matrix optimizer; choose one of: {', '.join(REGISTRY)}")
    options = dict(options or {})
    check_option_keys(name, options)
    entry = REGISTRY[name]
    section_fields = {f.name for f in fields(entry.section_cls)}
    shared_keys = [k for k in SHARED_OPTIONS if k in options and k not in section_fields]
    shared = {**shared_defaults(stock), **{k: options.pop(k) for k in shared_keys}}
    if isinstance(stock, MatrixOptimizersContainer.Config):
        shared["fused_qkv"] = stock.fused_qkv
    shared.update({k: options.pop(k) for k in CONTAINER_OPTIONS if k in options})
    base_section = getattr(stock, entry.section, None) if isinstance(stock, MatrixOptimizersContainer.Config) else None
    values = {f: getattr(base_section, f) for f in section_fields} if base_section is not None else {}
    section = entry.section_cls(**{**values, **options})
    from_adamw = not isinstance(stock, MatrixOptimizersContainer.Config) and "lr" in shared and "lr" not in shared_keys
    if from_adamw and name in ("SOAP", "KLSOAP") and "match_update_rms" not in options:
        section = replace(section, match_update_rms=ADAMW_UPDATE_RMS)
        logger.info(
            f"{name}: match_update_rms {ADAMW_UPDATE_RMS:g} (an AdamW update's RMS, from the stock AdamW config)"
        )
    if from_adamw and _matches_adamw_update_rms(name, section):
        lr = lr_from_adamw(name, shared["lr"])
        logger.info(
            f"{name}: lr {lr:g} = {LR_PER_ADAMW_LR[name]:g} × the stock AdamW lr {shared['lr']:g} "
            f"(dtensor_muon.lr_from_adamw; set lr to choose another)"
        )
        shared["lr"] = lr
    return MatrixOptimizersContainer.Config(
        name=name,
        implementation=stock.implementation,
        optimizer_factory_kwargs_by_name=dict(stock.optimizer_factory_kwargs_by_name),
        **shared,
        **{entry.section: section},
    )
