"""The ``[muon]`` section of torchtitan's JobConfig (``[job] custom_config_module = "torchtitan_ext.job_config"``).

Every field maps to one argument of :class:`dtensor_muon.Muon`; learning rate, AdamW betas, eps and
weight decay come from torchtitan's own ``[optimizer]`` section. Values are checked when the config
is built (TOML or command line), so a bad value stops the job before any process group exists, with
a message that lists the valid choices.
"""

from dataclasses import dataclass, field
from typing import Literal

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
