"""``dtensor_muon.Muon``: torch.optim.Muon's interface, for whole models, on one device or over DTensors.

Matrices (see :mod:`dtensor_muon.routing`) get Muon's orthogonalized momentum update; everything else gets
AdamW. Each user param group is split into a Muon group (``"use_muon": True``) and an AdamW group
(``"use_muon": False``, with ``lr``/``weight_decay`` set from ``adamw_lr``/``adamw_weight_decay`` when given),
so learning-rate schedulers scale both. State is created eagerly: ``momentum_buffer`` for Muon parameters;
``step``, ``exp_avg``, ``exp_avg_sq`` for AdamW parameters, each in its parameter's layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .engine import EXCHANGE_MODES, Engine, Entry
from .kernels import resolve_ns_algorithm
from .layout import read_layout
from .newton_schulz import KELLER_COEFFICIENTS, CoefficientSpec, resolve_coefficients, resolve_ns_dtype
from .overlap import attach_hooks
from .routing import uses_muon
from .rules import adamw as adamw_rule
from .rules.muon import ADJUST_LR_NAMES, AdjustLrFn

MAX_NS_STEPS = 100


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate_hyperparameters(group: dict[str, Any]) -> None:
    """Raise ValueError/TypeError naming the first bad hyperparameter of a param group."""
    for key in ("lr", "weight_decay", "momentum", "eps", "adamw_eps"):
        value = group[key]
        if isinstance(value, bool) or not isinstance(value, (int, float, Tensor)):
            raise TypeError(f"{key} must be a number, got {type(value).__name__}")
    _require(group["lr"] >= 0, f"lr must be >= 0, got {group['lr']}")
    _require(group["weight_decay"] >= 0, f"weight_decay must be >= 0, got {group['weight_decay']}")
    _require(0 <= group["momentum"] < 1, f"momentum must be in [0, 1), got {group['momentum']}")
    _require(group["eps"] > 0, f"eps must be > 0, got {group['eps']}")
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"ns_steps must be an int, got {type(steps).__name__}")
    _require(1 <= steps <= MAX_NS_STEPS, f"ns_steps must be in [1, {MAX_NS_STEPS}], got {steps}")
    resolve_coefficients(group["ns_coefficients"])
    resolve_ns_dtype(group["ns_dtype"])
    resolve_ns_algorithm(group["ns_algorithm"])
    fn = group["adjust_lr_fn"]
    _require(
        fn is None or fn in ADJUST_LR_NAMES or (callable(fn) and not isinstance(fn, str)),
        f"adjust_lr_fn must be None, one of {ADJUST_LR_NAMES} or a callable (lr, shape) -> lr, got {fn!r}",
    )
    betas = group["adamw_betas"]
    _require(
        isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas),
        f"adamw_betas must be two numbers in [0, 1), got {betas!r}",
    )
    _require(group["adamw_eps"] > 0, f"adamw_eps must be > 0, got {group['adamw_eps']}")
    for key in ("adamw_lr", "adamw_weight_decay"):
        _require(group[key] is None or group[key] >= 0, f"{key} must be None or >= 0, got {group[key]}")
    _require(group["use_muon"] in (None, True, False), f"use_muon must be None, True or False, got {group['use_muon']!r}")


class Muon(torch.optim.Optimizer):
    """Muon for matrices, AdamW for the rest; exact on DTensor (FSDP2) parameters.

    Args (shared with torch.optim.Muon, same meaning and defaults):
        params: tensors, ``(name, tensor)`` pairs (e.g. ``model.named_parameters()``) or param groups.
        lr: learning rate γ (AdamW's too unless ``adamw_lr`` is given).
        weight_decay: decoupled weight decay λ: θ ← θ·(1 − γλ).
        momentum: μ in [0, 1).
        nesterov: use g + μ·(B − g) instead of B.
        ns_coefficients: (a, b, c), a list of triples (one per iteration, last repeated) or a name from
            :data:`dtensor_muon.newton_schulz.NAMED_COEFFICIENTS`.
        eps: Frobenius-normalization floor of Newton–Schulz.
        ns_steps: Newton–Schulz iterations, 1 to 100.
        adjust_lr_fn: None/"original" (√max(1, A/B)), "match_rms_adamw" (0.2·√max(A, B)), or a callable
            ``(lr, (A, B)) -> lr`` for an A×B matrix.
    Keyword-only:
        adamw_betas, adamw_eps, adamw_lr, adamw_weight_decay: AdamW for element-wise parameters.
        ns_dtype: Newton–Schulz working dtype (bfloat16, float32, float16).
        ns_algorithm: "auto" (Gram Newton–Schulz where it is faster and validated: Keller's coefficients,
            large rectangular matrices on the GPU backend), "standard" or "gram" (measured as accurate as
            the standard form for Keller's, quintic and 8-step Polar Express coefficients; not for CANS or
            5-step Polar Express); see :func:`dtensor_muon.newton_schulz.newton_schulz`.
        wire_dtype: dtype of the exchange (bf16 by default; None = parameter dtype). Must not round the
            Newton–Schulz input: bf16 with float32 ns_dtype is refused.
        bucket_size_mb: full-matrix megabytes per exchange bucket.
        exchange: "owner" (each matrix on one owner rank) or "gather_all" (baseline: every rank computes all).
        skip_nonfinite: if any rank sees an inf/NaN gradient, every rank skips the step.
        diagnostics_interval: every N steps, measure the orthogonality error and AdamW update RMS (0: never).
        overlap: ``step()`` returns with the return exchanges in flight; each module's updates are applied by
            a forward pre-hook just before FSDP all-gathers it (call :meth:`attach` with the model), and
            everything is flushed before the next step, any ``state_dict()`` and by :meth:`flush`.
        ns_cuda_graphs: on CUDA, replay each owner's Newton–Schulz from a CUDA graph per matrix shape (same
            bits; for matrices of up to 2³⁴ multiply-adds per Gram matrix, e.g. 2048×4096, whose eager
            launches cost the host longer than the GPU work, see :mod:`dtensor_muon.ns_graphs`). Each graph
            keeps a few matrices of memory.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: CoefficientSpec = KELLER_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: AdjustLrFn = None,
        *,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        ns_algorithm: str = "auto",
        wire_dtype: torch.dtype | None = torch.bfloat16,
        bucket_size_mb: float = 64.0,
        exchange: str = "owner",
        skip_nonfinite: bool = False,
        diagnostics_interval: int = 0,
        overlap: bool = False,
        ns_cuda_graphs: bool = True,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("lr: a Tensor lr must have one element")
        _require(exchange in EXCHANGE_MODES, f"exchange must be one of {EXCHANGE_MODES}, got {exchange!r}")
        _require(bucket_size_mb > 0, f"bucket_size_mb must be > 0, got {bucket_size_mb}")
        _require(
            isinstance(diagnostics_interval, int) and diagnostics_interval >= 0,
            f"diagnostics_interval must be an int >= 0, got {diagnostics_interval!r}",
        )
        _require(
            wire_dtype is None or (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point),
            f"wire_dtype must be None or a floating dtype, got {wire_dtype!r}",
        )
        _require(isinstance(ns_cuda_graphs, bool), f"ns_cuda_graphs must be a bool, got {ns_cuda_graphs!r}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            adamw_betas=adamw_betas,
            adamw_eps=adamw_eps,
            adamw_lr=adamw_lr,
            adamw_weight_decay=adamw_weight_decay,
            ns_dtype=ns_dtype,
            ns_algorithm=ns_algorithm,
            use_muon=None,
        )
        self._engine_options = dict(
            wire_dtype=wire_dtype,
            bucket_bytes=int(bucket_size_mb * 2**20),
            exchange=exchange,
            skip_nonfinite=skip_nonfinite,
            diagnostics_interval=diagnostics_interval,
            overlap=bool(overlap),
            ns_cuda_graphs=ns_cuda_graphs,
        )
        self._engine: Engine | None = None
        self._hook_handles: list = []
        super().__init__(params, defaults)
        self._engine = self._build_engine()
        self.register_state_dict_pre_hook(lambda optimizer: optimizer.flush())
        self.register_load_state_dict_pre_hook(lambda optimizer, state_dict: optimizer.flush())
        self.register_load_state_dict_post_hook(Muon._rebuild_after_load)

    # ---------------------------------------------------------------- groups and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Split ``param_group`` into its Muon part and its AdamW part, validate, and create state eagerly."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        raw = param_group["params"]
        items = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [(p[0], p[1]) if isinstance(p, tuple) else (None, p) for p in items]
        group = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        validate_hyperparameters(group)
        for name, p in named:
            label = name or f"params[{len(self._all_params())}]"
            if not isinstance(p, Tensor):
                raise TypeError(f"parameter {label!r}: expected a Tensor, got {type(p).__name__}")
            if p.is_complex():
                raise ValueError(f"parameter {label!r}: complex parameters are not supported")
            if p.is_sparse:
                raise ValueError(f"parameter {label!r}: sparse parameters are not supported")
            if group["use_muon"] and p.ndim < 2:
                raise ValueError(f"parameter {label!r}: use_muon=True needs ≥2 dims, got shape {tuple(p.shape)}")
        for use_muon in (True, False):
            part = [(n, p) for n, p in named if uses_muon(n, p, group["use_muon"]) == use_muon]
            if not part:
                continue
            sub = dict(param_group)
            sub["params"] = [(n, p) if n is not None else p for n, p in part]
            sub["use_muon"] = use_muon
            if not use_muon:
                sub["lr"] = group["adamw_lr"] if group["adamw_lr"] is not None else group["lr"]
                sub["weight_decay"] = (
                    group["adamw_weight_decay"] if group["adamw_weight_decay"] is not None else group["weight_decay"]
                )
            super().add_param_group(sub)
            for _, p in part:
                self.state[p] = {"momentum_buffer": torch.zeros_like(p)} if use_muon else adamw_rule.init_state(p)
        if self._engine is not None:
            self.flush()
            self._engine = self._build_engine()

    def _all_params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _build_engine(self) -> Engine:
        entries = []
        for group in self.param_groups:
            names = group.get("param_names") or [None] * len(group["params"])
            for name, p in zip(names, group["params"]):
                index = len(entries)
                label = name or f"params[{index}]"
                entries.append(Entry(index, label, p, group, group["use_muon"], read_layout(label, p)))
        return Engine(entries, **self._engine_options)

    @staticmethod
    def _rebuild_after_load(optimizer: Muon) -> None:
        for group in optimizer.param_groups:  # checkpoints from before the option existed
            group.setdefault("ns_algorithm", "auto")
        optimizer._engine = optimizer._build_engine()

    # ---------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step for every parameter with a gradient (on any rank). Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        assert self._engine is not None
        if self._engine.overlap and not self._hook_handles:
            raise RuntimeError(
                "overlap=True: call optimizer.attach(model) before the first step, so each module's update "
                "is applied before its next forward and before any state_dict()"
            )
        self._engine.step(self.state)
        return loss

    # ---------------------------------------------------------------- overlap
    def attach(self, *modules: torch.nn.Module) -> None:
        """Register the overlap hooks on ``modules`` (the model, or its parts): see :mod:`dtensor_muon.overlap`.

        Needed with ``overlap=True``; harmless without (every update is then applied inside ``step()``).
        """
        if not modules:
            raise ValueError("attach: give the model (or its parts) whose parameters this optimizer updates")
        assert self._engine is not None
        index_of_param = {id(e.param): e.index for e in self._engine.entries if e.use_muon}
        self._hook_handles.extend(attach_hooks(modules, index_of_param, self._finish, self.flush))

    def detach(self) -> None:
        """Apply pending updates and remove the overlap hooks."""
        self.flush()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    def _finish(self, indices: list[int]) -> None:
        if self._engine is not None:
            with torch.no_grad():
                self._engine.finish(indices)

    def flush(self) -> None:
        """Apply every pending update now (overlap mode); a no-op when nothing is pending."""
        if self._engine is not None:
            with torch.no_grad():
                self._engine.flush()

    @property
    def metrics(self) -> dict[str, float]:
        """Diagnostics of the last step (see :mod:`dtensor_muon.metrics` for the keys)."""
        return self._engine.metrics if self._engine is not None else {}

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank saw a non-finite gradient (``skip_nonfinite=True``)."""
        return self._engine.skipped_steps if self._engine is not None else 0

    @property
    def plans(self) -> list:
        """The per-mesh plans (owners, buckets, per-rank cost and bytes)."""
        return [w.plan for w in self._engine.meshes] if self._engine is not None else []
