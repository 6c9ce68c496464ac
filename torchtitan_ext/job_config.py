"""The ``[muon]`` section of torchtitan's JobConfig (``[job] custom_config_module = "torchtitan_ext.job_config"``).

Every field maps to one argument of :class:`dtensor_muon.Muon`; learning rate, AdamW betas, eps and
weight decay come from torchtitan's own ``[optimizer]`` section. Values are checked when the config
is built (TOML or command line), so a bad value stops the job before any process group exists, with
a message that lists the valid choices.

:func:`use_in_config_manager` (called by the launcher, ``python -m torchtitan_ext.train``) makes the
section present without ``custom_config_module`` and turns torchtitan's error for an unknown TOML
key (which points to a ``./run_train.sh`` this project lacks) into one that names the section, the
closest valid key and the keys there are; ``python -m torchtitan_ext.train --help`` lists every option.
"""

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from dtensor_muon.kernels import NS_ALGORITHMS
from dtensor_muon.newton_schulz import NAMED_COEFFICIENTS, SUPPORTED_NS_DTYPES

OPTIMIZER_NAMES = ("Adam", "AdamW", "Muon")
ADJUST_LR_CHOICES = ("match_rms_adamw", "original")
EXCHANGE_CHOICES = ("owner", "gather_all")
WIRE_DTYPES = ("bfloat16", "float32")


def _check_choice(name: str, value: object, choices: tuple[str, ...] | list[str]) -> None:
    if value not in choices:
        raise ValueError(f"[muon] {name} = {value!r} is not valid; choose one of: {', '.join(choices)}")


def _check_positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"[muon] {name} = {value!r} is not valid; it must be {bound}")


@dataclass
class Muon:
    """Muon's hyperparameters beyond the shared ``[optimizer]`` ones (used when ``optimizer.name = "Muon"``)."""

    momentum: float = 0.95
    """Momentum μ of the matrix parameters' buffer, in [0, 1)."""

    nesterov: bool = True
    """Nesterov momentum (orthogonalize g.lerp(buf, μ) instead of buf)."""

    ns_steps: int = 5
    """Newton–Schulz iterations per step."""

    ns_coefficients: Literal["simple", "quintic", "polar_express", "cans"] = "simple"
    """Newton–Schulz coefficient schedule by name ("simple" = Keller's fixed (3.4445, -4.775, 2.0315))."""

    ns_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """Working dtype of the Newton–Schulz iteration."""

    ns_algorithm: Literal["auto", "standard", "gram"] = "auto"
    """Newton–Schulz form: "gram" iterates on X·Xᵀ (fewer FLOPs on rectangular matrices), "auto" uses it where
    it is faster on the GPU backend, with the "simple" (Keller) coefficients."""

    adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Per-matrix learning-rate scaling: "match_rms_adamw" (0.2·√max(A, B): the same [optimizer] lr
    suits both Muon and AdamW parameters) or "original" (√max(1, A/B))."""

    wire_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of matrices on the wire between shard holders and owners."""

    bucket_size_mb: float = 64.0
    """Size of one exchange bucket in MiB."""

    exchange: Literal["owner", "gather_all"] = "owner"
    """"owner": each matrix orthogonalized once, on its owner rank; "gather_all": every rank gathers
    every matrix (a baseline for tests and benchmarks)."""

    skip_nonfinite: bool = False
    """Skip the whole step (all ranks) when a gradient holds inf/NaN."""

    diagnostics_interval: int = 0
    """Every N steps also compute the costly diagnostics (orthogonality error); 0 turns them off."""

    overlap: bool = False
    """Let ``step()`` return with the updates' return exchanges in flight; each module's update is applied
    by a forward pre-hook just before FSDP all-gathers it (hooks attached to every model part)."""

    def __post_init__(self) -> None:
        """Reject bad values with the list of valid ones."""
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"[muon] momentum = {self.momentum!r} is not valid; it must lie in [0, 1)")
        if not isinstance(self.ns_steps, int) or self.ns_steps < 1:
            raise ValueError(f"[muon] ns_steps = {self.ns_steps!r} is not valid; it must be an integer >= 1")
        _check_choice("ns_coefficients", self.ns_coefficients, sorted(NAMED_COEFFICIENTS))
        _check_choice("ns_dtype", self.ns_dtype, sorted(SUPPORTED_NS_DTYPES))
        _check_choice("ns_algorithm", self.ns_algorithm, NS_ALGORITHMS)
        _check_choice("adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR_CHOICES)
        _check_choice("wire_dtype", self.wire_dtype, WIRE_DTYPES)
        _check_choice("exchange", self.exchange, EXCHANGE_CHOICES)
        if self.wire_dtype == "bfloat16" and self.ns_dtype != "bfloat16":
            raise ValueError(
                f"[muon] wire_dtype = 'bfloat16' would round the {self.ns_dtype} Newton–Schulz input; "
                "choose wire_dtype = 'float32' or ns_dtype = 'bfloat16'"
            )
        _check_positive("bucket_size_mb", self.bucket_size_mb)
        _check_positive("diagnostics_interval", self.diagnostics_interval, allow_zero=True)


def check_optimizer_name(name: str) -> None:
    """Fail with the valid choices when ``[optimizer] name`` is none of Adam, AdamW, Muon."""
    if name not in OPTIMIZER_NAMES:
        raise ValueError(f"[optimizer] name = {name!r} is not valid; choose one of: {', '.join(OPTIMIZER_NAMES)}")


@dataclass
class JobConfig:
    """Extension merged into torchtitan's JobConfig: adds the ``[muon]`` section."""

    muon: Muon = field(default_factory=Muon)


HELP_COMMAND = "python -m torchtitan_ext.train --help"
"""Prints every option of the job, the ``[muon]`` section last (``--job.config_file X`` shows X's values as defaults)."""


def check_toml_keys(config_cls: type, values: dict[str, Any], path: tuple[str, ...] = ()) -> None:
    """Raise ``ValueError`` at the first TOML section or key that ``config_cls`` lacks, naming its section,
    the closest valid name and the valid names."""
    if not (is_dataclass(config_cls) and isinstance(values, dict)):
        return
    known = {f.name: f for f in fields(config_cls)}
    for key in values:
        if key in known:
            continue
        close = difflib.get_close_matches(key, list(known), n=1)
        if path:
            where, what = f"[{'.'.join(path)}] has no key {key!r}", f"its keys: {', '.join(known)}"
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        else:
            where, what = f"there is no section [{key}]", f"sections: {', '.join(known)}"
            hint = f" (did you mean [{close[0]}]?)" if close else ""
        raise ValueError(f"{where}{hint}; {what}. `{HELP_COMMAND}` lists every option.")
    for key, value in values.items():
        check_toml_keys(known[key].type, value, (*path, key))


def use_in_config_manager() -> None:
    """Make torchtitan's ``ConfigManager`` (in this process) add the ``[muon]`` section when no
    ``custom_config_module`` is named, and report unknown TOML keys with :func:`check_toml_keys`. Idempotent."""
    from torchtitan.config.manager import ConfigManager

    if getattr(ConfigManager, "_torchtitan_ext", False):
        return
    add_custom_config, dict_to_dataclass = ConfigManager._maybe_add_custom_config, ConfigManager._dict_to_dataclass

    def _maybe_add_custom_config(self, args, toml_values):
        config_cls = add_custom_config(self, args, toml_values)
        return self._merge_configs(config_cls, JobConfig) if config_cls is self.config_cls else config_cls

    def _dict_to_dataclass(self, cls, data):
        check_toml_keys(cls, data)
        return dict_to_dataclass(self, cls, data)

    ConfigManager._maybe_add_custom_config = _maybe_add_custom_config
    ConfigManager._dict_to_dataclass = _dict_to_dataclass
    ConfigManager._torchtitan_ext = True
