"""The config sections of the matrix optimizers: ``[muon]``, ``[mop]``, ``[normuon]``, ``[soap]``, ``[klsoap]``
and ``[rekls]``.

Each dataclass holds one optimizer's hyperparameters beyond the shared ``[optimizer]`` ones (lr,
betas, eps, weight decay); :mod:`torchtitan_ext.registry` pairs it with its ``[optimizer] name``,
its optimizer class and the mapping to the constructor's keywords. ``SECTION`` is its TOML section
name. Values are checked in ``__post_init__``, i.e. when torchtitan builds the config (from TOML or
the command line): a bad value raises ``ValueError`` naming ``[section] key = value`` and the valid
choices, before any process group exists.

No ``from __future__ import annotations`` here: torchtitan's config manager and tyro read the
fields' types as classes.
"""

from dataclasses import dataclass
from typing import ClassVar, Literal

from dtensor_muon.kernels import NS_ALGORITHMS
from dtensor_muon.linalg.newton_schulz import NAMED_COEFFICIENTS, SUPPORTED_NS_DTYPES
from dtensor_muon.optim.base import TP_MODES
from dtensor_muon.rules.mop import MOP_SCALES
from dtensor_muon.rules.soap import SOAP_BASES

ADJUST_LR_CHOICES = ("match_rms_adamw", "original", "spectral_unclamped")
EXCHANGE_CHOICES = ("owner", "gather_all")
WIRE_DTYPES = ("bfloat16", "float32")
MOP_WIRE_DTYPES = ("float32",)


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


def check_engine(section: str, config: object) -> None:
    """Check the exchange settings every matrix optimizer shares (wire_dtype is checked by each section)."""
    check_choice(section, "exchange", config.exchange, EXCHANGE_CHOICES)
    check_choice(section, "tp_mode", config.tp_mode, TP_MODES)
    check_positive(section, "bucket_size_mb", config.bucket_size_mb)
    check_positive(section, "diagnostics_interval", config.diagnostics_interval, allow_zero=True)


@dataclass
class Muon:
    """Muon's hyperparameters beyond the shared ``[optimizer]`` ones (used when ``optimizer.name = "Muon"``)."""

    SECTION: ClassVar[str] = "muon"

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

    adjust_lr_fn: Literal["match_rms_adamw", "original", "spectral_unclamped"] = "match_rms_adamw"
    """Per-matrix learning-rate scaling of an A×B matrix: "match_rms_adamw" (γ·0.2·√max(A, B): the same
    [optimizer] lr suits both Muon and AdamW parameters), "original" (γ·√max(1, A/B)) or "spectral_unclamped"
    (γ·√(A/B), below γ for wide matrices; torch.optim.Muon's and torchtitan DistMuon's name)."""

    wire_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Dtype of matrices on the wire between shard holders and owners."""

    bucket_size_mb: float = 64.0
    """Size of one exchange bucket in MiB."""

    tp_mode: Literal["owned", "duplicated", "distributed", "auto", "blockwise"] = "owned"
    """How tensor-parallel matrices are computed: "owned" (each whole on one owner; exact), "duplicated" (on every
    rank of one TP group; exact), "distributed" (Newton–Schulz across the TP group; Muon family only), "auto"
    (distributed where the cost model says so, else owned), "blockwise" (each TP block on its own: approximate)."""

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
        section = self.SECTION
        check_unit_interval(section, "momentum", self.momentum)
        if not isinstance(self.ns_steps, int) or self.ns_steps < 1:
            raise ValueError(f"[{section}] ns_steps = {self.ns_steps!r} is not valid; it must be an integer >= 1")
        check_choice(section, "ns_coefficients", self.ns_coefficients, sorted(NAMED_COEFFICIENTS))
        check_choice(section, "ns_dtype", self.ns_dtype, sorted(SUPPORTED_NS_DTYPES))
        check_choice(section, "ns_algorithm", self.ns_algorithm, NS_ALGORITHMS)
        check_choice(section, "adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR_CHOICES)
        check_choice(section, "wire_dtype", self.wire_dtype, WIRE_DTYPES)
        check_engine(section, self)
        if self.wire_dtype == "bfloat16" and self.ns_dtype != "bfloat16":
            raise ValueError(
                f"[{section}] wire_dtype = 'bfloat16' would round the {self.ns_dtype} Newton–Schulz input; "
                "choose wire_dtype = 'float32' or ns_dtype = 'bfloat16'"
            )


@dataclass
class NorMuon(Muon):
    """NorMuon's hyperparameters (used when ``optimizer.name = "NorMuon"``): those of ``[muon]``, same
    defaults, plus the per-row second moment of the orthogonalized update."""

    SECTION: ClassVar[str] = "normuon"

    beta2: float = 0.95
    """Decay β₂ of the per-row second moment v of the orthogonalized update, in [0, 1)."""

    normuon_eps: float = 1e-8
    """ε > 0 added to √v before the update is divided by it."""

    def __post_init__(self) -> None:
        """Reject bad values with the list of valid ones."""
        super().__post_init__()
        check_unit_interval(self.SECTION, "beta2", self.beta2)
        check_positive(self.SECTION, "normuon_eps", self.normuon_eps)


@dataclass
class MOP:
    """MOP's hyperparameters beyond the shared ``[optimizer]`` ones (used when ``optimizer.name = "MOP"``):
    Muon's momentum, orthogonalized by the exact polar factor of a float32 SVD on each matrix's owner."""

    SECTION: ClassVar[str] = "mop"

    momentum: float = 0.95
    """Momentum μ of the matrix parameters' buffer, in [0, 1)."""

    nesterov: bool = False
    """Nesterov momentum (take the polar factor of g.lerp(buf, μ) instead of buf)."""

    scale: Literal["nuclear", "shape"] = "nuclear"
    """Step size of the polar factor O: "nuclear" (lr · the nuclear norm ΣS of the momentum) or "shape"
    (lr scaled by the matrix shape as Muon's, see adjust_lr_fn)."""

    adjust_lr_fn: Literal["match_rms_adamw", "original", "spectral_unclamped"] = "match_rms_adamw"
    """With scale = "shape": "match_rms_adamw" (0.2·√max(A, B): the same [optimizer] lr suits both MOP and
    AdamW parameters), "original" (√max(1, A/B)) or "spectral_unclamped" (√(A/B)). Unused with scale = "nuclear"."""

    wire_dtype: Literal["bfloat16", "float32"] = "float32"
    """Dtype of matrices on the wire between shard holders and owners: "float32" only (the SVD runs in
    float32; "bfloat16" is refused, it would round the SVD's input)."""

    bucket_size_mb: float = 64.0
    """Size of one exchange bucket in MiB."""

    tp_mode: Literal["owned", "duplicated", "distributed", "auto", "blockwise"] = "owned"
    """How tensor-parallel matrices are computed: "owned" (each whole on one owner; exact), "duplicated" (on every
    rank of one TP group; exact), "distributed" (Newton–Schulz across the TP group; Muon family only), "auto"
    (distributed where the cost model says so, else owned), "blockwise" (each TP block on its own: approximate)."""

    exchange: Literal["owner", "gather_all"] = "owner"
    """"owner": each matrix's SVD computed once, on its owner rank; "gather_all": every rank gathers
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
        section = self.SECTION
        check_unit_interval(section, "momentum", self.momentum)
        check_choice(section, "scale", self.scale, MOP_SCALES)
        check_choice(section, "adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR_CHOICES)
        if self.wire_dtype == "bfloat16":
            raise ValueError(
                f"[{section}] wire_dtype = 'bfloat16' is not valid: MOP's SVD runs in float32 and a bfloat16 "
                f"wire would round its input; choose one of: {', '.join(MOP_WIRE_DTYPES)}"
            )
        check_choice(section, "wire_dtype", self.wire_dtype, MOP_WIRE_DTYPES)
        check_engine(section, self)


@dataclass
class SOAP:
    """SOAP's hyperparameters beyond the shared ``[optimizer]`` ones (used when ``optimizer.name = "SOAP"``):
    Adam (``[optimizer]`` beta1, beta2, eps) in the eigenbasis of Shampoo's factors, on each matrix's owner."""

    SECTION: ClassVar[str] = "soap"

    shampoo_beta: float = 0.95
    """Decay β of the Kronecker factors L and R, in [0, 1)."""

    precondition_frequency: int = 1
    """Refresh the eigenbasis every N steps (an integer >= 1)."""

    basis: Literal["qr", "eigh", "cholqr"] = "qr"
    """Eigenbasis refresh: "qr" (one power iteration and QR per side; eigh on the first step), "eigh", or
    "cholqr" (the power iteration orthogonalized by Cholesky QR on matrix products: dtensor_muon.linalg.eigenbasis)."""

    kl: bool = False
    """KL-Shampoo's factor update (each factor whitened by the other side's eigenvalue estimates)."""

    max_preconditioner_dim: int = 8192
    """A side longer than this is not preconditioned (identity basis, no factor kept for it)."""

    correct_bias: bool = True
    """Adam's bias corrections of the two moments."""

    correct_shampoo_beta_bias: bool = True
    """Bias-corrected factors (the first step's factor is G·Gᵀ itself)."""

    max_update_rms: float = 1.0
    """Clip each matrix's update to this RMS (0: no clip); 1.0 as dtensor_muon.SOAP's default."""

    skip_first_update: bool = True
    """A matrix's first step only builds its factors and basis (no update), as dtensor_muon.SOAP's default."""

    match_update_rms: float = 0.0
    """Scale each matrix's update to exactly this RMS (0: off; e.g. 0.2 to reuse an AdamW lr and schedule)."""

    wire_dtype: Literal["bfloat16", "float32"] = "float32"
    """Dtype of the gradient on the wire to its owner: "float32" only (SOAP's factors are float32)."""

    bucket_size_mb: float = 64.0
    """Size of one exchange bucket in MiB."""

    tp_mode: Literal["owned", "duplicated", "distributed", "auto", "blockwise"] = "owned"
    """How tensor-parallel matrices are computed: "owned" (each whole on one owner; exact), "duplicated" (on every
    rank of one TP group; exact), "distributed" (Newton–Schulz across the TP group; Muon family only), "auto"
    (distributed where the cost model says so, else owned), "blockwise" (each TP block on its own: approximate)."""

    exchange: Literal["owner", "gather_all"] = "owner"
    """"owner": each matrix's SOAP state and eigendecompositions on one owner rank; "gather_all": every rank
    computes every matrix (a baseline for tests and benchmarks)."""

    skip_nonfinite: bool = False
    """Skip the whole step (all ranks) when a gradient holds inf/NaN."""

    diagnostics_interval: int = 0
    """Every N steps also compute the costly diagnostics; 0 turns them off."""

    overlap: bool = False
    """Let ``step()`` return with the updates' return exchanges in flight; each module's update is applied
    by a forward pre-hook just before FSDP all-gathers it (hooks attached to every model part)."""

    def __post_init__(self) -> None:
        """Reject bad values with the list of valid ones."""
        section = self.SECTION
        check_unit_interval(section, "shampoo_beta", self.shampoo_beta)
        for name in ("precondition_frequency", "max_preconditioner_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"[{section}] {name} = {value!r} is not valid; it must be an integer >= 1")
        check_choice(section, "basis", self.basis, SOAP_BASES)
        check_positive(section, "max_update_rms", self.max_update_rms, allow_zero=True)
        check_positive(section, "match_update_rms", self.match_update_rms, allow_zero=True)
        if self.wire_dtype == "bfloat16":
            raise ValueError(
                f"[{section}] wire_dtype = 'bfloat16' is not valid: SOAP's factors are float32 and a bfloat16 "
                f"wire would round the gradient; choose one of: {', '.join(MOP_WIRE_DTYPES)}"
            )
        check_choice(section, "wire_dtype", self.wire_dtype, MOP_WIRE_DTYPES)
        check_engine(section, self)


@dataclass
class KLSOAP(SOAP):
    """``[soap]``'s keys with KL-Shampoo's factors on (used when ``optimizer.name = "KLSOAP"``)."""

    SECTION: ClassVar[str] = "klsoap"

    kl: bool = True
    """KL-Shampoo's factor update (each factor whitened by the other side's eigenvalue estimates)."""


@dataclass
class REKLS(KLSOAP):
    """``[soap]``'s keys with KL-Shampoo's factors and a full eigendecomposition every refresh (used when
    ``optimizer.name = "REKLS"``)."""

    SECTION: ClassVar[str] = "rekls"

    basis: Literal["qr", "eigh", "cholqr"] = "eigh"
    """Eigenbasis refresh: "eigh" (a full eigendecomposition), "qr" or "cholqr" (as in [soap])."""


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
