"""Every option of the matrix optimizers, declared once: :data:`OPTIONS`, one table per optimizer.

Each :class:`Option` gives a constructor keyword's name, its default, its allowed values or bounds, whether it is
a param-group key or engine-wide (constructor only), one line of documentation, and how torchtitan reaches it:

- through the optimizer's own config section (``[muon]``, ``[soap]``…), with the same default unless
  ``config_default`` says otherwise (a name where the keyword takes a torch dtype or coefficient triples, or a
  choice better suited to a config: ``config_why`` says which and why);
- from torchtitan's ``[optimizer]`` section (``from_optimizer`` names its keys);
- or not from a config at all (``config_default = NOT_IN_CONFIG``, ``config_why`` says who sets it).

Derived from the table: the torchtitan sections of both torchtitan lines, their checks and the keyword arguments
built from them (:mod:`torchtitan_ext.sections`, :mod:`torchtitan_ext.registry`), and the option tables of
docs/optimizers.md (:func:`option_table` prints one; tests/test_options.py holds the page to them). The front
ends keep explicit signatures, for the reader and for tools; tests/test_options.py holds every signature to its
table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..engine.offload import OFFLOAD_MODES
from ..engine.step import EXCHANGE_MODES
from ..kernels import NS_ALGORITHMS
from ..kernels.low_precision import MOMENTUM_DTYPES
from ..linalg.newton_schulz import KELLER_COEFFICIENTS, NAMED_COEFFICIENTS, SUPPORTED_NS_DTYPES
from ..rules.mop import MOP_SCALES
from ..rules.muon import ADJUST_LR_NAMES
from ..rules.soap import SOAP_BASES

TP_MODES = ("owned", "duplicated", "distributed", "auto", "blockwise")
"""How a param group's tensor-parallel matrices (a ``Shard`` on a mesh dim named ``"tp"``) are computed:
``"owned"`` (default, exact: each matrix whole on one owner of the whole mesh); ``"duplicated"`` (every rank
of one TP group gathers it and computes it; exact); ``"distributed"`` (one TP group runs Newton–Schulz on
its blocks together, all-reducing the Gram matrices; Muon only; equal up to the all-reduce's summation
order); ``"auto"`` (distributed where the cost model of :func:`dtensor_muon.plan.distributed_pays` says so,
else owned); ``"blockwise"`` (each TP block orthogonalized as a matrix of its own: no gather across TP
ranks, not the whole matrix's polar factor)."""

NOT_IN_CONFIG = "not in a config"
"""``config_default`` of an option no torchtitan section holds."""

_SAME = "same as the keyword"


@dataclass(frozen=True)
class Option:
    """One constructor keyword of a matrix optimizer (see the module docstring)."""

    name: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    """The allowed names (for a dtype option: the dtypes' names); empty where ``bounds`` or the type decide."""
    bounds: str = ""
    """"[0, 1)", "> 0", ">= 0" or "integer >= 1": what a number must satisfy."""
    engine: bool = False
    """Engine-wide: a constructor keyword only, never a param-group key."""
    config_default: Any = _SAME
    config_why: str = ""
    from_optimizer: tuple[str, ...] = ()
    """torchtitan's ``[optimizer]`` keys this keyword is built from (lr, weight_decay, beta1/beta2, eps)."""

    @property
    def in_section(self) -> bool:
        """Whether the optimizer's own config section holds this option."""
        return not self.from_optimizer and self.config_default != NOT_IN_CONFIG

    @property
    def section_default(self) -> Any:
        """The default of the option in its config section."""
        return self.default if self.config_default == _SAME else self.config_default

    @property
    def is_dtype(self) -> bool:
        """A torch dtype option: the config holds its name (``"bfloat16"``)."""
        return isinstance(self.default, torch.dtype)

    def keyword_value(self, config_value: Any) -> Any:
        """The constructor keyword's value for the value the config section holds."""
        return getattr(torch, config_value) if self.is_dtype else config_value


ADJUST_LR_CONFIG_WHY = "the same [optimizer] lr then suits the matrices and the AdamW parameters"

# ---------------------------------------------------------------------------------------------------------------
# Shared by every matrix optimizer: the AdamW part, the engine.

ADAMW = (
    Option("adamw_betas", (0.9, 0.95), "AdamW's (β₁, β₂) for the element-wise parameters", bounds="[0, 1)",
           from_optimizer=("beta1", "beta2")),
    Option("adamw_eps", 1e-8, "AdamW's ε", bounds="> 0", from_optimizer=("eps",)),
    Option("adamw_lr", None, "AdamW's learning rate where it differs from lr (None: lr)", bounds=">= 0",
           config_default=NOT_IN_CONFIG, config_why="torchtitan's one [optimizer] lr and schedule drive both"),
    Option("adamw_weight_decay", None, "AdamW's weight decay where it differs from weight_decay (None: the same)",
           bounds=">= 0", config_default=NOT_IN_CONFIG,
           config_why="torchtitan's one [optimizer] weight_decay serves both"),
)  # fmt: skip


NEWTON_SCHULZ_TP_MODES = ("distributed", "auto")
"""tp_mode values only Newton–Schulz has (its distributed form): Muon and NorMuon."""


def _engine(
    wire_dtype: torch.dtype, wire_choices: tuple[str, ...], what: str, tp_modes: tuple[str, ...]
) -> tuple[Option, ...]:
    return (
        Option("wire_dtype", wire_dtype, "dtype of matrices on the wire between shard holders and owners; never "
               f"narrower than {what}", choices=wire_choices, engine=True, config_default=str(wire_dtype)[6:]),
        Option("bucket_size_mb", 64.0, "full-matrix megabytes per exchange bucket", bounds="> 0", engine=True),
        Option("exchange", "owner", '"owner": each matrix computed once, on its owner rank; "gather_all": every '
               "rank gathers and computes every matrix (a baseline)", choices=EXCHANGE_MODES, engine=True),
        Option("skip_nonfinite", False, "skip the whole step on every rank when any gradient holds inf/NaN",
               engine=True),
        Option("diagnostics_interval", 0, "every N steps also measure the costly diagnostics (0: never)",
               bounds="integer >= 0", engine=True),
        Option("overlap", False, "step() returns with the return exchanges in flight; each module's updates are "
               "applied just before FSDP all-gathers it (attach the model)", engine=True),
        Option("offload", "none", '"host": the momentum and AdamW moments in pinned host memory, streamed through '
               "the GPU in buckets each step; \"none\": on the parameters' device", choices=OFFLOAD_MODES,
               engine=True),
        Option("matrix_splits", None, "{parameter-name pattern: MatrixSplit} cutting fused parameters into their "
               "matrices", engine=True, config_default=NOT_IN_CONFIG,
               config_why="a Python object; the torchtitan 0.3 plug-in sets it from the model's fused QKV"),
        Option("tp_mode", "owned", "how tensor-parallel matrices are computed (a group's tp_mode wins): "
               + ", ".join(tp_modes), choices=tp_modes),
    )  # fmt: skip


_WITHOUT_NS_FORMS = tuple(m for m in TP_MODES if m not in NEWTON_SCHULZ_TP_MODES)

QK_CLIP = (
    Option("qk_clip_tau", 0.0, "QK-clip's τ: after each step, heads whose largest logit exceeded τ have their query "
           "and key rows scaled back to it (0: off)", bounds=">= 0", engine=True),
    Option("qk_clip_alpha", 0.5, "QK-clip's α: the query rows take γ^α, the key rows γ^(1−α)", bounds="[0, 1]",
           engine=True),
    Option("qk_clip_heads", None, "{layer name: AttentionHeads}: each attention layer's query and key weights and "
           "heads, for QK-clip", engine=True, config_default=NOT_IN_CONFIG,
           config_why="the torchtitan plug-ins read each attention layer's heads from the model"),
)  # fmt: skip

# ---------------------------------------------------------------------------------------------------------------
# Muon, NorMuon, MOP, SOAP.

_MOMENTUM = Option("momentum", 0.95, "momentum μ of the matrices' buffer", bounds="[0, 1)")
_MOMENTUM_DTYPE = Option("momentum_dtype", "float32", "storage of the matrices' momentum buffer: float32 (the "
                         "parameter's dtype), bfloat16 (stochastic rounding, 2 bytes) or int8 (absmax per 128 "
                         "entries of a row, 1.03 bytes)", choices=MOMENTUM_DTYPES)  # fmt: skip

MUON = (
    Option("lr", 0.02, "learning rate γ (AdamW's too unless adamw_lr is given); 0.02 trains as it comes, "
           "torch.optim.Muon's default is lr=1e-3", bounds=">= 0", from_optimizer=("lr",)),
    Option("weight_decay", 0.1, "decoupled weight decay λ: θ ← θ·(1 − γλ)", bounds=">= 0",
           from_optimizer=("weight_decay",)),
    _MOMENTUM,
    Option("nesterov", True, "orthogonalize g + μ·(B − g) instead of the buffer B"),
    Option("ns_coefficients", KELLER_COEFFICIENTS, "Newton–Schulz coefficients: (a, b, c), one triple per "
           "iteration, or a name", choices=tuple(sorted(NAMED_COEFFICIENTS)), config_default="simple",
           config_why='a name; "simple" is Keller\'s (3.4445, -4.775, 2.0315), the keyword\'s default'),
    Option("eps", 1e-7, "Frobenius-normalization floor of Newton–Schulz", bounds="> 0",
           config_default=NOT_IN_CONFIG, config_why="[optimizer] eps is AdamW's ε; the floor keeps its default"),
    Option("ns_steps", 5, "Newton–Schulz iterations, 1 to 99", bounds="integer >= 1"),
    Option("adjust_lr_fn", None, "per-matrix lr of an A×B matrix: None/original (γ·√max(1, A/B)), "
           "match_rms_adamw (γ·0.2·√max(A, B)), spectral_unclamped (γ·√(A/B)) or a callable",
           choices=ADJUST_LR_NAMES, config_default="match_rms_adamw", config_why=ADJUST_LR_CONFIG_WHY),
    *ADAMW,
    _MOMENTUM_DTYPE,
    Option("ns_dtype", torch.bfloat16, "Newton–Schulz working dtype", choices=tuple(sorted(SUPPORTED_NS_DTYPES)),
           config_default="bfloat16"),
    Option("ns_algorithm", "auto", '"auto" (Gram Newton–Schulz where faster and validated), "standard" or "gram"',
           choices=NS_ALGORITHMS),
    *_engine(torch.bfloat16, ("bfloat16", "float32"), "ns_dtype", TP_MODES),
    Option("ns_cuda_graphs", True, "on CUDA, replay each owner's Newton–Schulz from a CUDA graph per matrix shape "
           "(same bits)", engine=True),
    *QK_CLIP,
)  # fmt: skip

NORMUON = (
    *MUON,
    Option("beta2", 0.95, "decay β₂ of the per-row second moment of the orthogonalized update", bounds="[0, 1)"),
    Option("normuon_eps", 1e-8, "ε added to √v before the update is divided by it", bounds="> 0"),
)

MOP = (
    Option("lr", 0.02, "learning rate γ (AdamW's too unless adamw_lr is given); 0.02 with scale=\"shape\" "
           "trains as it comes", bounds=">= 0", from_optimizer=("lr",)),
    Option("weight_decay", 0.01, "decoupled weight decay λ", bounds=">= 0", from_optimizer=("weight_decay",)),
    _MOMENTUM,
    Option("nesterov", False, "take the polar factor of g + μ·(B − g) instead of the buffer B"),
    Option("scale", "shape", 'step size of the polar factor: "shape" (Muon\'s, adjust_lr_fn) or "nuclear" (lr·ΣS, '
           "Emerging-Optimizers')", choices=MOP_SCALES, config_default="nuclear",
           config_why="torchtitan configs keep the nuclear scale the [mop] section has always had"),
    Option("adjust_lr_fn", None, 'with scale="shape": as Muon\'s', choices=ADJUST_LR_NAMES,
           config_default="match_rms_adamw", config_why=ADJUST_LR_CONFIG_WHY),
    *ADAMW,
    _MOMENTUM_DTYPE,
    *_engine(torch.float32, ("float32",), "the SVD's float32 input", _WITHOUT_NS_FORMS),
    *QK_CLIP,
)  # fmt: skip

SOAP = (
    Option("lr", 1e-2, "learning rate γ, an Adam learning rate (AdamW's too unless adamw_lr is given); 1e-2 "
           "trains as it comes", bounds=">= 0", from_optimizer=("lr",)),
    Option("betas", (0.9, 0.95), "Adam's (β₁, β₂) in the eigenbasis", bounds="[0, 1)",
           from_optimizer=("beta1", "beta2")),
    Option("shampoo_beta", 0.95, "decay β of the Kronecker factors L and R", bounds="[0, 1)"),
    Option("eps", 1e-8, "Adam's ε, also KL's floor of the eigenvalue estimates", bounds="> 0",
           from_optimizer=("eps",)),
    Option("weight_decay", 0.1, "decoupled weight decay λ", bounds=">= 0", from_optimizer=("weight_decay",)),
    Option("precondition_frequency", 1, "steps between eigenbasis refreshes", bounds="integer >= 1"),
    Option("basis", "qr", 'eigenbasis refresh: "qr" (a power iteration and QR), "eigh" or "cholqr"',
           choices=SOAP_BASES),
    Option("kl", False, "KL-Shampoo's factor update"),
    Option("max_preconditioner_dim", 8192, "a side longer than this is not preconditioned", bounds="integer >= 1"),
    Option("correct_bias", True, "Adam's bias corrections of the two moments"),
    Option("correct_shampoo_beta_bias", True, "bias-corrected factors (step 1's factor is G·Gᵀ itself)"),
    Option("max_update_rms", 1.0, "clip each matrix's update to this RMS (0: no clip)", bounds=">= 0"),
    Option("match_update_rms", 0.0, "scale each matrix's update to exactly this RMS (0: off)", bounds=">= 0"),
    Option("skip_first_update", True, "a matrix's first step only builds its factors and basis"),
    *ADAMW,
    *_engine(torch.float32, ("float32",), "the factors' float32 input", _WITHOUT_NS_FORMS),
    *QK_CLIP,
)  # fmt: skip

KLSOAP = tuple(replace(o, default=True) if o.name == "kl" else o for o in SOAP)
REKLS = tuple(replace(o, default="eigh") if o.name == "basis" else o for o in KLSOAP)

OPTIONS: dict[str, tuple[Option, ...]] = {
    "Muon": MUON,
    "MOP": MOP,
    "NorMuon": NORMUON,
    "SOAP": SOAP,
    "KLSOAP": KLSOAP,
    "REKLS": REKLS,
}
"""Each optimizer's options by its class name (``dtensor_muon.<name>``), in signature order for the doc tables."""


def option_table(name: str) -> str:
    """The Markdown table of optimizer ``name``'s options: keyword, default, allowed, torchtitan, meaning."""
    rows = ["| keyword | default | allowed | torchtitan | meaning |", "|---|---|---|---|---|"]
    section = f"[{name.lower()}]"
    for o in OPTIONS[name]:
        default = str(o.default).removeprefix("torch.") if o.is_dtype else repr(o.default)
        if o.name == "ns_coefficients":
            default = "Keller's (3.4445, -4.775, 2.0315)"
        allowed = ", ".join(o.choices) or o.bounds or ("True, False" if isinstance(o.default, bool) else "")
        if o.from_optimizer:
            titan = "[optimizer] " + ", ".join(o.from_optimizer)
        elif o.in_section:
            titan = section + ("" if o.config_default == _SAME else f" = {o.section_default!r}")
        else:
            titan = "–"
        rows.append(f"| `{o.name}` | `{default}` | {allowed} | {titan} | {o.doc} |")
    return "\n".join(rows)
